"""Device memory of sliding-window prediction (``autoseg.model.sliding_window.sliding_window_predict``).

Two phases hold memory on the device:

- tiles: the network's parameters, the call's buffers (padded input, the logit accumulator and weight map
  over a z-window of the image, Gaussian, the output; ``autoseg.model.tile_buffers.inference_buffer_bytes``)
  and one forward pass. The latter is simulated: the inference code's own ``run_tile_batch`` (the batch of
  flipped tiles, the network's activations and logits under ``inference_mode``, a tile's logits flipped back)
  runs under ``FakeTensorMode`` with a ``StorageTracker`` (``autoseg.memory.inference_simulation``, imported
  only when a tile is simulated: this module itself needs no torch).
- finishing: after a batch, the finished z-slices' softmax: the buffers and one (window x Yp x Xp) fp32 map.

``plan_inference`` turns these into choices made before a case starts: the largest tile batch within a
memory budget and where the accumulator lives (the device, or the host when it does not fit beside a tile).

The output (``(K, Z, Y, X)`` probabilities on the host, float16 in prediction) is handed to the export
(``autoseg.memory.host.export_bytes``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from autoseg.core.errors import InputError
from autoseg.core.machine import MachineCache, kept_simulations, simulation_key
from autoseg.core.precision import check_precision, element_bytes
from autoseg.core.units import MiB
from autoseg.memory.device import predict_device_peak
from autoseg.model.tile_buffers import (
    PREDICTION_ACCUMULATOR,
    finish_chunk_slices,
    finish_temp_bytes,
    inference_buffer_bytes,
)
from autoseg.model.tiles import accumulator_depth, tile_layout
from autoseg.model.topology import NetworkTopology
from autoseg.model.tta import mirror_variants


@dataclass(frozen=True)
class InferenceMemory:
    """Device bytes of predicting one image; ``peak_bytes`` is the larger of the two phases, both on top of
    ``parameter_bytes + padded_input_bytes + accumulator_bytes + weight_map_bytes + gaussian_bytes +
    output_bytes``: ``tile_bytes`` (a tile batch) and ``softmax_temp_bytes`` (finishing z-slices after it).
    ``tile_bytes``: one tile batch's prediction at its peak (the tile batch, the fp32 logit sum, flipped
    copies, network activations). The accumulator and weight map hold a window of z-slices
    (``accumulator_depth``); the output (the image's probabilities) is on the host: counted here on CPU, in
    ``host_accumulator_bytes`` on CUDA."""

    parameter_bytes: int
    tile_bytes: int
    padded_input_bytes: int
    accumulator_bytes: int
    weight_map_bytes: int
    gaussian_bytes: int
    softmax_temp_bytes: int
    output_bytes: int
    peak_bytes: int
    largest_conv_output_bytes: int
    live_allocations_at_peak: int
    tile_batch_size: int = 1  # (tile, mirror variant) pairs per forward pass
    accumulator_depth: int = 0  # z-slices the accumulator holds: the deepest slab it finishes at once
    host_accumulator_bytes: int = 0  # host bytes on CUDA: the output, and the accumulator etc. when they live there
    heap_retained_bytes: int = 0  # CPU: glibc's heap beyond the tensors at a tile's peak (``heap_footprint``)

    def breakdown(self) -> dict[str, int]:
        return {
            "parameters": self.parameter_bytes,
            "tile": self.tile_bytes,
            "padded_input": self.padded_input_bytes,
            "accumulator": self.accumulator_bytes,
            "weight_map": self.weight_map_bytes,
            "gaussian": self.gaussian_bytes,
            "softmax_temp": self.softmax_temp_bytes,
            "output": self.output_bytes,
            "total": self.peak_bytes,
        }


def simulate_tile_prediction(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    tile_batch_size: int,
    precision: str = "fp32",
    mirror_axes: Sequence[int] = (),
    tta: int | None = None,
    cache: MachineCache | None = None,
    accumulator_dtype: str = "float32",
    device: str = "cpu",
) -> tuple[int, int, int, int, int]:
    """Simulate one forward pass of ``sliding_window_predict``: its own ``run_tile_batch`` on
    ``tile_batch_size`` (tile, mirror variant) pairs, tile by tile as the real loop draws them. Returns
    (parameter bytes, peak bytes beyond the parameters and the call's buffers, largest convolution output
    bytes, live allocations at the peak, buffers included, and on CPU what glibc's heap holds beyond the
    tensors at that peak). Cached: the answer does not depend on the image;
    with ``cache`` also between runs (keyed by the simulated code and torch's version): the simulation, and
    importing the fake-tensor machinery for it, cost a prediction 1-4 s of its start.

    fp16 runs as bf16 (same bytes): the inference code turns fp16 autocast off on CPU devices. ``device`` "cpu":
    the network runs its large convolutions in slabs as ``sliding_window_predict`` does there
    (``autoseg.model.slabs``), and each convolution's hidden buffers count (``cpu_conv_scratch_bytes``).
    """
    check_precision(precision)  # an unknown name says what to use
    device = device.split(":")[0]  # "cuda:1" -> "cuda"
    args = (
        topology,
        tuple(int(p) for p in patch_size),
        int(tile_batch_size),
        "bf16" if precision == "fp16" else precision,
        tuple(int(a) for a in mirror_axes),
        tta,
        accumulator_dtype,
        device,
    )
    cache = cache or kept_simulations()  # the planner's inference tile: the command's cache
    if cache is None:
        return _simulate_cached(*args)
    key = {
        **simulation_key(_SIMULATED_MODULES),
        "topology": asdict(topology),
        "tile": args[1],
        "tile_batch": args[2],
        "precision": args[3],
        "mirror_axes": args[4],
        "tta": args[5],
        "accumulator": args[6],
        "device": args[7],
    }
    value, _ = cache.kept("inference_simulation", key, lambda: list(_simulate_cached(*args)), SIMULATIONS_KEPT)
    return tuple(int(v) for v in value)  # type: ignore[return-value]


SIMULATIONS_KEPT = 256  # simulated (network, tile, batch, ...) kept between runs


# the code a tile simulation runs (the networks, the sliding window's step and buffers, the tracker, the heap model,
# the simulation and this module): a kept simulation is reused only while these files are unchanged
_SIMULATED_MODULES = tuple(
    f"autoseg.model.{m}"
    for m in ("blocks", "network", "residual", "sliding_window", "slabs", "tile_buffers", "tiles", "tta", "topology")
) + (
    "autoseg.core.precision",
    "autoseg.memory.tracker",
    "autoseg.memory.glibc_heap",
    "autoseg.memory.inference_simulation",
    __name__,
)


@functools.lru_cache(maxsize=64)
def _simulate_cached(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    tile_batch_size: int,
    precision: str,
    mirror_axes: tuple[int, ...],
    tta: int | None,
    accumulator_dtype: str,
    device: str,
) -> tuple[int, int, int, int, int]:
    from autoseg.memory.inference_simulation import simulate_tile_batch  # torch: imported once a tile must run

    return simulate_tile_batch(
        topology, patch_size, tile_batch_size, precision, mirror_axes, tta, accumulator_dtype, device
    )


def inference_memory(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    tile_batch_size: int,
    image_shape_zyx: tuple[int, int, int],
    num_outputs: int,
    precision: str = "fp32",
    mirror_axes: Sequence[int] = (),
    step_fraction: float | Sequence[float] = 0.5,
    tta: int | None = None,
    accumulator_on_device: bool = True,
    device: str = "cpu",
    output_dtype: str | None = "float32",
    num_networks: int = 1,
    cache: MachineCache | None = None,
    accumulator_dtype: str = "float32",
) -> InferenceMemory:
    """Device bytes of ``sliding_window_predict`` on one preprocessed image of ``image_shape_zyx``.

    ``patch_size`` (z, y, x) for a 3D or (y, x) for a 2D network; ``num_outputs`` must be the network's.
    The tile batch is at most the number of (tile, mirror variant) pairs. ``accumulator_on_device`` False:
    the accumulator, weight map, Gaussian and softmax live on the host (``host_accumulator_bytes``) and
    the device holds the parameters, the padded input and the tile batch. ``device``: "cpu" or "cuda" (where
    the output counts); ``output_dtype``: the probabilities' (``sliding_window_predict``; None: no output, the
    slabs go to a sink that the caller counts). ``num_networks``: the folds predicted together (each one's
    parameters are held; one forward pass runs at a time). ``cache``: keep the simulation between runs
    (``simulate_tile_prediction``). ``accumulator_dtype``: a key of ``ACCUMULATOR_DTYPES``.
    """
    if num_outputs != topology.num_outputs:
        raise InputError(
            f"num_outputs {num_outputs} differs from the network's {topology.num_outputs}; "
            "pass the plan's number of classes (labels in dataset.json)"
        )
    if len(patch_size) != topology.dim:
        raise InputError(f"patch_size {tuple(patch_size)} has {len(patch_size)} sizes; the network is {topology.dim}D")
    variants = len(mirror_variants(mirror_axes, tta))
    layout = tile_layout(image_shape_zyx, patch_size, step_fraction)
    batch = min(tile_batch_size, layout.num_tiles * variants)
    params, tile, conv, count, retained = simulate_tile_prediction(
        topology, tuple(patch_size), batch, precision, mirror_axes, tta, cache, accumulator_dtype, device
    )
    params *= num_networks
    buffers = inference_buffer_bytes(
        image_shape_zyx,
        patch_size,
        num_outputs,
        batch,
        topology.in_channels,
        num_variants=variants,
        output_dtype=output_dtype,
        step_fraction=step_fraction,
        device=device,
        accumulator_dtype=accumulator_dtype,
    )
    depth = accumulator_depth(layout, variants, batch)
    temp = finish_temp_bytes(depth, math.prod(layout.padded_shape_zyx[1:]), num_outputs, accumulator_dtype)
    held = buffers["accumulator"] + buffers["weight_map"] + buffers["gaussian"]  # on the accumulator's device
    # on the host when the accumulator is there: the batch's logits copied over and one tile's flipped back
    # (and, adding a tile: its share g / W, and for float16 the region's fp32 copy)
    patch_voxels = math.prod(patch_size)
    logit_copies = (
        (batch + 1) * num_outputs * patch_voxels * element_bytes(precision)
        + patch_voxels * 4
        + (num_outputs * patch_voxels * 4 if accumulator_dtype == "float16" else 0)
    )
    output_here = buffers["output"] if device == "cpu" else 0  # the output lives on the host
    host = (buffers["output"] if device != "cpu" else 0) + (0 if accumulator_on_device else held + logit_copies)
    on_device = (held if accumulator_on_device else 0) + params + buffers["padded_input"] + output_here
    tiles = on_device + tile
    finishing = on_device + (temp if accumulator_on_device else 0)  # after a batch: its tiles are freed
    return InferenceMemory(
        parameter_bytes=params,
        tile_bytes=tile,
        padded_input_bytes=buffers["padded_input"],
        accumulator_bytes=buffers["accumulator"] if accumulator_on_device else 0,
        weight_map_bytes=buffers["weight_map"] if accumulator_on_device else 0,
        gaussian_bytes=buffers["gaussian"] if accumulator_on_device else 0,
        softmax_temp_bytes=temp if accumulator_on_device else 0,
        output_bytes=output_here,
        peak_bytes=max(tiles, finishing),
        largest_conv_output_bytes=conv,
        live_allocations_at_peak=count,
        tile_batch_size=batch,
        accumulator_depth=depth,
        host_accumulator_bytes=host,
        heap_retained_bytes=retained,
    )


CPU_MAX_TILE_BATCH = 4  # CPU: batch 2-4 is 3x faster per tile than 1, 8 no faster than 4 (docs/memory.md)
# CPU: a batch gains nothing beyond about this many voxels (the measurement above: 4 tiles of 16x40x40); a larger
# tile is batched less (a 48x192x160 tile: 1), so its activations are not held 4 times for no speed
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


def plan_inference(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    image_shape_zyx: tuple[int, int, int],
    num_outputs: int,
    budget_bytes: int,
    device: str = "cpu",
    precision: str = "fp32",
    mirror_axes: Sequence[int] = (),
    tta: int | None = None,
    step_fraction: float | Sequence[float] = 0.5,
    max_tile_batch: int | None = None,
    output_dtype: str | None = "float32",
    num_networks: int = 1,
    cache: MachineCache | None = None,
    accumulator_dtype: str = PREDICTION_ACCUMULATOR,
) -> InferencePlan:
    """The largest tile batch, and where the accumulator lives, such that ``sliding_window_predict`` on an
    image of ``image_shape_zyx`` stays within ``budget_bytes`` of ``device`` ("cuda": its memory; "cpu":
    the host-RAM share for prediction). The accumulator stays on the device if it fits beside a tile batch
    of one, else (CUDA only) it moves to the host. The batch is capped at ``max_tile_batch`` (None:
    ``cpu_tile_batch_cap`` on CPU, ``CUDA_TILES_PER_BATCH`` x the mirror variants on CUDA) and at the
    number of (tile, variant) pairs. Device memory is nearly affine in the batch (the accumulator's z-window
    grows with the z-span of a batch): two simulations (batch 1, 2) estimate the batch, a third checks it and
    the batch shrinks until it fits. ``output_dtype``, ``num_networks``, ``cache``, ``accumulator_dtype``: as
    ``inference_memory``.
    """
    num_variants = len(mirror_variants(mirror_axes, tta))
    num_items = tile_layout(image_shape_zyx, patch_size, step_fraction).num_tiles * num_variants
    cap = max_tile_batch or (cpu_tile_batch_cap(patch_size) if device == "cpu" else CUDA_TILES_PER_BATCH * num_variants)
    cap = max(1, min(cap, num_items))

    def peak(batch: int, on_device: bool) -> tuple[InferenceMemory, int]:
        mem = inference_memory(
            topology,
            patch_size,
            batch,
            image_shape_zyx,
            num_outputs,
            precision,
            mirror_axes,
            step_fraction,
            tta,
            on_device,
            device,
            output_dtype,
            num_networks,
            cache,
            accumulator_dtype,
        )
        return mem, predict_device_peak(mem, device)["total"]

    placements = (True,) if device == "cpu" else (True, False)
    choices: list[tuple[int, str, int, InferenceMemory]] = []
    for on_device in placements:
        acc_device = device if on_device else "cpu"
        mem1, one = peak(1, on_device)
        choices.append((1, acc_device, one, mem1))
        if one > budget_bytes:
            continue
        per_item = peak(2, on_device)[1] - one if cap > 1 else 0
        batch = cap if per_item <= 0 else max(1, min(cap, 1 + (budget_bytes - one) // per_item))
        while batch > 1:
            mem, total = peak(batch, on_device)
            choices.append((batch, acc_device, total, mem))
            if total <= budget_bytes:
                break
            batch -= 1
        best = max((c for c in choices if c[1] == acc_device and c[2] <= budget_bytes), key=lambda c: c[0])
        return _inference_plan(best, choices, num_variants, budget_bytes, True, accumulator_dtype, num_outputs)
    return _inference_plan(choices[-1], choices, num_variants, budget_bytes, False, accumulator_dtype, num_outputs)


def _inference_plan(
    best: tuple[int, str, int, InferenceMemory],
    choices: list,
    num_variants: int,
    budget_bytes: int,
    fits: bool,
    accumulator_dtype: str,
    num_outputs: int,
) -> InferencePlan:
    batch, acc_device, total, mem = best
    others = tuple((b, d, t) for b, d, t, _ in choices if (b, d) != (batch, acc_device))
    return InferencePlan(
        tile_batch_size=batch,
        accumulator_device=acc_device,
        accumulator_dtype=accumulator_dtype,
        num_variants=num_variants,
        peak_bytes=total,
        parameter_bytes=mem.parameter_bytes,
        slab_depth=finish_chunk_slices(mem.accumulator_depth, num_outputs, accumulator_dtype),
        host_accumulator_bytes=mem.host_accumulator_bytes,
        budget_bytes=budget_bytes,
        fits=fits,
        heap_retained_bytes=mem.heap_retained_bytes,
        choices=((batch, acc_device, total), *others),
    )
