"""Effective training throughput of a CUDA device, from its tabulated peak FLOP/s (for seconds per iteration).

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
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.artifacts import atomic_write_text
from autoseg.core.units import GiB

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
    ``autoseg.plan.compute.calibrate_cpu_throughput`` (a few seconds), then read from ``cache_dir`` for the same
    CPU model, CPU count, torch version and thread count."""
    import torch

    from autoseg.core.resources import cpu_count
    from autoseg.plan.compute import calibrate_cpu_throughput

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
    except OSError:
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
