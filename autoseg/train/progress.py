"""The trainer's progress as one artifact: where a run is, what it measured and what it decided.

``TrainingProgress`` holds the last finished epoch, the schedule in force (epochs, iterations per epoch, optimizer
steps done), the metrics rows, the EMA and best pseudo-Dice, the out-of-memory degradations, the time budget's
decisions, the memory checks and the number of processes; in a checkpoint also the state of every random
generator the trainer touches (``RngStates``). It is a frozen value: the trainer replaces it as the run goes on
(its ``with_*`` methods), ``autoseg.train.checkpoint`` writes it whole into every checkpoint (``to_text``) and
``autoseg.train.run_record`` takes run.json's schedule, degradations, time budget and memory checks from it.

``from_checkpoint`` reads it back from a checkpoint's dict. Damaged JSON, an unknown key or another
``schema_version`` is an ``ArtifactError`` naming the checkpoint. A checkpoint written before the progress was one
artifact keeps it under separate keys (``epoch``, ``schedule``, ``ema_dice``, ``metrics_json``, ``rng``, ...);
``_progress_of_separate_keys`` reads those, so such a checkpoint resumes.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoseg.core.artifacts import Artifact, ArtifactError, to_dict

__all__ = ["PROGRESS_KEY", "EpochPlan", "RngStates", "Schedule", "TrainingProgress"]

PROGRESS_KEY = "progress"  # a checkpoint's key for ``TrainingProgress.to_text()``


@dataclass(frozen=True)
class EpochPlan:
    """The epochs of a run and the optimizer steps in each (a time budget may change both as the run goes)."""

    epochs: int
    iterations_per_epoch: int


@dataclass(frozen=True)
class Schedule:
    """The plan in force and the optimizer steps run before the current epoch: under a time budget epochs differ in
    length, so the learning rate's position (``poly_lr``) is counted in steps, not epochs."""

    epochs: int
    iterations_per_epoch: int
    steps_done: int = 0

    @property
    def plan(self) -> EpochPlan:
        return EpochPlan(self.epochs, self.iterations_per_epoch)


def _bytes_text(state: torch.Tensor) -> str:
    """A generator state (a uint8 tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


@dataclass(frozen=True)
class RngStates:
    """The state of every global generator the trainer touches, as JSON values: restored, they continue bit for bit.
    The loaders need none: their seeds derive from the run seed, the epoch and the rank (``checkpoint.loader_seed``)."""

    torch_cpu: str  # torch.get_rng_state(), base64
    torch_cuda: tuple[str, ...]  # torch.cuda.get_rng_state_all(), base64 each; empty without CUDA
    numpy_global: tuple[str, tuple[int, ...], int, int, float]  # np.random.get_state(): MT19937 keys, pos, gauss
    python_random: tuple[int, tuple[int, ...], float | None]  # random.getstate()

    @classmethod
    def capture(cls) -> RngStates:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss = random.getstate()
        return cls(
            _bytes_text(torch.get_rng_state()),
            tuple(_bytes_text(s) for s in torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else (),
            (name, tuple(int(k) for k in keys), int(pos), int(has_gauss), float(cached)),
            (version, tuple(internal), gauss),
        )

    def restore(self) -> None:
        torch.set_rng_state(_bytes_tensor(self.torch_cpu))
        if self.torch_cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in self.torch_cuda])
        name, keys, pos, has_gauss, cached = self.numpy_global
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        version, internal, gauss = self.python_random
        random.setstate((version, tuple(internal), gauss))


@dataclass(frozen=True)
class TrainingProgress(Artifact):
    """A run's progress after its last finished ``epoch`` (-1 before the first). ``metrics``: metrics.jsonl's rows;
    ``degradations``: ``autoseg.train.degrade``'s records (this rank's micro-batches), in order; ``budget_decisions``:
    the time budget's (``BudgetDecision.to_dict``); ``memory_checks``: rank 0's (``MemoryCheck.to_dict``), one per
    process and configuration; ``world_size``: the processes that trained it (a resumed run must have as many);
    ``rng``: in a checkpoint, the generators' states when it was written (None while the run holds it); ``init``:
    the model its weights started from (``autoseg.train.init_weights.InitRecord``), applied once before the first
    step and never by a resume."""

    SCHEMA_VERSION = 1
    KIND = "training progress"

    epoch: int
    schedule: Schedule
    world_size: int = 1
    ema: float | None = None  # the pseudo-Dice's exponential moving average; None before the first epoch
    best_ema: float = -1.0  # the best ``ema`` so far (checkpoint_best.pt's)
    metrics: tuple[dict[str, Any], ...] = ()
    degradations: tuple[dict[str, Any], ...] = ()
    budget_decisions: tuple[dict[str, Any], ...] = ()
    memory_checks: tuple[dict[str, Any], ...] = ()
    rng: RngStates | None = None
    init: dict[str, Any] | None = None  # the weights it started from (``InitRecord``, --init-from); None: its own

    @classmethod
    def start(
        cls, epochs: int, iterations_per_epoch: int, world_size: int, init: dict[str, Any] | None = None
    ) -> TrainingProgress:
        """A run before its first epoch (``init``: the weights it starts from, None: its own initialisation)."""
        return cls(-1, Schedule(epochs, iterations_per_epoch), world_size, init=init)

    @property
    def next_epoch(self) -> int:
        return self.epoch + 1

    def with_epoch(self, epoch: int, row: dict[str, Any] | None, ema: float | None, steps: int) -> TrainingProgress:
        """After ``epoch`` ran ``steps`` optimizer steps: its metrics ``row`` (rank 0's; None on the other ranks) and
        the pseudo-Dice's ``ema``; the best EMA follows."""
        best = self.best_ema if ema is None or not ema > self.best_ema else ema
        return replace(
            self,
            epoch=epoch,
            schedule=replace(self.schedule, steps_done=self.schedule.steps_done + steps),
            ema=ema,
            best_ema=best,
            metrics=self.metrics if row is None else (*self.metrics, row),
        )

    def with_plan(self, plan: tuple[int, int], decisions: tuple[dict[str, Any], ...]) -> TrainingProgress:
        """The time budget's plan (epochs, iterations per epoch) and its decisions so far."""
        epochs, iterations = plan
        schedule = replace(self.schedule, epochs=epochs, iterations_per_epoch=iterations)
        return replace(self, schedule=schedule, budget_decisions=decisions)

    def with_degradation(self, record: dict[str, Any]) -> TrainingProgress:
        return replace(self, degradations=(*self.degradations, record))

    def with_memory_check(self, check: dict[str, Any]) -> TrainingProgress:
        return replace(self, memory_checks=(*self.memory_checks, check))

    def to_text(self) -> str:
        """The JSON text a checkpoint stores (``schema_version`` first)."""
        return json.dumps({"schema_version": self.SCHEMA_VERSION, **to_dict(self)})

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: Path) -> TrainingProgress:
        """The progress in a checkpoint's dict (``path``: the file, named in errors)."""
        if PROGRESS_KEY not in state:
            return _progress_of_separate_keys(state, path)
        try:
            payload = json.loads(state[PROGRESS_KEY])
        except (TypeError, json.JSONDecodeError) as e:
            raise ArtifactError(
                f"{path}: its training progress is not valid JSON ({e}); resume from another checkpoint of the "
                "fold, or train it again without --resume"
            ) from e
        return cls.from_payload(payload, f"{path} (training progress)")


def _progress_of_separate_keys(state: dict[str, Any], path: Path) -> TrainingProgress:
    """The progress of a checkpoint that keeps it under separate keys. Those written before ``steps_done``,
    ``world_size`` or the memory checks lack them: the steps are then whole epochs, one process, no check."""
    try:
        epoch, schedule = int(state["epoch"]), state["schedule"]
        ipe = int(schedule["iterations_per_epoch"])
        rng = state["rng"]
        name, keys, pos, has_gauss, cached = rng["numpy"]
        version, internal, gauss = rng["python"]
        ema = float(state["ema_dice"])
        return TrainingProgress(
            epoch=epoch,
            schedule=Schedule(int(schedule["epochs"]), ipe, int(schedule.get("steps_done", (epoch + 1) * ipe))),
            world_size=int(state.get("world_size", 1)),
            ema=None if ema < 0 else ema,
            best_ema=float(state["best_ema_dice"]),
            metrics=tuple(json.loads(state["metrics_json"])),
            degradations=tuple(json.loads(state["degradations_json"])),
            budget_decisions=tuple(json.loads(state["time_budget_json"]) or ()),
            memory_checks=tuple(json.loads(state.get("memory_checks_json", "[]"))),
            rng=RngStates(
                _bytes_text(rng["torch"]),
                tuple(_bytes_text(s) for s in rng["torch_cuda"]),
                (name, tuple(int(k) for k in keys), int(pos), int(has_gauss), float(cached)),
                (int(version), tuple(int(v) for v in internal), gauss),
            ),
        )
    except (KeyError, TypeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ArtifactError(
            f"{path}: its training progress is incomplete or damaged ({type(e).__name__}: {e}); resume from "
            "another checkpoint of the fold, or train it again without --resume"
        ) from e
