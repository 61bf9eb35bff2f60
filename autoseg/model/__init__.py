"""The network and THE training step: the topology a plan names, the network registry
(``build_network`` builds ``topology.architecture``), the loss, ``TrainStep`` (the only code that runs a
backward pass: training, the memory model and the throughput calibration all run it), the sliding-window
forward (tile layout, tile batches) and the collectives of a multi-process run.

Owns: ``topology``, ``network``, ``loss``, ``step``, ``sliding_window``, ``distributed``.
Imports: ``autoseg.core``, ``autoseg.dataset``.
"""
