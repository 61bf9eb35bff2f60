"""Device memory of sliding-window prediction (``autoseg.model.sliding_window.sliding_window_predict``).

Two phases hold memory on the device:

- tiles: the network's parameters, the call's buffers (padded input, logit accumulator, weight map,
  Gaussian; ``autoseg.model.sliding_window.inference_buffer_bytes``) and one tile batch's prediction. The latter is
  simulated: the inference code's own ``predict_tile_batch`` (flips for mirroring, the fp32 logit sum,
  the network's forward activations under ``inference_mode``) runs under ``FakeTensorMode`` with a
  ``StorageTracker``.
- softmax: the input and weight map are freed; the accumulator and one ``(Zp, Yp, Xp)`` fp32 temporary remain.

The probabilities handed back (``(K, Z, Y, X)`` fp32 on the host) belong to the export
(``autoseg.memory.host.export_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoseg.core.errors import InputError
from autoseg.core.precision import autocast_dtype
from autoseg.memory.tracker import StorageTracker
from autoseg.model.network import build_network
from autoseg.model.sliding_window import (
    clear_gaussian_cache,
    inference_buffer_bytes,
    predict_tile_batch,
    sliding_window_predict,
    tile_layout,
)
from autoseg.model.topology import NetworkTopology


@dataclass(frozen=True)
class InferenceMemory:
    """Device bytes of predicting one image; ``peak_bytes`` is the larger of the two phases:
    ``parameter_bytes + padded_input_bytes + accumulator_bytes + weight_map_bytes + gaussian_bytes +
    tile_bytes`` (tiles) and ``parameter_bytes + accumulator_bytes + softmax_temp_bytes`` (softmax).
    ``tile_bytes``: one tile batch's prediction at its peak (the tile batch, the fp32 logit sum, flipped
    copies, network activations)."""

    parameter_bytes: int
    tile_bytes: int
    padded_input_bytes: int
    accumulator_bytes: int
    weight_map_bytes: int
    gaussian_bytes: int
    softmax_temp_bytes: int
    peak_bytes: int
    largest_conv_output_bytes: int
    live_allocations_at_peak: int

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameter_bytes, "tile": self.tile_bytes,
                "padded_input": self.padded_input_bytes, "accumulator": self.accumulator_bytes,
                "weight_map": self.weight_map_bytes, "gaussian": self.gaussian_bytes,
                "softmax_temp": self.softmax_temp_bytes, "total": self.peak_bytes}


def simulate_tile_prediction(topology: NetworkTopology, patch_size: tuple[int, ...], tile_batch_size: int,
                             precision: str = "fp32", mirror_axes: Sequence[int] = (),
                             num_batches: int = 2) -> tuple[int, int, int, int]:
    """Simulate the tile loop of ``sliding_window_predict`` (``predict_tile_batch`` on ``num_batches`` tile
    batches; from the second on the previous batch's logits are still alive, so 2 stand for any more).
    Returns (parameter bytes, peak bytes beyond the parameters, largest convolution output bytes, live
    allocations at the peak).

    fp16 runs as bf16 (same bytes): the inference code turns fp16 autocast off on CPU devices.
    """
    autocast_dtype(precision)  # an unknown name says what to use
    sim_precision = "bf16" if precision == "fp16" else precision
    tracker = StorageTracker()
    with torch.random.fork_rng(devices=[]), FakeTensorMode(), tracker:
        network = build_network(topology)
        network.eval()
        params = sum(p.numel() * p.element_size() for p in network.parameters())
        tracker.mark("tiles")
        logits = None
        for _ in range(min(num_batches, 2)):  # from the second batch on, the previous logits are still held
            # B x C x patch fp32, the stacked copy of the tiles
            tile_batch = torch.randn((tile_batch_size, topology.in_channels, *patch_size))
            logits = predict_tile_batch(network, tile_batch, topology.num_outputs, tuple(mirror_axes),
                                        sim_precision)
        tracker.mark("end")
        del logits, tile_batch
    start, stop = tracker.index_of("tiles"), tracker.index_of("end")
    live = np.cumsum(np.asarray(tracker.event_delta[:stop], dtype=np.int64))[start:]
    peak_row = int(np.argmax(live)) + start
    count = int(tracker.live_count(stop)[peak_row + 1])
    return params, int(live.max()) - params, tracker.largest_conv_output_bytes, count


def inference_memory(topology: NetworkTopology, patch_size: tuple[int, ...], tile_batch_size: int,
                     image_shape_zyx: tuple[int, int, int], num_outputs: int, precision: str = "fp32",
                     mirror_axes: Sequence[int] = (), step_fraction: float = 0.5) -> InferenceMemory:
    """Device bytes of ``sliding_window_predict`` on one preprocessed image of ``image_shape_zyx``.

    ``patch_size`` (z, y, x) for a 3D or (y, x) for a 2D network; ``num_outputs`` must be the network's.
    The tile batch is at most the number of tiles.
    """
    if num_outputs != topology.num_outputs:
        raise InputError(f"num_outputs {num_outputs} differs from the network's {topology.num_outputs}; "
                         "pass the plan's number of classes (labels in dataset.json)")
    if len(patch_size) != topology.dim:
        raise InputError(f"patch_size {tuple(patch_size)} has {len(patch_size)} sizes; the network is "
                         f"{topology.dim}D")
    num_tiles = tile_layout(image_shape_zyx, patch_size, step_fraction).num_tiles
    batch = min(tile_batch_size, num_tiles)
    params, tile, conv, count = simulate_tile_prediction(topology, tuple(patch_size), batch, precision,
                                                         mirror_axes, math.ceil(num_tiles / batch))
    buffers = inference_buffer_bytes(image_shape_zyx, patch_size, num_outputs, tile_batch_size,
                                     topology.in_channels)
    padded_voxels = buffers["weight_map"] // 4
    tiles = params + sum(buffers[k] for k in ("padded_input", "accumulator", "weight_map", "gaussian")) + tile
    softmax = params + buffers["accumulator"] + 4 * padded_voxels
    return InferenceMemory(
        parameter_bytes=params, tile_bytes=tile, padded_input_bytes=buffers["padded_input"],
        accumulator_bytes=buffers["accumulator"], weight_map_bytes=buffers["weight_map"],
        gaussian_bytes=buffers["gaussian"], softmax_temp_bytes=4 * padded_voxels,
        peak_bytes=max(tiles, softmax),
        largest_conv_output_bytes=conv, live_allocations_at_peak=count + 4)


def measure_inference_bytes(topology: NetworkTopology, data: np.ndarray, patch_size: tuple[int, ...],
                            tile_batch_size: int = 1, precision: str = "fp32",
                            mirror_axes: Sequence[int] = ()) -> int:
    """Peak live tensor bytes of a real ``sliding_window_predict`` on CPU with a freshly built network, its
    parameters included (for tests: hold ``inference_memory`` against it). ``data`` (C, Z, Y, X) float32
    is not counted (the prediction copies it into its padded input, which is). Leaves the caller's RNG alone.
    """
    clear_gaussian_cache()  # the Gaussian is cached across calls; count its creation here
    tracker = StorageTracker()
    data_t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    with torch.random.fork_rng(devices=[]), tracker:
        tracker.exclude([data_t])
        network = build_network(topology)
        probabilities = sliding_window_predict(network, data_t, patch_size, topology.num_outputs,
                                               mirror_axes=tuple(mirror_axes),
                                               tile_batch_size=tile_batch_size, precision=precision)
        del probabilities, network
    clear_gaussian_cache()
    return tracker.peak_bytes
