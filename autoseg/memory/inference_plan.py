"""The inference plan: how ``autoseg.model.sliding_window.sliding_window_predict`` runs on one image, chosen before
it starts from the memory model (``autoseg.memory.inference.inference_memory``): the largest tile batch within a
memory budget, and where the accumulator lives (the device, or the host when it does not fit beside a tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoseg.core.units import MiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.inference import InferenceMemory, InferenceSetting, inference_memory
from autoseg.model.tile_buffers import finish_chunk_slices
from autoseg.model.tile_runner import WorkingBytesSource
from autoseg.model.tiles import tile_layout
from autoseg.model.tta import mirror_variants

# CPU: with every convolution in oneDNN (autoseg.model.cpu_conv) a tile costs about the same alone or batched; only
# small tiles gain from a batch, their per-forward overhead shared (16x40x48: 27 ms a tile alone, 23 in fours; 16x64x64
# 25 vs 23; 32x112x112 387 alone, 468 in fours; docs/prediction.md "oneDNN at a tile batch of 1")
CPU_MAX_TILE_BATCH = 4
# CPU: a batch gains nothing beyond about this many voxels (4 tiles of 16x40x40); a larger tile is batched less (a
# 16x64x64 or larger tile: 1), so its activations are not held several times for no speed
CPU_BATCH_VOXELS = CPU_MAX_TILE_BATCH * 16 * 40 * 40


def cpu_tile_batch_cap(tile_size: Sequence[int]) -> int:
    """The most (tile, variant) pairs one forward pass takes on CPU: ``CPU_MAX_TILE_BATCH`` tiles at most,
    ``CPU_BATCH_VOXELS`` voxels at most, at least 1."""
    return max(1, min(CPU_MAX_TILE_BATCH, CPU_BATCH_VOXELS // math.prod(int(t) for t in tile_size)))


CUDA_TILES_PER_BATCH = 2  # CUDA: up to every mirror variant of this many tiles in one forward pass


@dataclass(frozen=True)
class InferencePlan:
    """How ``sliding_window_predict`` runs on one image, chosen before it starts (``plan_inference``).

    ``choices``: every (tile batch, accumulator device, predicted peak bytes) considered, the chosen first.
    ``peak_bytes``: the compute device's predicted peak (``predict_device_peak`` total: on CPU the tensors, what
    glibc's heap holds beyond them, ``heap_retained_bytes``, and the runtime), of which ``parameter_bytes`` are
    the networks' parameters. ``fits``: False when even one tile with the accumulator on the host exceeds the
    budget.
    """

    tile_batch_size: int
    accumulator_device: str  # "cuda" or "cpu"
    accumulator_dtype: str  # a key of ACCUMULATOR_DTYPES: the caller's (prediction: PREDICTION_ACCUMULATOR)
    num_variants: int  # mirror variants per tile
    slab_depth: int  # the most z-slices one finished slab holds (``finish_chunk_slices`` of the accumulator's depth)
    peak_bytes: int
    parameter_bytes: int
    host_accumulator_bytes: int
    budget_bytes: int
    fits: bool
    heap_retained_bytes: int
    choices: tuple[tuple[int, str, int], ...]

    def describe(self) -> str:
        """One line for ``--verbose``."""
        return (
            f"tile batch {self.tile_batch_size} ({self.num_variants} mirror variant(s) per tile), "
            f"accumulator {self.accumulator_dtype} on {self.accumulator_device}; predicted peak "
            f"{self.peak_bytes / MiB:.0f} MiB of {self.budget_bytes / MiB:.0f} MiB"
            + (f" (glibc's heap {self.heap_retained_bytes / MiB:.0f} MiB)" if self.heap_retained_bytes else "")
            + ("" if self.fits else " (does not fit: expect out-of-memory)")
        )


# One choice considered: (tile batch, accumulator device, predicted peak bytes, its memory).
Choice = tuple[int, str, int, InferenceMemory]


def plan_inference(
    setting: InferenceSetting,
    budget_bytes: int,
    max_tile_batch: int | None = None,
    runners: Sequence[WorkingBytesSource] | None = None,
) -> InferencePlan:
    """The largest tile batch, and where the accumulator lives, such that ``sliding_window_predict`` as ``setting``
    says stays within ``budget_bytes`` of ``setting.device`` ("cuda": its memory; "cpu": the host-RAM share for
    prediction). The accumulator stays on the device if it fits beside a tile batch of one, else (CUDA only) it
    moves to the host. The batch is capped at ``max_tile_batch`` (None: ``cpu_tile_batch_cap`` on CPU,
    ``CUDA_TILES_PER_BATCH`` x the mirror variants on CUDA) and at the number of (tile, variant) pairs. Device
    memory is nearly affine in the batch (the accumulator's z-window grows with the z-span of a batch): two
    simulations (batch 1, 2) estimate the batch, a third checks it and the batch shrinks until it fits.
    ``runners``: as ``inference_memory`` (the folds, asked for their working bytes; None: one, simulated).
    """
    device = setting.device
    num_variants = len(mirror_variants(setting.mirror_axes, setting.tta))
    num_items = tile_layout(setting.image_shape_zyx, setting.tile, setting.step_fraction).num_tiles * num_variants
    cap = max_tile_batch or (
        cpu_tile_batch_cap(setting.tile) if device == "cpu" else CUDA_TILES_PER_BATCH * num_variants
    )
    cap = max(1, min(cap, num_items))

    def peak(batch: int, on_device: bool) -> tuple[InferenceMemory, int]:
        mem = inference_memory(setting, batch, on_device, runners)
        return mem, predict_device_peak(mem, device)["total"]

    choices: list[Choice] = []
    for on_device in (True,) if device == "cpu" else (True, False):
        acc_device = device if on_device else "cpu"
        choices += _batches_tried(peak, on_device, acc_device, cap, budget_bytes)
        fitting = [c for c in choices if c[1] == acc_device and c[2] <= budget_bytes]
        if fitting:
            best = max(fitting, key=lambda c: c[0])
            return _inference_plan(best, choices, num_variants, budget_bytes, True, setting)
    return _inference_plan(choices[-1], choices, num_variants, budget_bytes, False, setting)


def _batches_tried(
    peak: Callable[[int, bool], tuple[InferenceMemory, int]],
    on_device: bool,
    acc_device: str,
    cap: int,
    budget_bytes: int,
) -> list[Choice]:
    """The batches tried with the accumulator on ``acc_device`` (``peak(batch, on_device)``: its memory and
    predicted peak): one, then (if one fits) the estimate from one and two, shrinking until it fits or is one."""
    mem1, one = peak(1, on_device)
    tried = [(1, acc_device, one, mem1)]
    if one > budget_bytes:
        return tried
    per_item = peak(2, on_device)[1] - one if cap > 1 else 0
    batch = cap if per_item <= 0 else max(1, min(cap, 1 + (budget_bytes - one) // per_item))
    while batch > 1:
        mem, total = peak(batch, on_device)
        tried.append((batch, acc_device, total, mem))
        if total <= budget_bytes:
            break
        batch -= 1
    return tried


def _inference_plan(
    best: Choice,
    choices: list[Choice],
    num_variants: int,
    budget_bytes: int,
    fits: bool,
    setting: InferenceSetting,
) -> InferencePlan:
    batch, acc_device, total, mem = best
    others = tuple((b, d, t) for b, d, t, _ in choices if (b, d) != (batch, acc_device))
    return InferencePlan(
        tile_batch_size=batch,
        accumulator_device=acc_device,
        accumulator_dtype=setting.accumulator_dtype,
        num_variants=num_variants,
        peak_bytes=total,
        parameter_bytes=mem.parameter_bytes,
        slab_depth=finish_chunk_slices(mem.accumulator_depth, setting.num_outputs, setting.accumulator_dtype),
        host_accumulator_bytes=mem.host_accumulator_bytes,
        budget_bytes=budget_bytes,
        fits=fits,
        heap_retained_bytes=mem.heap_retained_bytes,
        choices=((batch, acc_device, total), *others),
    )
