"""Prediction (`autoseg predict`): new scans preprocessed like the training cases, the sliding window of
``autoseg.model.sliding_window`` over the trained folds, and the segmentation exported in the input's exact
geometry.

Owns: ``predictor``, ``archive`` (a trained model as one zip: ``autoseg export-model``, ``predict -m``).
Imports: ``autoseg.preprocess`` and below; not ``autoseg.evaluate``.
"""
