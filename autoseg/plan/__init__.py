"""Fingerprint and plan: what the dataset is (``fingerprint``), and every decision made from it and the memory
budget (``budget``): the planner (``planner``: the configurations and their spacing; ``configuration``: patch,
batch, accumulation, network, precision, checkpointing of one, searched by ``patch_search``, which prices each
step it tries with ``step_cost``), the preprocessing processes and loader workers (``sizing``), the loader and
augmentation the plan asks for (``training_data``), the ``Plans`` schema (``plans``), compute (``throughput``:
FLOPs of a step, the rates a step runs at, GPU FLOP/s; ``calibration``: this CPU's rates, by timing the training
step, fitted and checked by ``rate_fit``), reference plans of public datasets
(``reference``), and ``run.plan_dataset`` (`autoseg plan`).

Owns: ``fingerprint``, ``budget``, ``planner``, ``configuration`` (one configuration's settings, search and
notes), ``patch_search``, ``step_cost`` (a step's predicted bytes, FLOPs and seconds), ``topology_rules`` (the
network a patch gets), ``iteration_target`` (the seconds a CPU iteration is sized to, from the time budget),
``sizing``, ``training_data``, ``plans``, ``inference_tile`` (the sliding window's tile
at prediction), ``throughput``, ``calibration``, ``rate_fit``, ``reference``, ``run``, ``like`` (``plan --like``: a
dataset planned with a trained model's network, ``PlanTemplate``).
Imports: ``autoseg.memory``, ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``.
"""
