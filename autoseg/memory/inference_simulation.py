"""Running the sliding window's tile batch inside a ``StorageTracker``: simulated under ``FakeTensorMode``
(``simulate_tile_batch``, what ``autoseg.memory.inference`` predicts from) or measured on real CPU tensors
(``measure_inference_bytes``, what tests hold the prediction against).

This is the module that imports torch and its fake-tensor machinery: ``autoseg.memory.inference`` imports it
only when a tile must be simulated, so a plan whose tile simulations are all kept between runs does not.
"""

from __future__ import annotations

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoseg.memory.autocast_policy import cuda_autocast_policy
from autoseg.memory.glibc_heap import INFERENCE_HELD_FRAGMENT_EVERY, heap_footprint
from autoseg.memory.tracker import StorageTracker
from autoseg.model.network import build_network
from autoseg.model.sliding_window import run_tile_batch, sliding_window_predict
from autoseg.model.tile_buffers import allocate_buffers
from autoseg.model.tiles import clear_gaussian_cache, patch_as_zyx, tile_layout
from autoseg.model.topology import NetworkTopology
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.tta import mirror_variants
from autoseg.model.window import SlidingWindow


def simulate_tile_batch(
    topology: NetworkTopology,
    patch_size: tuple[int, ...],
    tile_batch_size: int,
    precision: str,
    mirror_axes: tuple[int, ...],
    tta: int | None,
    accumulator_dtype: str,
    device: str,
) -> tuple[int, int, int, int, int]:
    """``autoseg.memory.inference.simulate_tile_prediction``'s figures, simulated now (no cache): one forward pass
    of ``run_tile_batch`` on ``tile_batch_size`` (tile, mirror variant) pairs under ``FakeTensorMode``. ``device``
    "cpu": the network runs its large convolutions in slabs as ``sliding_window_predict`` does there
    (``autoseg.model.slabs``), each convolution's hidden buffers count (``cpu_conv_scratch_bytes``), and glibc's
    heap is replayed over the pass's allocations as over a training step's (``heap_footprint``: a prediction runs
    the same pass tile after tile): what it holds beyond the tensors at their peak is the fifth figure (0 on
    CUDA)."""
    variants = mirror_variants(mirror_axes, tta)
    one_tile = tile_layout(patch_as_zyx(patch_size), patch_size)  # patch-sized stand-ins for the buffers
    cpu = torch.device("cpu")
    tracker = StorageTracker(cpu_conv_scratch=device == "cpu")
    with torch.random.fork_rng(devices=[]), FakeTensorMode(), tracker:
        network = build_network(topology)
        network.eval()
        params = sum(p.numel() * p.element_size() for p in network.parameters())
        image = torch.zeros((topology.in_channels, *one_tile.padded_shape_zyx))
        window = SlidingWindow(
            tuple(patch_size),
            topology.num_outputs,
            accumulator_device="cpu",
            accumulator_dtype=accumulator_dtype,
            use_gaussian=False,  # no real Gaussian
        )
        buffers = allocate_buffers(image, one_tile, window, cpu, on_slab=_discard)
        del image
        items = [(one_tile.regions()[0], i % len(variants)) for i in range(tile_batch_size)]
        runner = TorchTileRunner(network, torch.device(device), precision)  # large convolutions in slabs on "cpu"
        tracker.mark("tiles")
        with cuda_autocast_policy(device):  # on CUDA: CUDA autocast's dtypes on these CPU tensors
            run_tile_batch([runner], buffers, items, variants, topology.num_outputs)
        tracker.mark("end")
        del buffers
    start, stop = tracker.index_of("tiles"), tracker.index_of("end")
    live = np.cumsum(np.asarray(tracker.event_delta[:stop], dtype=np.int64))
    base = int(live[start - 1]) if start > 0 else 0  # parameters and buffers, before the pass
    peak_row = int(np.argmax(live[start:])) + start
    count = int(tracker.live_count(stop)[peak_row + 1])
    tile = int(live[start:].max()) - base
    retained = 0
    if device == "cpu":
        heap = heap_footprint(
            np.asarray(tracker.event_storage[start:stop], dtype=np.int64),
            np.asarray(tracker.event_delta[start:stop], dtype=np.int64),
            held_every=INFERENCE_HELD_FRAGMENT_EVERY,
        )
        retained = heap.retained_bytes(tile)
    return params, tile, tracker.largest_conv_output_bytes, count, retained


def _discard(z_start: int, z_stop: int, probabilities: torch.Tensor) -> None:
    """A ``SlabSink`` that keeps nothing (the simulation's stand-in buffers have no output)."""


def measure_inference_bytes(
    topology: NetworkTopology, data: np.ndarray, window: SlidingWindow, precision: str = "fp32"
) -> int:
    """Peak live tensor bytes of a real ``sliding_window_predict`` with ``window`` on CPU, ``topology``'s network
    freshly built and run in ``precision``, its parameters included, and each convolution's hidden buffers as
    ``cpu_conv_scratch_bytes`` models them (held against real convolutions in ``tests/memory/test_conv_scratch.py``),
    for tests: hold ``inference_memory`` against it (``InferenceSetting.window`` gives the window it counts).
    ``data`` (C, Z, Y, X) float32 is not counted (the prediction copies it into its padded input, which is).
    ``window.output_dtype`` None: the slabs go to a sink that keeps nothing. Leaves the caller's RNG alone.
    """
    clear_gaussian_cache()  # the Gaussian is cached across calls; count its creation here
    tracker = StorageTracker(cpu_conv_scratch=True)
    data_t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    with torch.random.fork_rng(devices=[]), tracker:
        tracker.exclude([data_t])
        network = build_network(topology)
        runner = TorchTileRunner(network, torch.device("cpu"), precision)
        on_slab = _discard if window.output_dtype is None else None
        probabilities = sliding_window_predict([runner], data_t, window, on_slab)
        del probabilities, network, runner
    clear_gaussian_cache()
    return tracker.peak_bytes
