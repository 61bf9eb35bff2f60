"""Compute beside memory: FLOPs of a training step, the effective throughput of a CUDA device from its tabulated
peak FLOP/s, and this machine's measured CPU throughput (for the planner's seconds per iteration).

CPU: a step's seconds are its convolutions' FLOPs (``conv_flops``) at one rate, its feature maps' elements
(``step_elements``: norms, activations, element-wise work) at another, and the bytes glibc maps afresh every step
(``mapped_bytes``) at a third (``StepRates``). ``calibrate_cpu_throughput`` times real training steps (THE step,
``autoseg.model.step``) of a small 3D and a small 2D U-Net on this machine and solves for the first two rates, and
times fresh pages (``mapping_rate``) for the third; ``cpu_throughput`` keeps them per machine
(``autoseg.core.machine.MachineCache``), so that later plans do not depend on the load while planning.
Convolution FLOPs alone at one rate fit 3D steps but not 2D ones (a 2D step does less arithmetic per element),
hence the element rate beside it; docs/benchmarks.md ("Seconds per training iteration") holds both against
measured steps.

CUDA:
Peaks are the vendors' datasheet figures for dense math: ``tensor_tflops`` fp16/bf16 on tensor cores with
fp32 accumulation (what autocast runs; GeForce cards run that at half their fp16-accumulate rate),
``fp32_tflops`` plain fp32. A U-Net training step reaches a fraction of that peak (instance norm,
activations and the loss are memory-bound): ``AMP_EFFICIENCY`` and ``FP32_EFFICIENCY`` are rough
assumptions (nnU-Net's default 3d_fullres, about 6-7 TFLOP per iteration by ``conv_flops``, runs at
roughly 0.15 s per iteration on an A100 with AMP: about 15% of its tensor peak). Expect +-2x; measure on
the real device where it matters.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoseg.core.machine import MachineCache, Measurement, machine_key
from autoseg.core.resources import cpu_count, cuda_available
from autoseg.core.units import GiB, MiB
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.glibc_heap import GLIBC_MMAP_THRESHOLD_MAX
from autoseg.model.flops import feature_map_elements, stage_elements
from autoseg.model.topology import NetworkTopology

AMP_EFFICIENCY = 0.15
FP32_EFFICIENCY = 0.5


@dataclass(frozen=True)
class GpuSpec:
    name: str  # as torch.cuda.get_device_name reports it, roughly
    pattern: str  # regular expression matched against the device name (case-insensitive)
    memory_gib: float
    tensor_tflops: float
    fp32_tflops: float


GPUS = (
    GpuSpec("NVIDIA GeForce RTX 3070", r"\b3070\b", 8, 40.6, 20.3),
    GpuSpec("NVIDIA GeForce RTX 2080 Ti", r"\b2080\b", 11, 53.8, 13.4),
    GpuSpec("Tesla T4", r"\bT4\b", 16, 65.0, 8.1),
    GpuSpec("Tesla V100", r"\bV100\b", 32, 125.0, 15.7),
    GpuSpec("NVIDIA GeForce RTX 3090", r"\b3090\b", 24, 71.0, 35.6),
    GpuSpec("NVIDIA GeForce RTX 4090", r"\b4090\b", 24, 165.2, 82.6),
    GpuSpec("NVIDIA A100 40GB", r"\bA100\b.*\b40\s*GB", 40, 312.0, 19.5),
    GpuSpec("NVIDIA RTX A6000", r"\bA6000\b", 48, 154.8, 38.7),
    GpuSpec("NVIDIA L40S", r"\bL40S\b", 48, 362.0, 91.6),
    GpuSpec("NVIDIA A100 80GB", r"\bA100\b", 80, 312.0, 19.5),
    GpuSpec("NVIDIA H100", r"\bH100\b", 80, 989.0, 67.0),
    GpuSpec("NVIDIA H200", r"\bH200\b", 141, 989.0, 67.0),
)


def gpu_spec(device_name: str | None, memory_bytes: int) -> tuple[GpuSpec, bool]:
    """The table's entry for ``device_name``; if the name is unknown (or None: planning for a budget, not a
    device), the smallest listed device with at least ``memory_bytes``. Returns (spec, matched by name)."""
    if device_name:
        for spec in GPUS:
            if re.search(spec.pattern, device_name, flags=re.IGNORECASE):
                return spec, True
    fitting = [s for s in GPUS if s.memory_gib * GiB >= memory_bytes * 0.95]  # "8 GB" cards hold < 8 GiB
    return (min(fitting, key=lambda s: s.memory_gib) if fitting else GPUS[-1]), False


def cuda_flops_per_second(spec: GpuSpec, precision: str) -> float:
    """Effective FLOP/s of training steps on ``spec`` at ``precision`` ("fp16"/"bf16": autocast)."""
    if precision in ("fp16", "bf16"):
        return spec.tensor_tflops * 1e12 * AMP_EFFICIENCY
    return spec.fp32_tflops * 1e12 * FP32_EFFICIENCY


def cuda_device_name() -> str | None:
    """torch's name of CUDA device 0, or None without one."""
    if not cuda_available():
        return None
    import torch

    return torch.cuda.get_device_name(0)


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


def step_elements(topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int) -> float:
    """Feature-map elements of one training step's forward pass (``feature_map_elements`` x batch): the second
    term of ``StepRates.seconds`` (the backward's share is in the measured rate, as for ``conv_flops``)."""
    return feature_map_elements(topology, patch_size) * batch_size


# bytes a training step allocates in tensors the size of a stage's feature map, per element of the outputs of the
# stage's convolutions (``stage_elements``) and byte of element (conv, norm and activation outputs and their
# gradients), as StorageTracker counts them on 3D and 2D steps (see ``mapped_bytes``; docs/benchmarks.md)
STAGE_TENSORS_PER_ELEMENT = 7.7


def mapped_bytes(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    batch_size: int,
    itemsize: int = 4,
    threshold: int = GLIBC_MMAP_THRESHOLD_MAX,
) -> float:
    """Bytes a CPU training step allocates in blocks that glibc maps afresh every step: a block of at least
    ``threshold`` (``GLIBC_MMAP_THRESHOLD_MAX``) is mapped when allocated and unmapped when freed, so its pages are
    faulted in and zeroed again on every step (the third term of ``StepRates.seconds``; smaller blocks are reused
    from the heap).
    A stage whose feature map reaches the threshold maps ``STAGE_TENSORS_PER_ELEMENT`` bytes per element of its
    convolutions' outputs and byte of element; one whose feature map is under it but whose concatenation with the
    skip (twice its size) reaches it maps that concatenation and its gradient."""
    total = 0.0
    for s, (one, outputs) in enumerate(stage_elements(topology, patch_size)):
        feature_map = one * batch_size * itemsize
        if feature_map >= threshold:
            total += STAGE_TENSORS_PER_ELEMENT * outputs * batch_size * itemsize
        elif 2 * feature_map >= threshold and s < topology.num_stages - 1:
            total += 2 * 2 * feature_map
    return total


def mapping_rate(repeats: int = 5, nbytes: int = 64 * MiB) -> tuple[float, bool]:
    """Bytes per second at which this machine maps fresh pages for a tensor: the CPU seconds of allocating and
    filling a fresh ``nbytes`` block minus those of filling a kept one (best of ``repeats``; CPU seconds, so another
    process on the cores does not lengthen them), and whether they were steady (the fresh fill took at least the
    kept one's time, else the figure is noise)."""
    import torch

    kept = torch.empty(nbytes // 4)
    kept.fill_(1.0)

    def cpu_seconds(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            c0 = time.process_time()
            run()
            times.append(time.process_time() - c0)
        return min(times)

    fresh, reused = cpu_seconds(lambda: torch.empty(nbytes // 4).fill_(1.0)), cpu_seconds(lambda: kept.fill_(1.0))
    return nbytes / max(fresh - reused, 1e-6), fresh > reused


CALIBRATION_TOPOLOGY = NetworkTopology(
    dim=3,
    in_channels=1,
    num_outputs=3,
    features_per_stage=(16, 32, 64, 128),
    kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3)),
    strides=((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)),
)
CALIBRATION_TOPOLOGY_2D = NetworkTopology(
    dim=2,
    in_channels=1,
    num_outputs=3,
    features_per_stage=(16, 32, 64, 128),
    kernel_sizes=((3, 3),) * 4,
    strides=((1, 1), (2, 2), (2, 2), (2, 2)),
)
# (network, patch, batch) of the calibration steps: the 3D step runs ~2750 FLOPs per feature-map element, the 2D
# one ~1470 (a 3x3 kernel), so their seconds separate the two rates of ``StepRates``
CALIBRATION_STEPS = ((CALIBRATION_TOPOLOGY, (16, 48, 48), 2), (CALIBRATION_TOPOLOGY_2D, (96, 96), 8))
CALIBRATION_VERSION = 4  # part of the cache key: a change to the calibration steps or rule measures again


def training_step_closure(
    topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int, seed: int = 0
) -> Callable[[], object]:
    """THE training step (``autoseg.model.step``) on a fresh network and synthetic batches, as a callable to time."""
    import torch

    from autoseg.model.step import build_step, synthetic_batches  # torch: only when a step is timed

    scheme = LabelScheme.for_outputs(topology.num_outputs)
    step = build_step(topology, scheme)
    batches = synthetic_batches(topology, scheme, batch_size, tuple(patch_size), torch.Generator().manual_seed(seed))
    return lambda: step(batches)


@dataclass(frozen=True)
class StepTimes:
    """The best (shortest) of several timed runs of a step: wall seconds and the process's CPU seconds."""

    threads: int
    wall_seconds: float
    cpu_seconds: float


def time_step(run_once: Callable[[], object], threads: int, repeats: int) -> StepTimes:
    """``run_once`` with ``threads`` torch threads: one warm-up, then the best of ``repeats`` runs. The caller's
    thread count is restored."""
    import torch

    previous = torch.get_num_threads()
    walls, cpus = [], []
    try:
        torch.set_num_threads(threads)
        run_once()  # warm-up: allocations, oneDNN kernel choice
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            run_once()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(previous)
    return StepTimes(threads, min(walls), min(cpus))


@dataclass(frozen=True)
class StepRates:
    """How fast the training device runs training steps: on CPU a step of ``flops`` convolution FLOPs
    (``conv_flops``) over feature maps of ``elements`` elements (``step_elements``), which maps ``mapped`` bytes
    afresh (``mapped_bytes``), takes ``flops / flops_per_second + elements / elements_per_second + mapped /
    mapped_bytes_per_second`` seconds; a rate of None drops its term (``--cpu-flops``: the convolutions alone, as
    CUDA's tabulated FLOP/s)."""

    flops_per_second: float
    elements_per_second: float | None = None
    mapped_bytes_per_second: float | None = None

    def seconds(self, flops: float, elements: float = 0.0, mapped: float = 0.0) -> float:
        element_seconds = elements / self.elements_per_second if self.elements_per_second else 0.0
        mapping_seconds = mapped / self.mapped_bytes_per_second if self.mapped_bytes_per_second else 0.0
        return flops / self.flops_per_second + element_seconds + mapping_seconds

    def describe(self) -> str:
        """E.g. "320.0 GFLOP/s, 220 M feature-map elements/s, 2.8 GiB/s of fresh pages", or "40.0 GFLOP/s" for the
        convolutions alone."""
        elements = (
            ""
            if self.elements_per_second is None
            else f", {self.elements_per_second / 1e6:.0f} M feature-map elements/s"
        )
        mapped = (
            ""
            if self.mapped_bytes_per_second is None
            else f", {self.mapped_bytes_per_second / GiB:.1f} GiB/s of fresh pages"
        )
        return f"{self.flops_per_second / 1e9:.1f} GFLOP/s{elements}{mapped}"

    def as_dict(self) -> dict[str, float | None]:
        return {
            "flops_per_second": self.flops_per_second,
            "elements_per_second": self.elements_per_second,
            "mapped_bytes_per_second": self.mapped_bytes_per_second,
        }


@dataclass(frozen=True)
class TimedStep:
    """One calibration step: its convolution FLOPs, feature-map elements, and its timings with 1 thread (``one``)
    and with every CPU (``every``; None on a 1-CPU machine)."""

    flops: float
    elements: float
    one: StepTimes
    every: StepTimes | None

    def seconds(self) -> float:
        """The step's seconds as robust to other processes as timing allows: one thread's CPU seconds do not grow
        when another process takes turns on its core while its wall seconds do (docs/benchmarks.md, "Training step
        speed on CPU"), so they bound it; every CPU's best wall seconds are what an idle machine reaches (training
        uses every CPU). The shorter counts."""
        return min(self.one.cpu_seconds, self.every.wall_seconds) if self.every is not None else self.one.cpu_seconds

    def busy(self) -> str:
        """Why the cores looked busy while it ran ("" when they did not): one thread got under 90% of a CPU, or
        every CPU ran no faster than one. Then its seconds are one thread's, too long by the parallel speed-up."""
        share = self.one.cpu_seconds / self.one.wall_seconds
        if share < 0.9:
            return f"one thread got {share:.0%} of a CPU"
        if self.every is not None and self.every.wall_seconds > 0.9 * self.one.wall_seconds:
            return (
                f"{self.every.threads} threads ran no faster than one ({self.every.wall_seconds:.3f} vs "
                f"{self.one.wall_seconds:.3f} s)"
            )
        return ""


def cpu_rates_from_times(steps: Sequence[TimedStep], mapping: tuple[float, bool] | None = None) -> Measurement:
    """``StepRates`` (as a dict) from timed calibration steps of different FLOPs per element (``CALIBRATION_STEPS``,
    which map no fresh pages) and the ``mapping_rate``: the two rates that give the first two steps'
    ``TimedStep.seconds`` exactly, each rounded to 2 significant digits (+-5% noise rarely changes the plan).
    Where the timings leave no positive element rate (noise, or a machine whose element work is free), the
    convolutions alone at the first step's rate; an unsteady mapping rate (or none) drops that term. When the
    cores were visibly busy (``TimedStep.busy``) the figures are too low and are not to be cached."""
    first, second = steps[0], steps[1]
    per_flop, per_element = np.linalg.solve(
        [[first.flops, first.elements], [second.flops, second.elements]], [first.seconds(), second.seconds()]
    )
    mapped = float(f"{mapping[0]:.2g}") if mapping is not None and mapping[1] else None
    if per_flop > 0 and per_element > 0:
        rates = StepRates(float(f"{1 / per_flop:.2g}"), float(f"{1 / per_element:.2g}"), mapped)
    else:
        rates = StepRates(float(f"{first.flops / first.seconds():.2g}"), None, mapped)
    details = {}
    for name, step in zip(("3d", "2d"), steps):
        details.update(
            {
                f"{name}_step_flops": step.flops,
                f"{name}_step_elements": step.elements,
                f"{name}_one_thread_wall_seconds": step.one.wall_seconds,
                f"{name}_one_thread_cpu_seconds": step.one.cpu_seconds,
            }
        )
        if step.every is not None:
            details.update({"threads": step.every.threads, f"{name}_all_threads_wall_seconds": step.every.wall_seconds})
    if mapping is not None:
        details["mapping_bytes_per_cpu_second"] = mapping[0]
    busy = next((why for why in (step.busy() for step in steps) if why), "")
    return Measurement(
        rates.as_dict(),
        keep=not busy,
        details=details,
        why_not_kept=f"the cores were busy ({busy}); measured again next time, --cpu-flops overrides",
    )


def calibrate_cpu_throughput(repeats: int = 5, max_threads: int | None = None) -> Measurement:
    """This machine's ``StepRates`` (``cpu_rates_from_times``) from the best of ``repeats`` runs of each calibration
    step (``CALIBRATION_STEPS``) with 1 thread and with every CPU (``max_threads``; default all), and the
    ``mapping_rate``; a few seconds."""
    threads = max_threads or cpu_count()
    timed = []
    for topology, patch, batch in CALIBRATION_STEPS:
        step = training_step_closure(topology, patch, batch)
        one = time_step(step, 1, repeats)
        every = time_step(step, threads, repeats) if threads > 1 else None
        timed.append(TimedStep(conv_flops(topology, patch, batch), step_elements(topology, patch, batch), one, every))
    return cpu_rates_from_times(timed, mapping_rate())


def cpu_throughput(cache: MachineCache) -> tuple[StepRates, str]:
    """This machine's ``StepRates`` and where they came from: read from ``cache`` for this machine
    (``autoseg.core.machine.machine_key``), else measured now with ``calibrate_cpu_throughput`` (a few seconds) and
    cached unless the cores were busy."""
    key = {**machine_key(), "calibration": CALIBRATION_VERSION}
    value, source = cache.measured("cpu_throughput", key, calibrate_cpu_throughput)
    return StepRates(**value), source
