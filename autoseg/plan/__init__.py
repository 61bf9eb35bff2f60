"""Fingerprint and plan: what the dataset is (``fingerprint``), and every decision made from it and the memory
budget (``planner``: spacing, patch, batch, accumulation, network, precision, checkpointing, process and
worker counts; ``patch_search``; ``training_data``: the loader and augmentation the plan asks for), the
``Plans`` schema (``plans``), compute (``compute``: FLOPs, CPU calibration by timing the training step;
``throughput``: GPU FLOP/s), reference plans of public datasets (``reference``), and ``run.plan_dataset``
(`autoseg plan`).

Owns: the plan and the Plans schema.
Imports: ``autoseg.memory``, ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``.
"""
