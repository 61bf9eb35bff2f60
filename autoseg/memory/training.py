"""The training step as live tensor bytes: simulated under ``FakeTensorMode`` or measured on real CPU tensors.

The step is THE training step, ``autoseg.model.step.TrainStep``, built by ``build_step`` as ``autoseg train``
builds it (network, Dice + CE or Dice + BCE with deep supervision and the ignore label, autocast of the
precision, SGD or AdamW with ``foreach`` as on CUDA, gradient clipping, accumulation) and fed synthetic
batches (``synthetic_batches``: float32 data, the loader's int8 target). ``StorageTracker`` records every
storage it allocates and frees; the step's ``trace`` marks its phases and tags the forward pass per stage.
The optimizer's state (SGD momentum, Adam moments) is allocated beforehand by one update on zero
gradients, as it is in every step after the first. With ``accumulation_steps > 1`` two micro-batches are
run: the second one carries the first one's gradients, and every later one looks like it.

Simulation and measurement run the same code (``autoseg.memory.training_simulation``); only the tensors differ
(fake ones hold no memory). The difference between them is what the dispatcher cannot see (a CPU kernel's
private scratch). This module describes the step and keeps its simulations; it imports torch (through the
simulation) only when a step must run.

Known differences from a CUDA run, all small or modelled elsewhere: the step runs on a CPU device, so CPU
autocast's op policy is used (convolutions in the low-precision dtype, the loss in fp32 as the loss casts
explicitly); fp16 runs without the GradScaler (it scales only on CUDA; its state is a few scalars); the
caching allocator's rounding, fragmentation and convolution workspaces are in ``autoseg.memory.device``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.machine import kept_simulations, simulation_key
from autoseg.core.precision import check_precision
from autoseg.dataset.labels import LabelScheme
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

    def breakdown(self) -> dict[str, int]:
        """The terms of the peak and their ``total``."""
        return {"parameters": self.parameter_bytes, "gradients": self.gradient_bytes,
                "optimizer_state": self.optimizer_state_bytes, "batch": self.batch_bytes,
                "activations": self.activation_bytes, "total": self.peak_bytes}


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
        check_step_arguments(self.topology, self.batch_size, self.patch_size, self.precision, self.optimizer,
                             self.accumulation_steps)
        if self.labels is not None and self.labels.num_outputs != self.topology.num_outputs:
            raise InputError(f"the labels have {self.labels.num_outputs} network outputs but the topology has "
                             f"num_outputs {self.topology.num_outputs}; plan with the same dataset.json labels")

    @property
    def scheme(self) -> LabelScheme:
        return self.labels if self.labels is not None else LabelScheme.for_outputs(self.topology.num_outputs)


def check_step_arguments(topology: NetworkTopology, batch_size: int, patch_size: tuple[int, ...],
                         precision: str, optimizer: str, accumulation_steps: int = 1) -> None:
    """Raise ``ValueError`` naming the argument to change."""
    check_precision(precision)  # an unknown name says what to use
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer {optimizer!r} is not known; use one of {list(OPTIMIZERS)}")
    if batch_size < 1 or accumulation_steps < 1:
        raise InputError(f"batch_size ({batch_size}) and accumulation_steps ({accumulation_steps}) "
                         "must be >= 1")
    divisor = topology.patch_divisor()
    if len(patch_size) != topology.dim or any(p < 1 or p % d for p, d in zip(patch_size, divisor)):
        raise InputError(f"patch_size {tuple(patch_size)} does not fit the {topology.dim}D network: expected "
                         f"{topology.dim} sizes, each a multiple of {divisor} (the product of the strides)")
    if math.prod(p // d for p, d in zip(patch_size, divisor)) < 2:
        raise InputError(f"patch_size {tuple(patch_size)} leaves one voxel at the lowest resolution, where "
                         f"instance norm cannot train; make at least one axis a larger multiple of {divisor}")


@dataclass(frozen=True)
class StepRecord:
    """The timeline of one recorded step (rows: the step's start, then after each of its events)."""

    timeline: np.ndarray  # (T + 1, len(CATEGORIES)) int64 live bytes per category
    live_count: np.ndarray  # (T + 1,) int64 live storages
    phases: tuple[tuple[str, int], ...]  # (phase name, first row of the phase)
    signature: np.ndarray  # (T, 2) int64 (storage number relative to the step's first, kind) per event
    stage_bytes: dict[str, int]
    largest_conv_output_bytes: int

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
            peak_bytes=sum(terms.values()), parameter_bytes=terms["parameters"],
            gradient_bytes=terms["gradients"],
            optimizer_state_bytes=terms["optimizer_state"], batch_bytes=terms["batch"],
            activation_bytes=terms["activations"], stage_activation_bytes=dict(self.stage_bytes),
            largest_conv_output_bytes=self.largest_conv_output_bytes,
            live_allocations_at_peak=int(self.live_count[row]), peak_phase=self.phase_at(row))

    def peak(self) -> TrainingMemory:
        return self.memory_at(int(np.argmax(self.timeline.sum(axis=1))))

    def to_json(self) -> dict:
        return {"timeline": self.timeline.tolist(), "live_count": self.live_count.tolist(),
                "phases": [list(p) for p in self.phases], "signature": self.signature.tolist(),
                "stage_bytes": self.stage_bytes, "largest_conv_output_bytes": self.largest_conv_output_bytes}

    @classmethod
    def from_json(cls, value: dict) -> StepRecord:
        return cls(timeline=np.asarray(value["timeline"], dtype=np.int64).reshape(-1, len(CATEGORIES)),
                   live_count=np.asarray(value["live_count"], dtype=np.int64),
                   phases=tuple((str(n), int(i)) for n, i in value["phases"]),
                   signature=np.asarray(value["signature"], dtype=np.int64).reshape(-1, 2),
                   stage_bytes={str(k): int(v) for k, v in value["stage_bytes"].items()},
                   largest_conv_output_bytes=int(value["largest_conv_output_bytes"]))


# the code a simulated step runs: a change to any of these files simulates again
SIMULATED_MODULES = tuple(f"autoseg.model.{m}" for m in ("blocks", "loss", "network", "optimizer", "residual",
                                                         "step", "topology")) + (
    "autoseg.memory.tracker", "autoseg.memory.training_simulation", "autoseg.dataset.labels",
    "autoseg.core.precision", __name__)


def record_training_step(cfg: StepConfig, fake: bool = True) -> StepRecord:
    """Run the step under ``FakeTensorMode`` (``fake``) or for real on CPU, and return its timeline. A simulated
    step is kept between runs while ``keep_simulations_in`` has set a cache (the CLI does), one file a step in its
    ``training_steps/``, keyed by the step and the code that simulates it (``SIMULATED_MODULES``, torch's
    version): a re-plan then reads its simulations instead of running them (each 0.3-1.5 s, and the first one
    imports torch and its fake-tensor machinery, ~2-4 s; a re-plan that finds every step kept imports neither)."""
    kept = kept_simulations("training_steps")
    if not fake or kept is None:
        return _record_training_step(cfg, fake)
    key = {**simulation_key(SIMULATED_MODULES), "step": repr(cfg)}
    name = "step-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    value, _ = kept.kept(name, key, lambda: _record_training_step(cfg, fake).to_json(), max_entries=1)
    return StepRecord.from_json(value)


def _record_training_step(cfg: StepConfig, fake: bool) -> StepRecord:
    from autoseg.memory.training_simulation import record_step  # torch: imported once a step must run

    return record_step(cfg, fake)


def simulate_training_step(topology: NetworkTopology, batch_size: int, patch_size: tuple[int, ...], *,
                           precision: str = "fp32", checkpointing: bool = False, optimizer: str = "sgd",
                           accumulation_steps: int = 1, labels: LabelScheme | None = None,
                           device: str = "cpu") -> TrainingMemory:
    """Peak live tensor bytes of one training step, predicted without allocating (FakeTensorMode).

    ``patch_size``: ``(z, y, x)`` or ``(y, x)``, multiples of ``topology.patch_divisor()``. ``labels``: the
    plan's ``LabelScheme`` (regions and the ignore label change the loss); None: plain classes (one region
    for a single-output network). ``device`` "cpu": each convolution's hidden oneDNN buffers count as alive
    while it runs (``StepConfig.device``). About 0.1-1 s, independent of the patch size.
    """
    cfg = StepConfig(topology, batch_size, tuple(patch_size), precision, checkpointing, optimizer,
                     accumulation_steps, labels, device)
    return record_training_step(cfg, fake=True).peak()


def measure_training_step(topology: NetworkTopology, batch_size: int, patch_size: tuple[int, ...],
                          precision: str = "fp32", checkpointing: bool = False, optimizer: str = "sgd",
                          accumulation_steps: int = 1, labels: LabelScheme | None = None,
                          device: str = "cpu") -> int:
    """The same step run for real on CPU tensors, tracked the same way (``device`` as modelled: "cpu" counts the
    convolutions' hidden buffers): peak live tensor bytes.

    Allocates and computes for real: keep the sizes small. The caller's RNG state is left untouched.
    """
    cfg = StepConfig(topology, batch_size, tuple(patch_size), precision, checkpointing, optimizer,
                     accumulation_steps, labels, device)
    return int(record_training_step(cfg, fake=False).timeline.sum(axis=1).max())


