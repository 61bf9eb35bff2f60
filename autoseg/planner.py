"""The planner: from a fingerprint and a budget (device memory, host RAM, device kind) to Plans.

Per configuration it derives the target spacing, the network topology (pooling per axis and kernel
sizes from the spacing), and searches patch size and micro-batch so that the predicted peak of one
training step stays under the budget (and, on CPU, an iteration stays within a time target).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoseg.compute import conv_flops
from autoseg.fingerprint import Fingerprint
from autoseg.normalization import scheme_for_channel
from autoseg.plans import ConfigurationPlan, NetworkTopology, Plans

GiB = 1024**3
MIN_FEATURE_MAP = 4  # no axis is pooled below this many voxels
ANISOTROPY_RATIO = 3.0  # an axis whose spacing is > 3x the finest is "strongly anisotropic"
MAX_STAGES = {2: 7, 3: 6}
FEATURE_CAP = {2: 512, 3: 320}


@dataclass(frozen=True)
class Budget:
    """What the plan must fit in. ``device`` is where training runs: "cuda" or "cpu"."""

    gpu_memory_bytes: int = 8 * GiB
    host_ram_bytes: int = 16 * GiB
    device: str = "cuda"
    safety_margin: float = 0.10  # fraction of gpu_memory_bytes kept free
    cpu_seconds_per_iteration: float = 1.0  # target on CPU (compute, not memory, is the limit there)
    cpu_flops_per_second: float = 20e9  # measured by calibrate_cpu_throughput() when planning for CPU
    base_features: int | None = None  # None: 32 on CUDA, 16 on CPU


PeakFn = Callable[[NetworkTopology, int, tuple[int, ...], str, bool], int]


def target_spacing(spacings_mm: np.ndarray, shapes_zyx: np.ndarray) -> tuple[float, float, float]:
    """Median spacing; on a strongly anisotropic axis the 10th percentile instead (finer), never finer
    than the coarsest other axis. ``spacings_mm`` and ``shapes_zyx`` are (N, 3)."""
    target = np.median(spacings_mm, axis=0)
    median_shape = np.median(shapes_zyx, axis=0)
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = target[worst] > ANISOTROPY_RATIO * min(target[others])
    aniso_voxels = median_shape[worst] * ANISOTROPY_RATIO < min(median_shape[others])
    if aniso_spacing and aniso_voxels:
        p10 = float(np.percentile(spacings_mm[:, worst], 10))
        target[worst] = max(p10, max(target[others])) + 1e-5
    return tuple(float(v) for v in target)  # type: ignore[return-value]


def topology_for(patch_size: tuple[int, ...], spacing_mm: tuple[float, ...], in_channels: int,
                 num_classes: int, base_features: int, max_features: int) -> tuple[NetworkTopology, tuple[int, ...]]:
    """Pooling per axis and kernel sizes from the spacing (nnU-Net's rule, our code).

    An axis is pooled while its current spacing is at most twice the finest one and its feature map
    stays >= MIN_FEATURE_MAP voxels; its kernel is 3 once its spacing is within 2x of the finest,
    else 1 (in-plane only convolutions for thick slices). Returns the topology and the patch size
    rounded up to a multiple of the total stride per axis.
    """
    dim = len(patch_size)
    spacing = list(spacing_mm)
    size = list(patch_size)
    strides: list[tuple[int, ...]] = [tuple([1] * dim)]
    kernels: list[tuple[int, ...]] = []
    kernel = [3 if s <= 2 * min(spacing) else 1 for s in spacing]
    kernels.append(tuple(kernel))
    while len(strides) < MAX_STAGES[dim]:
        finest = min(spacing)
        pool = [1 if (spacing[a] > 2 * finest or size[a] < 2 * MIN_FEATURE_MAP) else 2 for a in range(dim)]
        if all(p == 1 for p in pool):
            break
        spacing = [s * p for s, p in zip(spacing, pool)]
        size = [math.ceil(n / p) for n, p in zip(size, pool)]
        finest = min(spacing)
        kernel = [3 if (k == 3 or s <= 2 * finest) else 1 for k, s in zip(kernel, spacing)]
        strides.append(tuple(pool))
        kernels.append(tuple(kernel))
    features = tuple(min(base_features * 2**s, max_features) for s in range(len(strides)))
    topology = NetworkTopology(dim=dim, in_channels=in_channels, num_classes=num_classes,
                               features_per_stage=features, kernel_sizes=tuple(kernels), strides=tuple(strides))
    div = topology.patch_divisor()
    patch = tuple(int(math.ceil(p / d) * d) for p, d in zip(patch_size, div))
    return topology, patch


def initial_patch(spacing_mm: tuple[float, ...], median_shape: tuple[int, ...], voxels: float) -> list[int]:
    """A patch with the aspect ratio of 1/spacing, ``voxels`` large, capped by the median shape."""
    inv = 1.0 / np.array(spacing_mm)
    shape = inv / np.prod(inv) ** (1.0 / len(inv)) * voxels ** (1.0 / len(inv))
    return [int(min(round(s), m)) for s, m in zip(shape, median_shape)]


def search_patch_and_batch(spacing_mm: tuple[float, ...], median_shape: tuple[int, ...], in_channels: int,
                           num_classes: int, budget: Budget, peak_fn: PeakFn, dim: int,
                           max_batch: int) -> tuple[NetworkTopology, tuple[int, ...], int, int]:
    """Shrink the patch (largest axis relative to the median shape first) until batch 2 fits, then
    grow the batch while it fits. Returns (topology, patch, micro-batch, predicted peak bytes)."""
    base = budget.base_features or (32 if budget.device == "cuda" else 16)
    limit = budget.gpu_memory_bytes * (1 - budget.safety_margin)
    patch = initial_patch(spacing_mm, median_shape, 256.0**dim if dim == 3 else 2048.0**2)

    def cost(topo: NetworkTopology, p: tuple[int, ...], b: int) -> tuple[bool, int]:
        peak = peak_fn(topo, b, p, "fp32", False)
        fits = peak <= limit
        if budget.device == "cpu":
            fits = fits and conv_flops(topo, p, b) / budget.cpu_flops_per_second <= budget.cpu_seconds_per_iteration
        return fits, peak

    while True:
        topo, p = topology_for(tuple(patch), spacing_mm, in_channels, num_classes, base, FEATURE_CAP[dim])
        fits, peak = cost(topo, p, 2)
        if fits or all(v <= MIN_FEATURE_MAP * 2 for v in patch):
            break
        ratios = [pv / m for pv, m in zip(p, median_shape)]
        axis = int(np.argmax([r if patch[a] > MIN_FEATURE_MAP * 2 else -1 for a, r in enumerate(ratios)]))
        patch[axis] = max(MIN_FEATURE_MAP * 2, int(patch[axis] * 0.9))
    batch = 2 if fits else 1
    peak = cost(topo, p, batch)[1]
    while batch < max_batch:
        fits_next, peak_next = cost(topo, p, batch + 1)
        if not fits_next:
            break
        batch, peak = batch + 1, peak_next
    return topo, p, batch, peak


def max_batch_for(dataset_voxels: float, patch: tuple[int, ...] | list[int], dim: int) -> int:
    """nnU-Net's rule: one batch covers at most 5% of the dataset's voxels (avoids overfitting)."""
    return max(2, int(0.05 * dataset_voxels / float(np.prod(patch))))


def rough_training_peak_bytes(topology: NetworkTopology, batch_size: int, patch_size: tuple[int, ...],
                              precision: str = "fp32", checkpointing: bool = False) -> int:
    """A first-order estimate (used until the simulated memory model is given as ``peak_fn``):
    parameters x 4 (weights, gradients, momentum, transient) + ~6 stored tensors per convolution block
    at each resolution, encoder and decoder, in fp32."""
    voxels = float(np.prod(patch_size)) * batch_size
    params = 0.0
    act = 0.0
    prev = topology.in_channels
    for f, k, st in zip(topology.features_per_stage, topology.kernel_sizes, topology.strides):
        voxels /= float(np.prod(st))
        params += float(np.prod(k)) * (prev * f + (topology.conv_per_stage - 1) * f * f)
        act += 3 * topology.conv_per_stage * f * voxels * 2  # encoder + decoder
        prev = f
    bytes_per = 2 if precision in ("bf16", "fp16") else 4
    return int(16 * params + act * bytes_per * (0.6 if checkpointing else 1.0))


def plan(fp: Fingerprint, budget: Budget, peak_fn: PeakFn | None = None) -> Plans:
    """Plans for every configuration that suits the dataset (3d_fullres for 3D data, and 2d)."""
    peak_fn = peak_fn or rough_training_peak_bytes
    spacing = target_spacing(fp.spacings, fp.cropped_shapes)
    in_ch, num_classes = len(fp.channel_names), max(fp.labels.values()) + 1
    resampled = fp.cropped_shapes * fp.spacings / np.array(spacing)
    median_shape = tuple(int(round(v)) for v in np.median(resampled, axis=0))
    dataset_voxels = float(np.sum(np.prod(resampled, axis=1)))
    configs: dict[str, ConfigurationPlan] = {}
    if fp.image_dim == 3 and median_shape[0] > 1:
        configs["3d_fullres"] = _configuration("3d_fullres", spacing, median_shape, spacing, median_shape,
                                               in_ch, num_classes, budget, peak_fn, dataset_voxels)
    # 2d: in-plane spacing of 3d_fullres, slices kept as they are (z spacing is each case's own)
    spacing_2d = (float(np.median(fp.spacings[:, 0])), spacing[1], spacing[2])
    shape_2d = tuple(int(round(v)) for v in np.median(fp.cropped_shapes * fp.spacings / np.array(spacing_2d), axis=0))
    configs["2d"] = _configuration("2d", spacing_2d, shape_2d, spacing_2d[1:], shape_2d[1:], in_ch,
                                   num_classes, budget, peak_fn, dataset_voxels)
    normalization = tuple(scheme_for_channel(c) for c in fp.channel_names)
    use_mask = tuple(n == "zscore" and fp.median_relative_crop_volume < 0.75 for n in normalization)
    return Plans(
        dataset_name=fp.dataset_name, channel_names=fp.channel_names, labels=dict(fp.labels),
        file_ending=fp.file_ending, normalization=normalization, use_nonzero_mask=use_mask,
        intensity_properties=fp.foreground_intensity, configurations=configs,
        gpu_memory_bytes=int(budget.gpu_memory_bytes), host_ram_bytes=int(budget.host_ram_bytes),
    )


def _configuration(name: str, spacing_mm: tuple[float, float, float], median_shape_zyx: tuple[int, ...],
                   net_spacing: tuple[float, ...], net_shape: tuple[int, ...], in_ch: int, num_classes: int,
                   budget: Budget, peak_fn: PeakFn, dataset_voxels: float) -> ConfigurationPlan:
    dim = len(net_shape)
    initial = initial_patch(net_spacing, net_shape, 256.0**dim if dim == 3 else 2048.0**2)
    topo, patch, batch, peak = search_patch_and_batch(
        net_spacing, net_shape, in_ch, num_classes, budget, peak_fn, dim,
        max_batch=max_batch_for(dataset_voxels, initial, dim))
    accumulation = 2 if batch == 1 else 1  # keep an effective batch of at least 2
    seconds = conv_flops(topo, patch, batch) / budget.cpu_flops_per_second if budget.device == "cpu" else None
    notes: tuple[str, ...] = ()
    limit = budget.gpu_memory_bytes * (1 - budget.safety_margin)
    if peak > limit:
        notes = (f"even the smallest patch {patch} at batch 1 is predicted to need {peak / 2**20:.0f} MiB, more than "
                 f"the {limit / 2**20:.0f} MiB this budget allows; give more memory with --gpu-memory",)
    return ConfigurationPlan(
        name=name, spacing_mm=spacing_mm, median_shape_zyx=tuple(median_shape_zyx), patch_size=patch,
        batch_size=batch, accumulation_steps=accumulation, network=topo, device=budget.device,
        memory={"predicted_peak_bytes": float(peak)}, predicted_seconds_per_iteration=seconds, notes=notes,
    )
