"""Compute beside memory: FLOPs of a training step and this machine's measured CPU throughput.

The planner needs seconds per iteration on CPU, where compute (not memory) is what limits the plan.
``calibrate_cpu_throughput`` times a few real training steps of a small U-Net on this machine and
returns the effective FLOP/s of such steps (norms, activations and the optimizer included), so that
``conv_flops / throughput`` predicts the seconds of a planned step.
"""

from __future__ import annotations

import time
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
                          seed: int = 0) -> Callable[[], None]:
    """A real training step (forward, Dice+CE with deep supervision, backward, SGD) on a fresh network and
    random data, as a callable to time."""
    import torch

    from autoseg.dataset.labels import LabelScheme
    from autoseg.model.loss import compute_loss, training_loss
    from autoseg.model.network import build_network

    gen = torch.Generator().manual_seed(seed)
    network = build_network(topology)
    optimizer = torch.optim.SGD(network.parameters(), lr=1e-3, momentum=0.99, nesterov=True)
    loss_fn = training_loss(LabelScheme.for_outputs(topology.num_outputs), topology.num_stages - 1)
    x = torch.randn(batch_size, topology.in_channels, *patch_size, generator=gen)
    y = torch.randint(0, topology.num_outputs, (batch_size, 1, *patch_size), generator=gen)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        compute_loss(network(x), y, loss_fn).backward()
        optimizer.step()

    return step


def time_training_step(topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int,
                       repeats: int = 3, seed: int = 0) -> float:
    """Median wall seconds of a real training step, after one warm-up step."""
    step = training_step_closure(topology, patch_size, batch_size, seed)
    step()  # warms up kernels and the allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def calibrate_cpu_throughput(repeats: int = 3, max_threads: int | None = None) -> float:
    """Effective FLOP/s of U-Net training steps on this machine's CPU (a few seconds to measure), with the
    faster of all threads and one (as the trainer chooses): with all threads against another busy process
    the step measured up to 20x slower (3.2 instead of 65 GFLOP/s on 2 cores), which would shrink the plan."""
    from autoseg.core.resources import cpu_count

    step = training_step_closure(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2)
    _, timings = fastest_thread_count(step, max_threads or cpu_count(), repeats)
    return conv_flops(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2) / min(timings.values())


def fastest_thread_count(run_once: Callable[[], object], max_threads: int,
                         repeats: int = 2) -> tuple[int, dict[int, float]]:
    """Time ``run_once`` (e.g. one training step) with ``max_threads`` and with 1 torch thread; return the
    faster count and the median seconds of each. With another busy process on the same cores, OpenMP threads
    spinning against it made U-Net steps 4-17x slower than one thread (measured on 2 cores); on an idle
    machine all threads win. The caller's thread count is restored."""
    import torch

    previous = torch.get_num_threads()
    timings: dict[int, float] = {}
    try:
        for threads in sorted({max_threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            run_once()  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_once()
                times.append(time.perf_counter() - t0)
            timings[threads] = float(np.median(times))
    finally:
        torch.set_num_threads(previous)
    return min(timings, key=timings.get), timings
