"""Prediction (`autoseg predict`): new scans preprocessed like the training cases, the sliding window of
``autoseg.model.sliding_window`` over the trained folds, and the segmentation exported in the input's exact
geometry.

Owns: ``predictor`` (``predict``: the loop over a command's cases), ``case`` (one case's three stages),
``window`` (``WindowOptions``: the sliding window's settings, made once per command), ``command`` (``autoseg
predict``'s request, from a workspace or a model archive), ``export`` (probabilities back to the
input's grid as a label map, slab by slab), ``pipeline`` (cases read ahead and written behind on threads, sized
from the host RAM), ``probabilities`` (``{case}.npz``: written, read back, made a label map),
``postprocessing`` (the largest connected component kept, ``apply_postprocessing``), ``choice``
(``inference.json``, what ``autoseg find-best`` chose), ``chosen`` (prediction as inference.json says: an
ensemble of two configurations, the postprocessing), ``archive`` (a
trained model as one zip: its format, ``autoseg export-model``), ``archive_reader`` (an archive checked and
unpacked for ``predict -m``), ``networks`` (the folds' checkpoints loaded, as
tile runners, and a configuration's ``Predictor``), ``graphs`` (a checkpoint's checked ONNX graph: the archive's member,
or kept in the machine cache), ``runners`` (``load_predictor``: the folds as the command's ``--runtime`` runs
them), ``runtime_choice`` (``--runtime``/``--precision auto``: the candidates timed, the fastest chosen),
``precision_check`` (a fold's bf16 agreement check and ``bf16_verdict``, what ``--precision auto`` asks of it),
``class_weights`` (a fold's class decision weights, a factor per class on the label map's argmax),
``runtime_memory`` (a graph runtime's working bytes for the memory plan: measured once by ``runtime_probe``, a fresh
process running the real call, and kept per machine and model),
``cascade`` (3d_cascade_fullres: 3d_lowres first, its label map one-hot as extra input channels), ``case_review``
(``--preview`` and ``--statistics``: what each case's export writes beside its label map, through ``autoseg.review``),
``outputs`` (the files a case gets: its label map in ``--output-format``'s format, what is written beside it),
``segmenter`` (``Segmenter``: a model loaded once, images in memory segmented in this process; the model a command
names resolved: ``opened_model``, ``resolve_model``), ``image_input`` (what ``Segmenter.predict`` takes: SimpleITK
images or numpy arrays with their geometry, checked against the model, and the label map it gives back),
``uncertainty`` (the folds' disagreement per case: ``uncertainty.csv``, the cases to review first, the entropy map).
Imports: ``autoseg.review`` and below; not ``autoseg.evaluate``.
"""
