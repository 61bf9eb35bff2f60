"""Compute beside memory: FLOPs of a training step, the effective throughput of a CUDA device from its tabulated
peak FLOP/s, and this machine's measured CPU throughput (for the planner's seconds per iteration).

CPU: ``calibrate_cpu_throughput`` times a few real training steps (THE step, ``autoseg.model.step``) of a small
U-Net on this machine and returns the effective FLOP/s of such steps (norms, activations and the optimizer
included), so that ``conv_flops / throughput`` predicts the seconds of a planned step; ``cached_cpu_throughput``
keeps it per machine.

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

import json
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import WriteError, atomic_write_text
from autoseg.core.resources import cpu_count, fastest_thread_count
from autoseg.core.units import GiB
from autoseg.dataset.labels import LabelScheme
from autoseg.model.step import build_step, synthetic_batches
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
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def cached_cpu_throughput(cache_dir: Path) -> tuple[float, str]:
    """This machine's CPU training throughput (FLOP/s) and where it came from: measured once with
    ``calibrate_cpu_throughput`` (a few seconds), then read from ``cache_dir`` for the same
    CPU model, CPU count, torch version and thread count."""
    import torch

    key = f"{platform.machine()}|{platform.processor()}|{_cpu_model()}|{cpu_count()}|{torch.__version__}|" \
          f"{torch.get_num_threads()}"
    path = cache_dir / "cpu_throughput.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return float(cached["flops_per_second"]), f"cached in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    load_before = os.getloadavg()[0]
    flops = calibrate_cpu_throughput(repeats=1)
    if load_before > 0.5 * cpu_count():  # other processes were running: the figure is too low to keep
        return flops, f"measured now under load {load_before:.1f}, not cached; --cpu-flops overrides"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "flops_per_second": flops}) + "\n")
    except (OSError, WriteError):
        return flops, "measured now (could not cache it)"
    return flops, "measured now"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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

    scheme = LabelScheme.for_outputs(topology.num_outputs)
    step = build_step(topology, scheme)
    batches = synthetic_batches(topology, scheme, batch_size, tuple(patch_size), torch.Generator().manual_seed(seed))
    return lambda: step(batches)


def calibrate_cpu_throughput(repeats: int = 3, max_threads: int | None = None) -> float:
    """Effective FLOP/s of U-Net training steps on this machine's CPU (a few seconds to measure), with the
    faster of all threads and one (as the trainer chooses): with all threads against another busy process
    the step measured up to 20x slower (3.2 instead of 65 GFLOP/s on 2 cores), which would shrink the plan."""
    step = training_step_closure(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2)
    _, timings = fastest_thread_count(step, max_threads or cpu_count(), repeats)
    return conv_flops(CALIBRATION_TOPOLOGY, CALIBRATION_PATCH, 2) / min(timings.values())
