"""Compute beside memory: FLOPs of a training step and this machine's measured CPU throughput.

The planner needs seconds per iteration on CPU, where compute (not memory) is what limits the plan.
``calibrate_cpu_throughput`` times a few real training steps of a small U-Net on this machine and
returns the effective FLOP/s of such steps (norms, activations and the optimizer included), so that
``conv_flops / throughput`` predicts the seconds of a planned step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autoseg.model.topology import NetworkTopology


def conv_flops(topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int) -> float:
    """FLOPs of one training step (forward + backward ~ 3x forward), counted over convolutions.

    A k-voxel kernel from C_in to C_out channels over N output voxels costs 2 k C_in C_out N.
    """
    voxels = np.array(patch_size, dtype=np.float64)
    total = 0.0
    prev = topology.in_channels
    skip_voxels = []
    for f, k, st in zip(topology.features_per_stage, topology.kernel_sizes, topology.strides):
        voxels = voxels / np.array(st)
        kvol = float(np.prod(k))
        n = float(np.prod(voxels))
        total += 2 * kvol * prev * f * n + (topology.conv_per_stage - 1) * 2 * kvol * f * f * n
        prev = f
        skip_voxels.append(n)
    for s in range(topology.num_stages - 2, -1, -1):
        f, k, n = topology.features_per_stage[s], topology.kernel_sizes[s], skip_voxels[s]
        kvol = float(np.prod(k))
        total += 2 * prev * f * n  # transposed convolution, kernel = stride
        total += 2 * kvol * 2 * f * f * n + (topology.conv_per_stage - 1) * 2 * kvol * f * f * n
        total += 2 * f * topology.num_outputs * n  # segmentation head
        prev = f
    return 3.0 * total * batch_size


CALIBRATION_TOPOLOGY = NetworkTopology(
    dim=3, in_channels=1, num_outputs=3, features_per_stage=(16, 32, 64, 128),
    kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)),
)
CALIBRATION_PATCH = (16, 48, 48)


def training_step_closure(topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int,
                          seed: int = 0) -> Callable[[], object]:
    """THE training step (``autoseg.model.step``) on a fresh network and synthetic batches, as a callable to time."""
    import torch

    from autoseg.dataset.labels import LabelScheme
    from autoseg.model.step import build_step, synthetic_batches

    scheme = LabelScheme.for_outputs(topology.num_outputs)
    step = build_step(topology, scheme)
    batches = synthetic_batches(topology, scheme, batch_size, tuple(patch_size), torch.Generator().manual_seed(seed))
    return lambda: step(batches)


def calibrate_cpu_throughput(repeats: int = 3, max_threads: int | None = None) -> float:
    """Effective FLOP/s of U-Net training steps on this machine's CPU (a few seconds to measure), with the
    faster of all threads and one (as the trainer chooses): with all threads against another busy process
    the step measured up to 20x slower (3.2 instead of 65 GFLOP/s on 2 cores), which would shrink the plan."""
    from autoseg.core.resources import cpu_count, fastest_thread_count

    step = training_step_closure(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2)
    _, timings = fastest_thread_count(step, max_threads or cpu_count(), repeats)
    return conv_flops(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2) / min(timings.values())
