"""Compute beside memory: FLOPs of a training step, the effective throughput of a CUDA device from its tabulated
peak FLOP/s, and the rates a CPU runs steps at (for the planner's seconds per iteration).

CPU: a step's seconds are its convolutions' FLOPs (``conv_flops``) at one rate, its feature maps' elements
(``step_elements``: norms, activations, element-wise work) at another, and the bytes glibc maps afresh every step
(``mapped_bytes``) at a third (``StepRates``); ``autoseg.plan.calibration`` measures the three on this machine.
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
from dataclasses import dataclass

import numpy as np

from autoseg.core.resources import cuda_available
from autoseg.core.units import GiB
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
