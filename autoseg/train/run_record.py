"""run.json: what a finished run trained, how, and what it decided on the way (``RunRecord``).

Written by rank 0 when the last epoch's checkpoints are written, before the final validation, so that a command
killed during the validation finds the fold trained (``folds.fold_finished`` also wants the validation's
summary.json when the run validates). The schedule, degradations, time-budget decisions and memory checks are the
run's ``TrainingProgress``, the one record the checkpoints hold too. A run.json written before ``schema_version``
was added (no such key; ``run`` with the testing knobs ``stop_after_epochs`` and ``inject_oom_at_step``, both
unset in any real run) reads as version 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoseg.core.artifacts import Artifact
from autoseg.train.progress import EpochPlan, TrainingProgress
from autoseg.train.run_config import RunConfig

__all__ = ["DataRecord", "DistributedRecord", "EffectiveConfiguration", "FinalValidation", "RunRecord"]


@dataclass(frozen=True)
class FinalValidation:
    """The fold's final validation: its ``cases`` and ``tta`` (the ``--tta`` value); under a time budget its
    estimated seconds (else None) and whether the budget reduced it (fewer cases or less mirroring)."""

    cases: tuple[str, ...]
    tta: str
    estimated_seconds: float | None = None
    reduced_by_time_budget: bool = False


@dataclass(frozen=True)
class EffectiveConfiguration:
    """This rank's step after the degradations: micro-batch, accumulation steps, activation checkpointing."""

    batch_size: int
    accumulation_steps: int
    checkpointing: bool


@dataclass(frozen=True)
class DataRecord:
    """How the steps were fed: loader worker processes, and whether precomputed augmented copies were sampled."""

    loader_workers: int
    use_precomputed: bool


@dataclass(frozen=True)
class DistributedRecord:
    """Processes, and the global batch: processes x micro-batch x accumulation steps."""

    world_size: int
    global_batch: int


def _unversioned(payload: dict[str, Any]) -> dict[str, Any]:
    """A run.json without ``schema_version``: its ``run`` had two testing knobs, always None outside the tests."""
    run = {k: v for k, v in payload.get("run", {}).items() if k not in ("stop_after_epochs", "inject_oom_at_step")}
    return {**payload, "run": run, "schema_version": 1}


@dataclass(frozen=True)
class RunRecord(Artifact):
    """run.json (``schema_version`` 1): the run's knobs (``run``), its fold and configuration, the schedule it ended
    with, its degradations, time-budget decisions (``time_budget``) and memory checks, the configuration it ended on,
    its data pipeline, its processes, when the run validates its final validation, and the model its weights started
    from (``init``, ``autoseg train --init-from``)."""

    SCHEMA_VERSION = 1
    KIND = "run record"

    run: RunConfig
    fold: str
    config: str
    schedule: EpochPlan
    degradations: tuple[dict[str, Any], ...]
    time_budget: tuple[dict[str, Any], ...]
    effective_configuration: EffectiveConfiguration
    data: DataRecord
    distributed: DistributedRecord
    memory_checks: tuple[dict[str, Any], ...]
    final_validation: FinalValidation | None = None
    init: dict[str, Any] | None = None  # --init-from: the model it started from (``InitRecord``); None: its own

    @classmethod
    def of(
        cls,
        run: RunConfig,
        fold: int | str,
        config: str,
        progress: TrainingProgress,
        effective: EffectiveConfiguration,
        data: DataRecord,
    ) -> RunRecord:
        """The record of a run that ended with ``progress`` on ``effective``; ``dataclasses.replace`` adds the final
        validation."""
        world = progress.world_size
        return cls(
            run,
            str(fold),
            config,
            progress.schedule.plan,
            progress.degradations,
            progress.budget_decisions,
            effective,
            data,
            DistributedRecord(world, world * effective.batch_size * effective.accumulation_steps),
            progress.memory_checks,
            init=progress.init,
        )

    @classmethod
    def from_payload(cls, data: Any, where: str) -> RunRecord:
        if isinstance(data, dict) and "schema_version" not in data:
            data = _unversioned(data)
        return super().from_payload(data, where)
