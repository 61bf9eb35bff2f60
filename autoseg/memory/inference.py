"""Device memory of sliding-window prediction (``autoseg.model.sliding_window.sliding_window_predict``).

Two phases hold memory on the device:

- tiles: the runners' parameters, the call's buffers (padded input, the logit accumulator and weight map
  over a z-window of the image, Gaussian, the output; ``autoseg.model.tile_buffers.inference_buffer_bytes``)
  and one forward pass: what each runner reports for a tile batch (``working_bytes``,
  ``autoseg.model.tile_runner``). A torch network's is simulated: the inference code's own ``run_tile_batch``
  (the batch of flipped tiles, the network's activations and logits under ``inference_mode``, a tile's logits
  flipped back) runs under ``FakeTensorMode`` with a ``StorageTracker`` (``TileSimulation``;
  ``autoseg.memory.inference_simulation``, imported only when a tile is simulated: this module itself needs no
  torch).
- finishing: after a batch, the finished z-slices' softmax: the buffers and one (window x Yp x Xp) fp32 map.

``autoseg.memory.inference_plan.plan_inference`` turns these into choices made before a case starts: the largest
tile batch within a memory budget and where the accumulator lives (the device, or the host when it does not fit
beside a tile).

The output (``(K, Z, Y, X)`` probabilities on the host, float16 in prediction) is handed to the export
(``autoseg.memory.host.export_bytes``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from autoseg.core.errors import InputError
from autoseg.core.machine import MachineCache, kept_simulations, simulation_key
from autoseg.core.precision import check_precision, element_bytes
from autoseg.model.agreement import Agreement
from autoseg.model.tile_buffers import finish_temp_bytes, inference_buffer_bytes
from autoseg.model.tile_runner import TileBatchBytes, WorkingBytesSource
from autoseg.model.tiles import accumulator_depth, tile_layout
from autoseg.model.topology import NetworkTopology
from autoseg.model.tta import mirror_variants
from autoseg.model.window import SlidingWindow


@dataclass(frozen=True)
class InferenceSetting:
    """One ``sliding_window_predict`` as the memory model counts it: ``topology``'s network (its inputs, outputs and
    dimension) with ``tile`` over a preprocessed image of ``image_shape_zyx`` on ``device`` ("cpu" or "cuda").

    ``tile`` (z, y, x) for a 3D or (y, x) for a 2D network; ``num_outputs`` must be the network's. ``precision``:
    the compute precision (a key of ``PRECISIONS``). ``mirror_axes``, ``tta``, ``step_fraction``,
    ``accumulator_dtype``: as the ``SlidingWindow`` that runs. ``output_dtype``: the probabilities'
    (``sliding_window_predict``; None: no output, the slabs go to a sink that the caller counts). The tile batch and
    the accumulator's place are what ``plan_inference`` chooses: ``inference_memory`` takes them apart.
    ``agreement``: the members whose disagreement the window counts (``autoseg.model.agreement``), or None.
    """

    topology: NetworkTopology
    tile: tuple[int, ...]
    image_shape_zyx: tuple[int, int, int]
    num_outputs: int
    device: str = "cpu"
    precision: str = "fp32"
    mirror_axes: tuple[int, ...] = ()
    tta: int | None = None
    step_fraction: float | tuple[float, ...] = 0.5
    output_dtype: str | None = "float32"
    accumulator_dtype: str = "float32"
    agreement: Agreement | None = None

    def window(self, tile_batch_size: int) -> SlidingWindow:
        """The ``SlidingWindow`` whose buffers are counted (``inference_buffer_bytes``)."""
        return SlidingWindow(
            tuple(self.tile),
            self.num_outputs,
            self.step_fraction,
            tuple(self.mirror_axes),
            self.tta,
            tile_batch_size,
            accumulator_dtype=self.accumulator_dtype,
            output_dtype=self.output_dtype,
            agreement=self.agreement,
        )


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
    agreement_bytes: int = 0  # beside a tile batch on the device: the members' label tiles (``agreement_bytes``)

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
            "agreement": self.agreement_bytes,
            "total": self.peak_bytes,
        }


@dataclass(frozen=True)
class TileSimulation:
    """A torch network's working bytes for a tile batch as the sliding window runs it: the torch runner's
    ``working_bytes`` (``autoseg.model.torch_runner.TorchTileRunner``), and the memory model's where no runner exists
    yet (the planner, ``autoseg explain``). ``topology``'s network in ``precision`` on ``device``, its batch items
    the first ``tta`` mirror variants of ``mirror_axes``, added to an ``accumulator_dtype`` accumulator.
    ``cache``: keep the simulations between runs (None: the command's, ``kept_simulations``)."""

    topology: NetworkTopology
    precision: str = "fp32"
    mirror_axes: tuple[int, ...] = ()
    tta: int | None = None
    accumulator_dtype: str = "float32"
    device: str = "cpu"
    cache: MachineCache | None = field(default=None, compare=False)

    @classmethod
    def of(cls, setting: InferenceSetting) -> TileSimulation:
        """The simulation of ``setting``'s network as its sliding window runs it."""
        return cls(
            setting.topology,
            setting.precision,
            tuple(setting.mirror_axes),
            setting.tta,
            setting.accumulator_dtype,
            setting.device,
        )

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        return simulate_tile_prediction(self, tile, tile_batch_size)


def simulate_tile_prediction(
    simulation: TileSimulation, patch_size: tuple[int, ...], tile_batch_size: int
) -> TileBatchBytes:
    """Simulate one forward pass of ``sliding_window_predict``: its own ``run_tile_batch`` on
    ``tile_batch_size`` (tile, mirror variant) pairs, tile by tile as the real loop draws them, as ``simulation``
    says. Returns the parameter bytes, the peak bytes beyond the parameters and the call's buffers, the largest
    convolution output bytes, the live allocations at the peak, buffers included, and on CPU what glibc's heap
    holds beyond the tensors at that peak (``TileBatchBytes``). Cached: the answer does not depend on the image;
    with a ``MachineCache`` also between runs (keyed by the simulated code and torch's version): the simulation,
    and importing the fake-tensor machinery for it, are a large part of a prediction's start.

    fp16 runs as bf16 (same bytes): the inference code turns fp16 autocast off on CPU devices. ``device`` "cpu":
    the network runs its large convolutions in slabs as ``sliding_window_predict`` does there
    (``autoseg.model.slabs``), and each convolution's hidden buffers count (``cpu_conv_scratch_bytes``).
    """
    check_precision(simulation.precision)  # an unknown name says what to use
    device = simulation.device.split(":")[0]  # "cuda:1" -> "cuda"
    args = (
        simulation.topology,
        tuple(int(p) for p in patch_size),
        int(tile_batch_size),
        "bf16" if simulation.precision == "fp16" else simulation.precision,
        tuple(int(a) for a in simulation.mirror_axes),
        simulation.tta,
        simulation.accumulator_dtype,
        device,
    )
    cache = simulation.cache or kept_simulations()  # the planner's inference tile: the command's cache
    if cache is None:
        return TileBatchBytes(*_simulate_cached(*args))
    key = {
        **simulation_key(_SIMULATED_MODULES),
        "topology": asdict(simulation.topology),
        "tile": args[1],
        "tile_batch": args[2],
        "precision": args[3],
        "mirror_axes": args[4],
        "tta": args[5],
        "accumulator": args[6],
        "device": args[7],
    }
    value, _ = cache.kept("inference_simulation", key, lambda: list(_simulate_cached(*args)), SIMULATIONS_KEPT)
    return TileBatchBytes(*(int(v) for v in value))


SIMULATIONS_KEPT = 256  # simulated (network, tile, batch, ...) kept between runs


# the code a tile simulation runs (the networks, the sliding window's step and buffers, the tracker, the heap model,
# the simulation and this module): a kept simulation is reused only while these files are unchanged
_SIMULATED_MODULES = tuple(
    f"autoseg.model.{m}"
    for m in (
        "blocks",
        "network",
        "residual",
        "sliding_window",
        "slabs",
        "tile_buffers",
        "tile_runner",
        "tiles",
        "torch_runner",
        "tta",
        "topology",
        "window",
    )
) + (
    "autoseg.core.precision",
    "autoseg.memory.tracker",
    "autoseg.memory.glibc_heap",
    "autoseg.memory.inference_simulation",
    "autoseg.memory.autocast_policy",
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
    setting: InferenceSetting,
    tile_batch_size: int,
    accumulator_on_device: bool = True,
    runners: Sequence[WorkingBytesSource] | None = None,
) -> InferenceMemory:
    """Device bytes of ``sliding_window_predict`` as ``setting`` says, with ``tile_batch_size`` (tile, mirror
    variant) pairs per forward pass (at most the number of pairs).

    ``accumulator_on_device`` False: the accumulator, weight map, Gaussian and softmax live on the host
    (``host_accumulator_bytes``) and the device holds the parameters, the padded input and the tile batch.
    ``runners``: the folds predicted together, each asked for its ``working_bytes`` (each one's parameters are held;
    one forward pass runs at a time); None: one network, simulated (``TileSimulation.of(setting)``).
    """
    topology = setting.topology
    if setting.num_outputs != topology.num_outputs:
        raise InputError(
            f"num_outputs {setting.num_outputs} differs from the network's {topology.num_outputs}; "
            "pass the plan's number of classes (labels in dataset.json)"
        )
    if len(setting.tile) != topology.dim:
        raise InputError(
            f"patch_size {tuple(setting.tile)} has {len(setting.tile)} sizes; the network is {topology.dim}D"
        )
    variants = len(mirror_variants(setting.mirror_axes, setting.tta))
    layout = tile_layout(setting.image_shape_zyx, setting.tile, setting.step_fraction)
    batch = min(tile_batch_size, layout.num_tiles * variants)
    tiles = _ensemble([r.working_bytes(batch, tuple(setting.tile)) for r in runners or (TileSimulation.of(setting),)])
    buffers = inference_buffer_bytes(
        setting.image_shape_zyx, setting.window(batch), topology.in_channels, device=setting.device
    )
    depth = accumulator_depth(layout, variants, batch)
    temp = finish_temp_bytes(
        depth, math.prod(layout.padded_shape_zyx[1:]), setting.num_outputs, setting.accumulator_dtype
    )
    return _placed(setting, tiles, buffers, temp, batch, depth, accumulator_on_device)


def _ensemble(figures: list[TileBatchBytes]) -> TileBatchBytes:
    """The folds' tile batches together: every fold's weights are held, one forward pass runs at a time, beside what
    the other folds hold after theirs (``held_bytes``: a graph runtime's arena)."""
    held = sum(f.held_bytes for f in figures)
    return TileBatchBytes(
        parameter_bytes=sum(f.parameter_bytes for f in figures),
        tile_bytes=held + max(f.tile_bytes - f.held_bytes for f in figures),
        largest_conv_output_bytes=max(f.largest_conv_output_bytes for f in figures),
        live_allocations_at_peak=max(f.live_allocations_at_peak for f in figures),
        heap_retained_bytes=max(f.heap_retained_bytes for f in figures),
        held_bytes=held,
    )


def _placed(
    setting: InferenceSetting,
    tiles: TileBatchBytes,
    buffers: dict[str, int],
    temp: int,
    batch: int,
    depth: int,
    accumulator_on_device: bool,
) -> InferenceMemory:
    """``inference_memory`` once the accumulator is placed: what the device holds in each phase (``temp``: finishing
    a slab, ``finish_temp_bytes``), and the host. ``depth``: the accumulator's z-slices."""
    held = buffers["accumulator"] + buffers["weight_map"] + buffers["gaussian"]  # on the accumulator's device
    # on the host when the accumulator is there: the batch's logits copied over and one tile's flipped back
    # (and, adding a tile: its share g / W, and for float16 the region's fp32 copy)
    patch_voxels, num_outputs = math.prod(setting.tile), setting.num_outputs
    logit_copies = (
        (batch + 1) * num_outputs * patch_voxels * element_bytes(setting.precision)
        + patch_voxels * 4
        + (num_outputs * patch_voxels * 4 if setting.accumulator_dtype == "float16" else 0)
    )
    # the members' label tiles and their counting, beside a tile batch where the accumulator is
    agreement = buffers["agreement"]
    cpu = setting.device == "cpu"
    output_here = buffers["output"] if cpu else 0  # the output lives on the host
    host = (0 if cpu else buffers["output"]) + (0 if accumulator_on_device else held + logit_copies + agreement)
    on_device = (held if accumulator_on_device else 0) + tiles.parameter_bytes + buffers["padded_input"] + output_here
    finishing = on_device + (temp if accumulator_on_device else 0)  # after a batch: its tiles are freed
    return InferenceMemory(
        parameter_bytes=tiles.parameter_bytes,
        tile_bytes=tiles.tile_bytes,
        padded_input_bytes=buffers["padded_input"],
        accumulator_bytes=buffers["accumulator"] if accumulator_on_device else 0,
        weight_map_bytes=buffers["weight_map"] if accumulator_on_device else 0,
        gaussian_bytes=buffers["gaussian"] if accumulator_on_device else 0,
        softmax_temp_bytes=temp if accumulator_on_device else 0,
        output_bytes=output_here,
        peak_bytes=max(on_device + tiles.tile_bytes + (agreement if accumulator_on_device else 0), finishing),
        largest_conv_output_bytes=tiles.largest_conv_output_bytes,
        live_allocations_at_peak=tiles.live_allocations_at_peak,
        tile_batch_size=batch,
        accumulator_depth=depth,
        host_accumulator_bytes=host,
        heap_retained_bytes=tiles.heap_retained_bytes,
        agreement_bytes=agreement if accumulator_on_device else 0,
    )
