"""Training memory for any (batch, patch) in microseconds, from a few simulations.

For a fixed network, precision and optimizer, a training step runs the same operators in the same order
for every patch and every batch size >= 2 (batch 1 takes a slightly different path). Every tensor's size
is then ``a + b * B + c * B * V`` bytes, ``B`` the batch and ``V`` the patch's voxel count: ``c`` for
feature maps, ``b`` for per-sample statistics (instance norm, Dice sums), ``a`` for weights and scalars.
So is the live-bytes total after every event of the step, and the peak for any ``(B, V)`` is the largest
of those lines there. ``TrainingMemoryModel`` records the timeline at 2 (batch 1) or 3 (batch >= 2)
points and solves for ``a, b, c`` per event; a line through two *peaks* would not do (the peak moves
between events as the patch grows). If the timelines of the fitting points do not line up event for
event, the model falls back to simulating each query.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from autoseg.memory.device import predict_device_peak
from autoseg.memory.glibc_heap import HeapFootprint, heap_footprint
from autoseg.memory.step_record import CATEGORIES, StepConfig, StepRecord, TrainingMemory, check_step_arguments
from autoseg.memory.training import record_training_step
from autoseg.model.topology import NetworkTopology


@dataclass(frozen=True)
class _Lines:
    """Per timeline row (candidate peaks only) and category: value = a + b * B + c * B * V bytes."""

    coef: np.ndarray  # (3, R, K) float64: a, b, c
    total: np.ndarray  # (3, R) the same summed over categories
    rows: np.ndarray  # (R,) the rows of the full timeline these are
    record: StepRecord  # one of the fitting records (phases, live counts)
    stage_coef: dict[str, tuple[float, float, float]]
    conv_coef: tuple[float, float, float]
    start_coef: tuple[float, float, float]  # the live bytes at the step's start
    # CPU steps: every event's bytes (3, T), canonical order, and its storage (T,), to replay glibc's heap over
    event_coef: np.ndarray | None = None
    event_storage: np.ndarray | None = None


def _solve(points: list[tuple[int, int]], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coefficients ``a, b, c`` of ``a + b B + c B V`` through the (B, V) points. Two points share B = 1
    (then b = 0); three points are (2, V1), (2, V2), (3, V1)."""
    if len(points) == 2:
        (_, v1), (_, v2) = points
        c = (values[1] - values[0]) / (v2 - v1)
        return values[0] - c * v1, np.zeros_like(c), c
    (b1, v1), (_, v2), (b3, _) = points
    c = (values[1] - values[0]) / (b1 * (v2 - v1))
    b = (values[2] - values[0]) / (b3 - b1) - c * v1
    return values[0] - b1 * b - b1 * c * v1, b, c


def _canonical_order(signature: np.ndarray) -> np.ndarray:
    """The order of the events with each run of consecutive frees sorted by storage number.

    Within such a run the order can differ from run to run (torch frees some groups, e.g. the autocast
    weight cache, in hash-map order); live bytes only fall inside it, so its order cannot move a peak (nor
    glibc's: a run of frees leaves the same free chunks in any order).
    """
    is_free = signature[:, 1] < 0
    run = np.cumsum(~is_free)
    return np.lexsort((signature[:, 0], is_free, run))


def _canonical(signature: np.ndarray) -> np.ndarray:
    return signature[_canonical_order(signature)]


def _aligned(records: list[StepRecord]) -> bool:
    first = _canonical(records[0].signature)
    return all(r.signature.shape == first.shape and np.array_equal(_canonical(r.signature), first) for r in records[1:])


def _candidate_rows(signature: np.ndarray) -> np.ndarray:
    """Rows that can hold the peak: the last one, and those right before a run of frees (allocations
    only add bytes)."""
    is_free = signature[:, 1] < 0
    starts_run = is_free & ~np.concatenate([[False], is_free[:-1]])
    return np.flatnonzero(np.append(starts_run, True))


def _fit(records: list[StepRecord], points: list[tuple[int, int]]) -> _Lines:
    ref = records[0]
    rows = _candidate_rows(ref.signature)
    a, b, c = _solve(points, [r.timeline[rows].astype(np.float64) for r in records])
    coef = np.stack([a, b, c])
    stage_coef = {}
    for name in ref.stage_bytes:
        sa, sb, sc = _solve(points, [np.array(float(r.stage_bytes.get(name, 0))) for r in records])
        stage_coef[name] = (float(sa), float(sb), float(sc))
    ca, cb, cc = _solve(points, [np.array(float(r.largest_conv_output_bytes)) for r in records])
    ta, tb, tc = _solve(points, [np.array(float(r.timeline[0].sum())) for r in records])
    event_coef = event_storage = None
    if ref.heap is not None:
        orders = [_canonical_order(r.signature) for r in records]
        event_coef = np.stack(
            _solve(
                points, [np.diff(r.timeline.sum(axis=1))[order].astype(np.float64) for r, order in zip(records, orders)]
            )
        )
        event_storage = ref.signature[orders[0], 0]
    return _Lines(
        coef=coef,
        total=coef.sum(axis=2),
        rows=rows,
        record=ref,
        stage_coef=stage_coef,
        conv_coef=(float(ca), float(cb), float(cc)),
        start_coef=(float(ta), float(tb), float(tc)),
        event_coef=event_coef,
        event_storage=event_storage,
    )


class TrainingMemoryModel:
    """Predicts ``simulate_training_step`` for one network, precision, optimizer and checkpointing setting
    at any batch size and patch, after 2 (batch 1) or 3 (batch >= 2) simulations made on first use.

    ``predict`` returns the full ``TrainingMemory`` (for a CPU step with glibc's heap replayed over the step's
    events at their sizes there: 10-60 ms, once per batch and patch); ``peak_bytes`` only the tensor peak (a few
    microseconds).
    ``simulations`` counts the simulations run so far; ``fallback`` is True for a batch regime whose
    fitting timelines did not line up (then every query is simulated).
    """

    def __init__(
        self,
        topology: NetworkTopology,
        *,
        precision: str = "fp32",
        checkpointing: bool = False,
        optimizer: str = "sgd",
        accumulation_steps: int = 1,
        device: str = "cpu",
    ) -> None:
        self.divisor = topology.patch_divisor()
        check_step_arguments(topology, 1, tuple(2 * d for d in self.divisor), precision, optimizer, accumulation_steps)
        self.topology = topology
        self.precision = precision
        self.checkpointing = checkpointing
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.device = device  # StepConfig.device
        self.simulations = 0
        self.fallback: dict[bool, bool] = {}
        self._lines: dict[bool, _Lines | None] = {}  # key: batch_size == 1
        self._simulated: dict[tuple[int, tuple[int, ...]], TrainingMemory] = {}  # predict_or_simulate's steps
        self._heaps: dict[tuple[int, int], HeapFootprint] = {}  # CPU: predict's heap replays by (batch, voxels)

    def _config(self, batch_size: int, patch_size: tuple[int, ...]) -> StepConfig:
        return StepConfig(
            self.topology,
            batch_size,
            tuple(patch_size),
            self.precision,
            self.checkpointing,
            self.optimizer,
            self.accumulation_steps,
            device=self.device,
        )

    def _lines_for(self, batch_size: int) -> _Lines | None:
        single = batch_size == 1
        if single not in self._lines:
            patches = [tuple(2 * d for d in self.divisor), tuple(3 * d for d in self.divisor)]
            shapes = (
                [(1, patches[0]), (1, patches[1])] if single else [(2, patches[0]), (2, patches[1]), (3, patches[0])]
            )
            records = [record_training_step(self._config(b, p)) for b, p in shapes]
            self.simulations += len(records)
            self.fallback[single] = not _aligned(records)
            points = [(b, math.prod(p)) for b, p in shapes]
            self._lines[single] = None if self.fallback[single] else _fit(records, points)
        return self._lines[single]

    def is_fitted(self, batch_size: int) -> bool:
        """Whether the lines for ``batch_size`` exist, so that ``predict`` costs no simulation."""
        return self._lines.get(batch_size == 1) is not None

    def predict_or_simulate(self, batch_size: int, patch_size: tuple[int, ...]) -> TrainingMemory:
        """``predict`` from fitted lines if they exist, else one simulation of just this step (a third of
        what fitting costs: the planner's CPU plans check one chosen step and need no lines)."""
        if self.is_fitted(batch_size):
            return self.predict(batch_size, patch_size)
        key = (batch_size, tuple(patch_size))
        if key not in self._simulated:
            self.simulations += 1
            self._simulated[key] = record_training_step(self._config(batch_size, patch_size)).peak()
        return self._simulated[key]

    def peak_bytes(self, batch_size: int, patch_size: tuple[int, ...]) -> int:
        """Peak live tensor bytes of one training step (as ``simulate_training_step(...).peak_bytes``)."""
        check_step_arguments(
            self.topology, batch_size, tuple(patch_size), self.precision, self.optimizer, self.accumulation_steps
        )
        lines = self._lines_for(batch_size)
        if lines is None:
            return self.predict(batch_size, patch_size).peak_bytes
        return sum(self._terms(lines, batch_size, math.prod(patch_size))[1])

    @staticmethod
    def _terms(lines: _Lines, batch_size: int, voxels: int) -> tuple[int, list[int]]:
        """The peak's index into ``lines.rows`` for (batch, voxels), and its bytes per category."""
        a, b, c = lines.total
        i = int(np.argmax(a + batch_size * b + (batch_size * voxels) * c))
        a, b, c = lines.coef[:, i]
        return i, [int(round(v)) for v in a + batch_size * b + batch_size * voxels * c]

    def predict(self, batch_size: int, patch_size: tuple[int, ...]) -> TrainingMemory:
        """``simulate_training_step``'s result for (batch, patch), from the fitted lines."""
        cfg = self._config(batch_size, patch_size)  # validates the arguments
        lines = self._lines_for(batch_size)
        if lines is None:
            self.simulations += 1
            return record_training_step(cfg).peak()
        voxels = math.prod(cfg.patch_size)
        i, terms = self._terms(lines, batch_size, voxels)
        named = dict(zip(CATEGORIES, terms))

        def at(coef: tuple[float, float, float]) -> int:
            return int(round(coef[0] + batch_size * coef[1] + batch_size * voxels * coef[2]))

        row = int(lines.rows[i])
        memory = TrainingMemory(
            peak_bytes=sum(terms),
            parameter_bytes=named["parameters"],
            gradient_bytes=named["gradients"],
            optimizer_state_bytes=named["optimizer_state"],
            batch_bytes=named["batch"],
            activation_bytes=named["activations"],
            stage_activation_bytes={k: at(v) for k, v in lines.stage_coef.items()},
            largest_conv_output_bytes=at(lines.conv_coef),
            live_allocations_at_peak=int(lines.record.live_count[row]),
            peak_phase=lines.record.phase_at(row),
        )
        if lines.event_coef is None:
            return memory
        key = (batch_size, voxels)
        if key not in self._heaps:  # glibc's heap over the step's events at their sizes here (10-60 ms)
            a, b, c = lines.event_coef
            sizes = np.rint(a + batch_size * b + batch_size * voxels * c).astype(np.int64)
            self._heaps[key] = heap_footprint(lines.event_storage, sizes)
        heap = self._heaps[key]
        return replace(
            memory,
            heap_retained_bytes=heap.retained_bytes(memory.peak_bytes - at(lines.start_coef)),
            mapped_bytes_per_step=heap.mapped_bytes_per_step,
        )


@functools.lru_cache(maxsize=64)
def training_memory_model(
    topology: NetworkTopology,
    precision: str = "fp32",
    checkpointing: bool = False,
    optimizer: str = "sgd",
    accumulation_steps: int = 1,
    device: str = "cpu",
) -> TrainingMemoryModel:
    """A shared ``TrainingMemoryModel`` per setting (so a planner's search simulates each setting once)."""
    return TrainingMemoryModel(
        topology,
        precision=precision,
        checkpointing=checkpointing,
        optimizer=optimizer,
        accumulation_steps=accumulation_steps,
        device=device,
    )


def predicted_training_bytes(
    topology: NetworkTopology,
    batch_size: int,
    patch_size: tuple[int, ...],
    precision: str = "fp32",
    checkpointing: bool = False,
    device: str = "cuda",
    accumulation_steps: int = 1,
) -> int:
    """Predicted device bytes of one training step (tensors + the ``device`` terms of
    ``predict_device_peak``); the first five arguments are the planner's ``peak_fn``'s. With
    ``accumulation_steps > 1`` the gradients of earlier micro-batches are held during the later ones."""
    model = training_memory_model(topology, precision, checkpointing, "sgd", accumulation_steps, device)
    return predict_device_peak(model.predict(batch_size, tuple(patch_size)), device)["total"]
