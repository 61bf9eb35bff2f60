"""FLOPs of a network's convolutions counted from its topology alone, without building it (and without torch): the
planner sizes patches by them. ``forward_conv_flops``: the residual encoder U-Net's (``autoseg.model.residual``)
forward pass; the plain U-Net's training step is ``autoseg.plan.throughput.conv_flops``.
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
