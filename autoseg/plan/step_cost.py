"""The cost of one training step under one search setting (used by ``autoseg.plan.patch_search`` and
``autoseg.plan.configuration``).

``Setting`` is what stays fixed during one search (widths, precision, checkpointing, micro-batch regime);
``Limits`` what a step must fit (device bytes, seconds on CPU); ``StepCost`` predicts a step's device bytes
(through the memory model's ``PeakFn``, cached per volume), FLOPs (``step_flops``) and seconds, and says
whether it ``fits``; a ``Candidate`` is one topology, patch and batch with those figures.
``rough_training_peak_bytes`` is the search's cheap proxy for the bytes between simulations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autoseg.core.precision import element_bytes
from autoseg.model.flops import forward_conv_flops
from autoseg.model.topology import PLAIN_UNET, RESIDUAL_ENCODER_UNET, NetworkTopology
from autoseg.plan.throughput import StepRates, conv_flops, mapped_bytes, step_elements

CHECKPOINT_FLOPS = 4.0 / 3.0  # recomputing the forward in backward: (1 + 2 + 1) / (1 + 2)

# peak_fn(topology, batch, patch, precision, checkpointing, accumulation_steps) -> device bytes
PeakFn = Callable[[NetworkTopology, int, tuple[int, ...], str, bool, int], int]


@dataclass(frozen=True)
class Setting:
    """What stays fixed during one search."""

    base_features: int
    max_features: int
    precision: str  # "fp32" | "fp16" | "bf16"
    checkpointing: bool
    single: bool  # micro-batch 1 with 2 accumulation steps (else micro-batch >= 2, no accumulation)
    architecture: str = PLAIN_UNET  # NetworkTopology.architecture of every network searched

    @property
    def accumulation_steps(self) -> int:
        return 2 if self.single else 1


@dataclass(frozen=True)
class Limits:
    memory_bytes: float  # predicted device bytes allowed (budget minus the safety margin)
    seconds: float | None  # predicted seconds per iteration allowed (CPU), None: no time limit
    rates: StepRates  # the training device's: convolution FLOP/s (+ feature-map elements/s on CPU)
    fill_bytes: float = 0.0  # a patch chosen for its shape over a larger one must still reach this peak


@dataclass(frozen=True)
class Candidate:
    topology: NetworkTopology
    patch: tuple[int, ...]
    batch: int
    accumulation_steps: int
    peak_bytes: int
    flops: float  # per optimizer step (all micro-batches, recomputation included)
    seconds: float  # predicted, per optimizer step (``StepCost.seconds``)
    coverage: float
    max_batch: int


class StepCost:
    """Predicted bytes and seconds of a training step under one setting; ``fits`` checks both limits.
    ``use_memory=False`` checks only the time limit (CPU planning: the bytes are checked once at the end)."""

    def __init__(self, peak_fn: PeakFn, setting: Setting, limits: Limits, use_memory: bool = True) -> None:
        self.peak_fn, self.setting, self.limits, self.use_memory = peak_fn, setting, limits, use_memory
        self.factor = setting.accumulation_steps * (CHECKPOINT_FLOPS if setting.checkpointing else 1.0)
        self._peaks: dict[tuple[NetworkTopology, int, int], int] = {}

    def peak(self, topology: NetworkTopology, batch: int, patch: tuple[int, ...]) -> int:
        key = (topology, batch, math.prod(patch))  # the peak depends on the patch through its volume only
        if key not in self._peaks:
            s = self.setting
            self._peaks[key] = int(
                self.peak_fn(topology, batch, patch, s.precision, s.checkpointing, s.accumulation_steps)
            )
        return self._peaks[key]

    def flops(self, topology: NetworkTopology, batch: int, patch: tuple[int, ...]) -> float:
        return step_flops(topology, patch, batch) * self.factor

    def seconds(self, topology: NetworkTopology, batch: int, patch: tuple[int, ...]) -> float:
        """Predicted seconds of one optimizer step (``StepRates.seconds``; recomputation re-runs the forward's
        feature maps as it re-runs its FLOPs). Bytes mapped afresh are counted at fp32 (CPU steps run in fp32)."""
        return self.limits.rates.seconds(
            self.flops(topology, batch, patch),
            step_elements(topology, patch, batch) * self.factor,
            mapped_bytes(topology, patch, batch) * self.factor,
        )

    def candidate(
        self,
        topology: NetworkTopology,
        batch: int,
        patch: tuple[int, ...],
        coverage: float,
        max_batch: int,
        accumulation_steps: int | None = None,
    ) -> Candidate:
        """THE ``Candidate`` of this topology, batch and patch, its bytes (when memory is checked) and time."""
        peak = self.peak(topology, batch, patch) if self.use_memory else 0
        return Candidate(
            topology,
            patch,
            batch,
            accumulation_steps or self.setting.accumulation_steps,
            peak,
            self.flops(topology, batch, patch),
            self.seconds(topology, batch, patch),
            coverage,
            max_batch,
        )

    def fits(self, topology: NetworkTopology, batch: int, patch: tuple[int, ...]) -> bool:
        """Within the time and memory limits; a topology of one stage (a patch too small to pool) never
        fits: no U-Net can be built from it."""
        lim = self.limits
        if topology.num_stages < 2:
            return False
        if lim.seconds is not None and self.seconds(topology, batch, patch) > lim.seconds:
            return False
        return not self.use_memory or self.peak(topology, batch, patch) <= lim.memory_bytes


def step_flops(topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int) -> float:
    """``autoseg.plan.throughput.conv_flops`` (one training step, forward + backward ~ 3x the forward's convolutions)
    for the topology's architecture: the plain U-Net's formula there, a residual encoder's from its own module."""
    residual = topology.architecture == RESIDUAL_ENCODER_UNET
    return (
        3.0 * forward_conv_flops(topology, patch_size) * batch_size
        if residual
        else conv_flops(topology, patch_size, batch_size)
    )


def rough_training_peak_bytes(
    topology: NetworkTopology,
    batch_size: int,
    patch_size: tuple[int, ...],
    precision: str = "fp32",
    checkpointing: bool = False,
    accumulation_steps: int = 1,
) -> int:
    """A first-order estimate, the search's proxy between simulations: parameters x 16 bytes (weights,
    gradients, momentum, transient) + ~6 stored tensors per convolution block at each resolution,
    encoder and decoder (the encoder's convolutions as the architecture has them)."""
    voxels = float(math.prod(patch_size)) * batch_size
    params = 0.0
    act = 0.0
    prev = topology.in_channels
    for f, k, st, convs in zip(
        topology.features_per_stage, topology.kernel_sizes, topology.strides, topology.encoder_convs()
    ):
        voxels /= float(math.prod(st))
        params += float(math.prod(k)) * (prev * f + (convs - 1) * f * f)  # the encoder's
        act += 3 * (convs + topology.conv_per_stage) * f * voxels  # encoder + decoder
        prev = f
    bytes_per = element_bytes(precision)
    return int(16 * params + act * bytes_per * (0.6 if checkpointing else 1.0))
