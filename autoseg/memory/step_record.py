"""What one training step's memory is made of, as data: its configuration (``StepConfig``), its record (``StepRecord``:
the timeline of live bytes by category, the phases, the stages' saved bytes) and the result (``TrainingMemory``).

Shared by ``autoseg.memory.training`` (which keeps the simulations), ``autoseg.memory.training_simulation`` (which
runs the step and records it) and ``autoseg.memory.fit`` (which fits records); no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.precision import check_precision
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.glibc_heap import HeapFootprint
from autoseg.model.optimizer import OPTIMIZERS
from autoseg.model.topology import NetworkTopology

CATEGORIES = ("parameters", "gradients", "optimizer_state", "batch", "activations")


@dataclass(frozen=True)
class TrainingMemory:
    """Live tensor bytes of one training step at its peak, and where they go.

    ``peak_bytes = parameter_bytes + gradient_bytes + optimizer_state_bytes + batch_bytes +
    activation_bytes``, each term counted at the moment of the peak: ``gradient_bytes`` holds only the
    gradients already computed then (the peak usually falls early in backward), ``activation_bytes``
    everything else (saved activations, autocast weight copies, loss temporaries, gradients of
    activations). ``stage_activation_bytes``: per top-level module (``encoder.s``, ``decoder.s``,
    ``seg_heads.s``), the bytes of tensors created during its forward that are still alive when the
    forward returns (what backward will need; ``network`` = created outside those modules).
    ``largest_conv_output_bytes``: the largest convolution output of the forward, in the compute dtype.
    ``peak_phase``: "forward", "loss", "backward" or "optimizer".
    A CPU step's allocator (``autoseg.memory.glibc_heap``; 0 where not modelled, on CUDA):
    ``heap_retained_bytes``, what glibc's heap and mapped blocks hold beyond the live tensors at the peak (freed
    blocks it keeps), and ``mapped_bytes_per_step``, the bytes the step allocates in blocks glibc maps afresh (each
    page faulted in again every step).
    """

    peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    batch_bytes: int
    activation_bytes: int
    stage_activation_bytes: dict[str, int] = field(default_factory=dict)
    largest_conv_output_bytes: int = 0
    live_allocations_at_peak: int = 0
    peak_phase: str = ""
    heap_retained_bytes: int = 0
    mapped_bytes_per_step: int = 0

    def breakdown(self) -> dict[str, int]:
        """The terms of the peak and their ``total``."""
        return {
            "parameters": self.parameter_bytes,
            "gradients": self.gradient_bytes,
            "optimizer_state": self.optimizer_state_bytes,
            "batch": self.batch_bytes,
            "activations": self.activation_bytes,
            "total": self.peak_bytes,
        }


@dataclass(frozen=True)
class StepConfig:
    """Everything that decides the memory of one training step."""

    topology: NetworkTopology
    batch_size: int
    patch_size: tuple[int, ...]
    precision: str = "fp32"
    checkpointing: bool = False
    optimizer: str = "sgd"
    accumulation_steps: int = 1
    labels: LabelScheme | None = None  # the plan's labels; None: LabelScheme.for_outputs(num_outputs)
    device: str = "cpu"  # "cpu": each convolution's hidden buffers count (``cpu_conv_scratch_bytes``); "cuda": not

    def __post_init__(self) -> None:
        check_step_arguments(
            self.topology, self.batch_size, self.patch_size, self.precision, self.optimizer, self.accumulation_steps
        )
        if self.labels is not None and self.labels.num_outputs != self.topology.num_outputs:
            raise InputError(
                f"the labels have {self.labels.num_outputs} network outputs but the topology has "
                f"num_outputs {self.topology.num_outputs}; plan with the same dataset.json labels"
            )

    @property
    def scheme(self) -> LabelScheme:
        return self.labels if self.labels is not None else LabelScheme.for_outputs(self.topology.num_outputs)


def check_step_arguments(
    topology: NetworkTopology,
    batch_size: int,
    patch_size: tuple[int, ...],
    precision: str,
    optimizer: str,
    accumulation_steps: int = 1,
) -> None:
    """Raise ``ValueError`` naming the argument to change."""
    check_precision(precision)  # an unknown name says what to use
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer {optimizer!r} is not known; use one of {list(OPTIMIZERS)}")
    if batch_size < 1 or accumulation_steps < 1:
        raise InputError(f"batch_size ({batch_size}) and accumulation_steps ({accumulation_steps}) must be >= 1")
    divisor = topology.patch_divisor()
    if len(patch_size) != topology.dim or any(p < 1 or p % d for p, d in zip(patch_size, divisor)):
        raise InputError(
            f"patch_size {tuple(patch_size)} does not fit the {topology.dim}D network: expected "
            f"{topology.dim} sizes, each a multiple of {divisor} (the product of the strides)"
        )
    if math.prod(p // d for p, d in zip(patch_size, divisor)) < 2:
        raise InputError(
            f"patch_size {tuple(patch_size)} leaves one voxel at the lowest resolution, where "
            f"instance norm cannot train; make at least one axis a larger multiple of {divisor}"
        )


@dataclass(frozen=True)
class StepRecord:
    """The timeline of one recorded step (rows: the step's start, then after each of its events); ``heap``: glibc's
    footprint over the step's events replayed (``heap_footprint``; recorded for CPU steps, else None)."""

    timeline: np.ndarray  # (T + 1, len(CATEGORIES)) int64 live bytes per category
    live_count: np.ndarray  # (T + 1,) int64 live storages
    phases: tuple[tuple[str, int], ...]  # (phase name, first row of the phase)
    signature: np.ndarray  # (T, 2) int64 (storage number relative to the step's first, kind) per event
    stage_bytes: dict[str, int]
    largest_conv_output_bytes: int
    heap: HeapFootprint | None = None

    def phase_at(self, row: int) -> str:
        """Phase of the event that led to ``row`` (row 0: the step's start)."""
        name = self.phases[0][0]
        for phase, first in self.phases:
            if first < max(row, 1):
                name = phase
        return name

    def memory_at(self, row: int) -> TrainingMemory:
        terms = dict(zip(CATEGORIES, (int(v) for v in self.timeline[row])))
        return TrainingMemory(
            peak_bytes=sum(terms.values()),
            parameter_bytes=terms["parameters"],
            gradient_bytes=terms["gradients"],
            optimizer_state_bytes=terms["optimizer_state"],
            batch_bytes=terms["batch"],
            activation_bytes=terms["activations"],
            stage_activation_bytes=dict(self.stage_bytes),
            largest_conv_output_bytes=self.largest_conv_output_bytes,
            live_allocations_at_peak=int(self.live_count[row]),
            peak_phase=self.phase_at(row),
        )

    def peak(self) -> TrainingMemory:
        """The memory at the tensor peak, with what glibc's heap holds beyond the tensors there (a ``heap``)."""
        total = self.timeline.sum(axis=1)
        row = int(np.argmax(total))
        memory = self.memory_at(row)
        if self.heap is None:
            return memory
        return replace(
            memory,
            heap_retained_bytes=self.heap.retained_bytes(int(total[row] - total[0])),
            mapped_bytes_per_step=self.heap.mapped_bytes_per_step,
        )

    def to_json(self) -> dict:
        return {
            "timeline": self.timeline.tolist(),
            "live_count": self.live_count.tolist(),
            "phases": [list(p) for p in self.phases],
            "signature": self.signature.tolist(),
            "stage_bytes": self.stage_bytes,
            "largest_conv_output_bytes": self.largest_conv_output_bytes,
            "heap": None if self.heap is None else self.heap.to_json(),
        }

    @classmethod
    def from_json(cls, value: dict) -> StepRecord:
        return cls(
            timeline=np.asarray(value["timeline"], dtype=np.int64).reshape(-1, len(CATEGORIES)),
            live_count=np.asarray(value["live_count"], dtype=np.int64),
            phases=tuple((str(n), int(i)) for n, i in value["phases"]),
            signature=np.asarray(value["signature"], dtype=np.int64).reshape(-1, 2),
            stage_bytes={str(k): int(v) for k, v in value["stage_bytes"].items()},
            largest_conv_output_bytes=int(value["largest_conv_output_bytes"]),
            heap=None if value["heap"] is None else HeapFootprint.from_json(value["heap"]),
        )
