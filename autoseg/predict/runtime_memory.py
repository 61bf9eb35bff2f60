"""A graph runtime's working bytes for the memory plan (``TileBatchBytes``), measured once in a fresh process that
runs the real call (``autoseg.predict.runtime_probe``) and kept per machine and model (``MachineCache``).

The torch runner's figures are simulated (``autoseg.memory.inference.TileSimulation``): every tensor torch allocates
passes the tracker. ONNX Runtime and OpenVINO allocate in their own arenas, with their own kernels' scratch, so
their figures are read from a process's RSS instead. ``RuntimeWorkingBytes.working_bytes(batch, tile)`` answers, in
the torch runner's convention (``TileBatchBytes``):

- ``parameter_bytes``: the RSS the graph's bytes and its compiled model add to a process that has imported torch,
  autoseg and the runtime (the prediction's own process holds them once its runners are built);
- ``tile_bytes``: the peak RSS of the sliding window's ``run_tile_batch`` over ``batch`` items of ``tile`` (the
  window's mirror variants) above the RSS before the first call, its buffers (padded input, accumulator, weight
  map, Gaussian) already written: the tile batch, the runtime's activations and arena, the logits and their
  flipped copies, and what glibc's heap keeps, which is the torch runner's ``tile_bytes + heap_retained_bytes``
  (``heap_retained_bytes`` is 0 here: it is inside the measured figure);
- ``held_bytes``: of that, what the runtime still holds after the call (each fold of an ensemble its own,
  ``inference_memory`` adds them); the CUDA terms are 0 (these runtimes run on the CPU).

The rule that keeps the children few: a fresh process measures one batch of one tile (a runtime that ran one batch
size holds or reuses its buffers for the next, so two in one process are off by up to 40%); the memory plan asks
batch 1, and batch 2 only where ``cpu_tile_batch_cap`` allows more than one tile (tiles of at most 51,200 voxels:
a child of a few seconds), and a larger batch is extended linearly from those two (its error against fresh
processes: docs/memory.md, "Graph runtimes"). A figure is kept under a key of the graph's structure (its sha256
with the weights' values left out: the folds of a configuration share one measurement), the runtime and its
version, the precision, the threads, the tile and batch, the window's items (mirror variants, accumulator), the
machine (``machine_key``) and a digest of the code that measures, and read from the cache ever after (and from
memory within a run).

A measurement that fails is an error (``RunError`` naming the runtime, the tile and the child's message), not a
fallback to the torch simulation: that figure is the one this measurement replaces (a tile batch of ONNX Runtime
held 2.6x what torch's simulation counts, docs/memory.md), and a child that cannot compile the graph or run one tile
batch foretells the prediction's own failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import autoseg
from autoseg.core.errors import RunError
from autoseg.core.extras import require
from autoseg.core.machine import MachineCache, kept_simulations, machine_key, source_digest
from autoseg.core.units import MiB
from autoseg.memory.inference import TileSimulation
from autoseg.model.tile_runner import TileBatchBytes

log = logging.getLogger("autoseg")

CACHE_NAME = "runtime_working_bytes"  # <cache folder>/runtime_working_bytes.json
FIRST_CALL_CACHE_NAME = "torch_first_call_bytes"
_FIRST_CALLS: dict[str, int] = {}  # this process's: key -> bytes
KEPT = 256  # (graph, runtime, precision, threads, tile, batch) measurements kept
PROBE_MODULE = "autoseg.predict.runtime_probe"
PROBE_TIMEOUT_S = 900  # a child compiles the graph and runs 3 calls of a tile batch
_MEASURING_MODULES = (
    PROBE_MODULE,
    "autoseg.model.graph_runners",
    "autoseg.model.onnx_graph",
    "autoseg.model.sliding_window",
    "autoseg.model.tile_buffers",
)
_WEIGHT_TYPES = (1, 10, 11, 16)  # ONNX TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16: values left out of the key


@dataclass(frozen=True, eq=False)
class RuntimeWorkingBytes:
    """The ``WorkingBytesSource`` of ``graph`` (ONNX bytes) run by ``runtime`` ("onnxruntime", "openvino") with
    ``threads`` threads, in the sliding window that ``window`` describes (its network, precision, mirror variants and
    accumulator: the torch simulation of the same window). ``cache``: where the measurements are kept (None: the
    command's, ``kept_simulations``; none there either: measured in every run)."""

    graph: bytes = field(repr=False)
    runtime: str
    threads: int
    window: TileSimulation
    cache: MachineCache | None = None
    _figures: dict[tuple[tuple[int, ...], int], dict] = field(default_factory=dict, init=False, repr=False)

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        """The bytes of a batch of ``tile_batch_size`` tiles of ``tile`` (module docstring), measured or kept."""
        tile = tuple(int(t) for t in tile)
        if tile_batch_size <= 2:
            return batch_bytes(self.figures(tile, tile_batch_size))
        return batch_bytes(self.figures(tile, 1), self.figures(tile, 2), tile_batch_size)

    def figures(self, tile: tuple[int, ...], batch: int) -> dict:
        """A child's figures for ``batch`` tiles of ``tile``: from this run's memory, else the cache, else measured."""
        if (tile, batch) in self._figures:
            return self._figures[tile, batch]
        cache = self.cache or kept_simulations()
        request = self.request(tile, batch)
        if cache is None:
            figures, where = measure_in_child(self.graph, request), "measured now (no cache folder)"
        else:
            key = {**self.key(), "tile": list(tile), "batch": batch}
            figures, where = cache.kept(CACHE_NAME, key, lambda: measure_in_child(self.graph, request), KEPT)
        log.info(
            "%s %s working bytes of %d tile(s) of %s: compiled graph %.0f MiB, tile batch %.0f MiB (%s)",
            self.runtime,
            self.window.precision,
            batch,
            "x".join(map(str, tile)),
            figures["parameter_bytes"] / MiB,
            figures["tile_bytes"] / MiB,
            where,
        )
        self._figures[tile, batch] = figures
        return figures

    def request(self, tile: tuple[int, ...], batch: int) -> dict[str, Any]:
        """What the child measures (``autoseg.predict.runtime_probe.measure``), but the graph's path."""
        return {**self._setting(), "tile": list(tile), "batch": int(batch)}

    def key(self) -> dict[str, Any]:
        """What a kept measurement depends on besides its tile and batch (module docstring)."""
        return {
            **self._setting(),
            "graph_structure": graph_structure_digest(self.graph),
            "runtime_version": runtime_version(self.runtime),
            "machine": machine_key(),
            "code": source_digest(_MEASURING_MODULES),
        }

    def _setting(self) -> dict[str, Any]:
        """The runtime's and the window's settings that a measurement runs with."""
        return {
            "runtime": self.runtime,
            "precision": self.window.precision,
            "threads": int(self.threads),
            "in_channels": self.window.topology.in_channels,
            "num_outputs": self.window.topology.num_outputs,
            "mirror_axes": list(self.window.mirror_axes),
            "tta": self.window.tta,
            "accumulator_dtype": self.window.accumulator_dtype,
        }


def batch_bytes(figures: dict, second: dict | None = None, tile_batch_size: int = 0) -> TileBatchBytes:
    """``TileBatchBytes`` from a child's ``figures``; with ``second`` (batch 2's, ``figures`` batch 1's), those of
    ``tile_batch_size`` extended linearly from the two."""

    def at(name: str) -> int:
        if second is None:
            return int(figures[name])
        one, two = int(figures[name]), int(second[name])
        return one + (tile_batch_size - 1) * max(two - one, 0)

    return TileBatchBytes(
        parameter_bytes=int(figures["parameter_bytes"]),
        tile_bytes=at("tile_bytes"),
        largest_conv_output_bytes=0,
        live_allocations_at_peak=0,
        heap_retained_bytes=0,
        held_bytes=min(at("held_bytes"), at("tile_bytes")),
    )


def graph_structure_digest(graph: bytes) -> str:
    """The sha256 of ``graph`` with its floating-point weights' values left out (their names, types and shapes kept):
    the same for every fold of a configuration, whose memory does not depend on the values."""
    onnx = require("onnx", "onnx", "keying a graph runtime's measured memory")
    model = onnx.load_from_string(graph)
    for weights in model.graph.initializer:
        if weights.data_type in _WEIGHT_TYPES:
            weights.ClearField("raw_data")
            weights.ClearField("float_data")
            weights.ClearField("double_data")
            weights.ClearField("int32_data")  # float16 and bfloat16 values, when not raw
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]


def runtime_version(runtime: str) -> str:
    """The installed version of ``runtime``'s package (its metadata; "" when it is not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(runtime)
    except importlib.metadata.PackageNotFoundError:
        return ""


def measure_in_child(graph: bytes, request: dict[str, Any]) -> dict:
    """The figures of ``autoseg.predict.runtime_probe`` for ``request`` with ``graph``, measured in a fresh Python
    process (this interpreter, this autoseg); a ``RunError`` naming the runtime when it fails or times out."""
    tile = "x".join(map(str, request["tile"]))
    what = f"{request['runtime']} ({request['precision']}) on {request['batch']} tile(s) of {tile}"
    with tempfile.TemporaryDirectory(prefix="autoseg-runtime-memory-") as folder:
        graph_path, request_path = Path(folder) / "graph.onnx", Path(folder) / "request.json"
        graph_path.write_bytes(graph)
        request_path.write_text(json.dumps({**request, "graph_path": str(graph_path)}))
        command = [sys.executable, "-m", PROBE_MODULE, str(request_path)]
        return probe_figures(command, request["runtime"], f"the memory of {what}", "predict with --runtime torch")


def probe_figures(command: list[str], who: str, what: str, advice: str) -> dict:
    """The one JSON line of figures the probe ``command`` prints, run in a fresh process; a ``RunError`` saying that
    ``who`` failed measuring ``what`` (the child's last lines), or that it took longer than ``PROBE_TIMEOUT_S``,
    with ``advice``."""
    try:
        done = run_probe(command, dict(os.environ), PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RunError(
            f"measuring {what} took more than {PROBE_TIMEOUT_S} s in a fresh process; {advice}, or on a less busy "
            "machine"
        ) from e
    if done.returncode != 0:
        message = " | ".join((done.stderr or "").strip().splitlines()[-3:]) or "no message"
        raise RunError(
            f"{who} failed measuring {what} in a fresh process (exit code {done.returncode}): {message}; {advice}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_first_call_bytes(threads: int, cache: MachineCache | None = None) -> int:
    """What a process's first CPU forward through torch adds to its RSS whatever the network: torch's and oneDNN's
    kernels paged in, OpenMP's threads, oneDNN's global state (82 MiB here with 1 or 2 threads). The torch
    simulation counts tensors only, and the pipeline plans from the RSS before any forward, so this is planned on
    top (``autoseg.predict.pipeline.case_memory``). Measured once per machine, threads and code in a fresh process
    (``runtime_probe --torch-first-call``) and kept in ``cache`` (None: the command's, ``kept_simulations``)."""
    cache = cache or kept_simulations()
    code = source_digest((PROBE_MODULE, "autoseg.model.torch_runner", "autoseg.model.cpu_conv"))
    key = {"threads": int(threads), "machine": machine_key(), "code": code}
    memo = json.dumps(key, sort_keys=True)
    if memo in _FIRST_CALLS:  # measured or read once a process
        return _FIRST_CALLS[memo]

    def measure() -> dict:
        command = [sys.executable, "-m", PROBE_MODULE, "--torch-first-call", str(int(threads))]
        advice = f"run `{' '.join(command[1:])}` to see torch's own message"
        return probe_figures(command, "torch", "the RSS of its first CPU forward", advice)

    if cache is None:
        figures, where = measure(), "measured now (no cache folder)"
    else:
        figures, where = cache.kept(FIRST_CALL_CACHE_NAME, key, measure)
    log.info("torch's first CPU forward adds %.0f MiB to a process (%s)", figures["first_call_bytes"] / MiB, where)
    _FIRST_CALLS[memo] = int(figures["first_call_bytes"])
    return _FIRST_CALLS[memo]


def run_probe(command: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run the child ``command`` with ``env``, its output captured as text, killed after ``timeout_s``. It runs in
    the folder that holds this autoseg package: ``python -m`` imports from the working folder first, which may
    hold another autoseg."""
    root = Path(autoseg.__file__).resolve().parent.parent
    return subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=timeout_s, check=False)
