"""Preprocessing: cropping to the nonzero region, normalization, resampling, precomputed spatial augmentations,
and ``store`` (the only code that knows the preprocessed case format on disk; ``mapped_npy``: the memory maps
it reads arrays through); ``run.preprocess_workspace`` is `autoseg plan_and_preprocess`'s second half.

Owns: ``normalization``, ``resampling``, ``precompute``, ``preprocessor`` (one case), ``parallel`` (every case of a
configuration, in worker processes), ``store``, ``mapped_npy``, ``run``, ``stale_results`` (the trained folds
``--overwrite`` sets aside), ``plan_fields`` (the plan fields preprocessed data and trained networks depend on).
Imports: ``autoseg.plan``, ``autoseg.memory``, ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``.
"""
