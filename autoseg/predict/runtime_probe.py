"""The child process that measures a graph runtime's working bytes (``autoseg.predict.runtime_memory``):
``python -m autoseg.predict.runtime_probe REQUEST.json`` prints one JSON line of figures, or exits non-zero with the
runtime's message on stderr.

It runs the real call as prediction runs it: the graph compiled into a tile runner
(``autoseg.model.graph_runners.GRAPH_RUNNERS``: the runtime, precision and threads asked) and the sliding window's own
``run_tile_batch`` over real buffers of a tile-sized image of ones (the input, accumulator, weight map and
Gaussian, as the torch simulation lays them out: ``autoseg.memory.inference_simulation``), its batch items the
mirror variants in turn, as the window draws them. Read from the process's RSS (Linux ``VmRSS``, and ``VmHWM`` reset
before the calls):

- ``parameter_bytes``: the RSS the graph's bytes and its compiled model add, after the imports;
- ``tile_bytes``: the peak RSS during ``CALLS`` calls of a batch of ``batch`` items above the RSS before the first
  call, the buffers already written: what the batch adds beyond the weights and the sliding window's buffers, as
  ``TileBatchBytes.tile_bytes`` is for the torch runner, its input batch, logits, flipped copies and whatever the
  runtime and glibc's heap keep included (so no separate heap term);
- ``held_bytes``: the RSS after those calls above the same start: what the runtime keeps between calls (its arena,
  its intermediate buffers).

``python -m autoseg.predict.runtime_probe --torch-first-call THREADS`` measures instead what a process's first CPU
forward through torch adds to its RSS whatever the network (``measure_torch_first_call``).

One batch size a process: a runtime keeps the buffers of every shape it ran (OpenVINO), or grows its arena by
powers of two (ONNX Runtime), and freed ones stay in glibc's heap for the next, so a second batch measured after a
first is off by up to 40% either way; a sliding window runs one batch size.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path

CALLS = 3  # per batch: the first call grows the heap and the runtime's state; the peak is the process's


def measure(request: dict) -> dict:
    """The figures (module docstring) of ``request``: ``graph_path``, ``runtime``, ``precision``, ``threads``,
    ``tile``, ``batch``, ``in_channels``, ``num_outputs``, ``mirror_axes``, ``tta``, ``accumulator_dtype``."""
    import torch

    from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss, use_one_malloc_arena
    from autoseg.model.graph_runners import GRAPH_RUNNERS
    from autoseg.model.sliding_window import run_tile_batch

    use_one_malloc_arena()  # as predict does, before the runtime's threads allocate
    torch.set_num_threads(int(request["threads"]))
    runtime = request["runtime"]
    with contextlib.suppress(ImportError):  # its libraries are part of the start (missing: compiling says so)
        importlib.import_module(runtime)
    start = process_rss_bytes()
    runner = GRAPH_RUNNERS[runtime](
        Path(request["graph_path"]).read_bytes(),
        _NotAsked(),
        threads=int(request["threads"]),
        precision=request["precision"],
        what="the measured graph",
    )
    parameter_bytes = process_rss_bytes() - start
    buffers, region, variants = _written_buffers(request)
    batch = int(request["batch"])
    before = process_rss_bytes()
    reset_peak_rss()
    for call in range(CALLS):  # the variants in turn, as the window draws them: flipped tiles and logits too
        items = [(region, (call * batch + i) % len(variants)) for i in range(batch)]
        run_tile_batch([runner], buffers, items, variants, int(request["num_outputs"]))
    return {
        "parameter_bytes": int(parameter_bytes),
        "tile_bytes": int((peak_rss_bytes() or process_rss_bytes()) - before),
        "held_bytes": int(process_rss_bytes() - before),
    }


# the smallest network and tile the torch runner runs: its own tensors are a few KiB, so what the first call adds is
# the process's (torch's and oneDNN's kernels paged in, OpenMP's threads, oneDNN's global state)
FIRST_CALL_FEATURES, FIRST_CALL_TILE = (4, 8), (8, 16, 16)


def measure_torch_first_call(threads: int) -> dict:
    """The RSS that ``CALLS`` tile batches of a tiny U-Net (``FIRST_CALL_FEATURES`` on ``FIRST_CALL_TILE``) through
    the torch tile runner add to a process that has imported torch and autoseg's prediction and built the network:
    ``first_call_bytes``."""
    import torch

    from autoseg.core.resources import process_rss_bytes, use_one_malloc_arena
    from autoseg.model.network import build_network
    from autoseg.model.topology import NetworkTopology
    from autoseg.model.torch_runner import TorchTileRunner
    from autoseg.predict import predictor  # noqa: F401  (prediction's imports, as a predict process holds them)

    use_one_malloc_arena()
    torch.set_num_threads(int(threads))
    depth = len(FIRST_CALL_FEATURES)
    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=2,
        features_per_stage=FIRST_CALL_FEATURES,
        kernel_sizes=((3, 3, 3),) * depth,
        strides=((1, 1, 1),) + ((2, 2, 2),) * (depth - 1),
    )
    runner = TorchTileRunner(build_network(topology), torch.device("cpu"))
    tiles = torch.ones((1, 1, *FIRST_CALL_TILE))
    before = process_rss_bytes()
    for _ in range(CALLS):
        runner(tiles)
    return {"first_call_bytes": int(process_rss_bytes() - before)}


def _written_buffers(request: dict):
    """The sliding window's buffers over one tile-sized image of ones, every page written (so that the calls' RSS
    is theirs alone), the tile's region and the mirror variants."""
    import torch

    from autoseg.model.tile_buffers import allocate_buffers
    from autoseg.model.tiles import patch_as_zyx, tile_layout
    from autoseg.model.tta import mirror_variants
    from autoseg.model.window import SlidingWindow

    tile = tuple(int(t) for t in request["tile"])
    layout = tile_layout(patch_as_zyx(tile), tile)
    window = SlidingWindow(
        tile,
        int(request["num_outputs"]),
        accumulator_device="cpu",
        accumulator_dtype=request["accumulator_dtype"],
        use_gaussian=False,
    )
    image = torch.ones((int(request["in_channels"]), *layout.padded_shape_zyx))  # ones: its pages are resident
    buffers = allocate_buffers(image, layout, window, torch.device("cpu"), on_slab=_discard)
    for held in (buffers.accumulator, buffers.weight_map, buffers.gaussian):
        held.fill_(1.0)
    variants = mirror_variants(tuple(int(a) for a in request["mirror_axes"]), request["tta"])
    return buffers, layout.regions()[0], variants


def _discard(z_start: int, z_stop: int, probabilities) -> None:
    """A ``SlabSink`` that keeps nothing (no slab is finished here)."""


class _NotAsked:
    """The measured runner's source of working bytes: the measurement is what answers them."""

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]):
        raise RuntimeError("the runtime probe's runner is not asked for its working bytes")


def main(argv: list[str]) -> int:
    """Measure the request in the JSON file ``argv[0]`` (or, after ``--torch-first-call``, torch's first call with
    ``argv[1]`` threads); print the figures as one JSON line."""
    try:
        if argv[0] == "--torch-first-call":
            figures = measure_torch_first_call(int(argv[1]))
        else:
            figures = measure(json.loads(Path(argv[0]).read_text()))
    except Exception as e:  # the runtime's own failure: its message goes to the parent
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
