"""Fingerprint and plan: what the dataset is (``fingerprint``), and every decision made from it and the memory
budget (``planner``: spacing, patch, batch, accumulation, network, precision, checkpointing, process and
worker counts; ``patch_search``; ``training_data``: the loader and augmentation the plan asks for), the
``Plans`` schema (``plans``), compute (``throughput``: FLOPs of a step, CPU calibration by timing the training
step, GPU FLOP/s), reference plans of public datasets (``reference``), and ``run.plan_dataset``
(`autoseg plan`).

Owns: ``fingerprint``, ``planner``, ``patch_search``, ``training_data``, ``plans``, ``throughput``, ``reference``,
``run``.
Imports: ``autoseg.memory``, ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``.
"""
