"""Training one fold (``trainer.train``, with the run's knobs in ``run_config.RunConfig``): the loop around
``autoseg.model.step.TrainStep`` (``epochs``), the run's progress as one artifact (``progress``) written to every
checkpoint (``checkpoint``, exact resume) and summed up in run.json (``run_record``), out-of-memory degradation
(``degrade``), the poly schedule and time budget (``schedule``), the per-epoch patch validation
(``patch_validation``), progress.png (``curves``), experiment trackers (``tracking``: TensorBoard, MLflow) and the
final validation of the fold's cases (``validation``).

Owns: ``trainer`` (setup, resume, the end of a run), ``run_state`` (what a run trains and the run in progress),
``epochs`` (the epoch loop), ``progress`` (``TrainingProgress``), ``run_record`` (run.json), ``folds`` (several folds
in turn, resumable as a whole), ``run_config``, ``checkpoint``, ``degrade``, ``memory_check`` (the memory model
checked against the first real steps, and ``autoseg check-memory``), ``memory_probes`` (what that check measures,
on CPU and CUDA), ``memory_report`` (its rows, verdict, log line and table), ``schedule``, ``prediction_rates`` (the
final validation's prediction timed for the time budget), ``data_pipeline`` (loader workers, precomputed copies),
``patch_validation``, ``curves``, ``validation``, ``fold_data`` (a fold's cases and, for the cascade, each case's
out-of-fold previous-stage label map), ``precision_check`` (the fold's bf16 agreement check made: after the final
validation, and for ``autoseg export-model``), ``class_weights`` (the fold's class decision weights fitted on its
final validation), ``tracking`` (``--track``: TensorBoard event files, an MLflow
run), ``source_model`` (a trained model read for ``--init-from`` and ``plan --like``: an archive, a checkpoint or a
workspace), ``init_weights`` (``--init-from``: its weights copied into a fresh run, fine-tuning).
Imports: ``autoseg.predict``, ``autoseg.evaluate``, ``autoseg.data`` and below.
"""
