"""The training data pipeline: patch sampling with foreground oversampling (``sampler``), nnU-Net's default
augmentation (``augment``; rotation and scaling in ``augment_spatial``) and the ``BatchLoader`` (``loader``):
worker processes handing batches over through reused shared memory.

Owns: ``sampler``, ``augment``, ``augment_spatial``, ``loader``.
Imports: ``autoseg.preprocess`` (the store, the rotation matrix), ``autoseg.plan`` (``LoaderConfig``), and below.
"""
