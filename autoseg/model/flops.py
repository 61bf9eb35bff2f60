"""FLOPs of a network's convolutions, and the elements of its feature maps, counted from its topology alone, without
building it (and without torch): the planner sizes patches by them. ``forward_conv_flops``: the residual encoder
U-Net's (``autoseg.model.residual``) forward pass; the plain U-Net's training step is
``autoseg.plan.throughput.conv_flops``. ``feature_map_elements``: the outputs of every convolution of a forward
pass, either architecture (the memory-bound work of a CPU step, ``autoseg.plan.throughput.StepRates``).
"""

from __future__ import annotations

import math

from autoseg.model.topology import NetworkTopology


def forward_conv_flops(topology: NetworkTopology, patch_size: tuple[int, ...]) -> float:
    """FLOPs of the convolutions of one forward pass of one sample (2 k C_in C_out per output voxel), as
    torch's ``FlopCounterMode`` counts ``aten.convolution``: the transposed convolutions over their input voxels."""
    voxels = float(math.prod(patch_size))
    features, outputs = topology.features_per_stage, topology.num_outputs
    total, prev, stage_voxels = 0.0, topology.in_channels, []
    for s, (f, k, st) in enumerate(zip(features, topology.kernel_sizes, topology.strides)):
        voxels /= math.prod(st)
        kvol, blocks = math.prod(k), topology.blocks_per_stage[s]
        if s == 0:  # the stem
            total += 2 * kvol * prev * f * voxels
            prev = f
        total += 2 * kvol * (prev * f + f * f) * voxels  # first block
        total += 2 * prev * f * voxels if prev != f else 0.0  # its 1x1 projection
        total += (blocks - 1) * 2 * kvol * 2 * f * f * voxels
        prev = f
        stage_voxels.append(voxels)
    for s in range(topology.num_stages - 2, -1, -1):
        f, kvol, n = features[s], math.prod(topology.kernel_sizes[s]), stage_voxels[s]
        total += 2 * prev * f * n  # transposed conv, kernel = stride: counted over its input, = its output voxels
        total += 2 * kvol * (2 * f * f + (topology.conv_per_stage - 1) * f * f) * n
        total += 2 * f * outputs * n  # segmentation head (deep supervision: every decoder stage)
        prev = f
    return total


def stage_elements(topology: NetworkTopology, patch_size: tuple[int, ...]) -> list[tuple[float, float]]:
    """Per stage of one sample's forward pass: (elements of one of its feature maps, elements of the outputs of all
    its convolutions). Counted: the encoder convolutions with the stage's kernel (``NetworkTopology.encoder_convs``),
    per decoder stage the transposed convolution and its ``conv_per_stage`` convolutions; not counted: skip
    projections and the 1x1 segmentation heads."""
    voxels = float(math.prod(patch_size))
    stages = []
    for f, convs, st in zip(topology.features_per_stage, topology.encoder_convs(), topology.strides):
        voxels /= math.prod(st)
        stages.append([f * voxels, convs * f * voxels])
    for s in range(topology.num_stages - 1):
        stages[s][1] += (1 + topology.conv_per_stage) * stages[s][0]
    return [(one, outputs) for one, outputs in stages]


def feature_map_elements(topology: NetworkTopology, patch_size: tuple[int, ...]) -> float:
    """Elements of the outputs of every convolution of one forward pass of one sample (``stage_elements``). Each is
    normalized and activated, forward and backward: the work of a training step that runs at memory speed, not at
    the convolutions' FLOP rate."""
    return sum(outputs for _, outputs in stage_elements(topology, patch_size))
