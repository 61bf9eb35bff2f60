"""One training run's parts: what it trains (``FoldJob``, fixed) and the run in progress (``TrainingRun``: the step,
the configuration in force, the ``TrainingProgress``, the first steps' memory check)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from autoseg.core.workspace import Workspace
from autoseg.data.loader import BatchLoader
from autoseg.model.distributed import Ranks
from autoseg.model.step import TrainStep
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.training_data import loader_config
from autoseg.preprocess.plan_fields import model_input_fields
from autoseg.train.checkpoint import loader_seed, save_checkpoint
from autoseg.train.memory_check import MemoryObserver, configured_step
from autoseg.train.memory_report import MemoryCheck, log_check
from autoseg.train.progress import TrainingProgress
from autoseg.train.run_config import RunConfig
from autoseg.train.run_record import DataRecord, EffectiveConfiguration, RunRecord
from autoseg.train.schedule import PredictionTiming, TimeBudget
from autoseg.train.tracking import Tracking

log = logging.getLogger("autoseg.train.trainer")


@dataclass(frozen=True)
class FoldJob:
    """What one run trains, fixed for the run: the plan, the fold's cases, where it writes, the run's knobs."""

    workspace: Workspace
    plans: Plans
    planned: ConfigurationPlan  # as in plans.json
    config_name: str
    fold: int | str
    train_ids: list[str]
    val_ids: list[str]
    out: Path
    run: RunConfig
    show_progress: bool  # progress bars
    clock: Callable[[], float]
    started: float  # clock() when train() was called
    previous_folder: Path | None  # a cascade stage's previous-stage label maps (autoseg.train.fold_data)

    @property
    def data_folder(self) -> Path:
        return self.workspace.preprocessed(self.planned.data_configuration)


@dataclass
class TrainingRun:
    """One run in progress. Set once by the trainer's setup: ``job``, ``step``, ``data``, ``budget``, ``probe``.
    Replaced as the run goes on, and only these: ``config``, ``progress``, ``watch``."""

    job: FoldJob
    step: TrainStep  # one for the run: its network, optimizer and grad scaler change in place at every step
    data: DataRecord  # loader workers, precomputed copies
    budget: TimeBudget | None  # measures the run's speed in place (None: no --time-budget, or a resumed run)
    config: ConfigurationPlan  # this rank's step: a degradation replaces it (accumulation, checkpointing)
    progress: TrainingProgress  # a frozen value: replaced after each epoch, budget plan, degradation, memory check
    watch: MemoryObserver | None = None  # the memory check of ``config``'s first steps; None once it reported
    probe: PredictionTiming | None = None  # times the final validation's prediction for ``budget`` (rank 0)
    tracking: Tracking | None = None  # --track's trackers (rank 0; ``autoseg.train.tracking``), set by the trainer

    @property
    def ranks(self) -> Ranks:
        return self.step.ranks

    def loader(self, epoch: int, augment: bool) -> BatchLoader:
        """Training batches (augmented, in ``loader_workers`` processes) or validation batches (in-process).
        Each rank draws its own stream from all training cases (see docs/architecture.md, Multi-GPU)."""
        job = self.job
        generation = len(self.progress.degradations)
        seed = loader_seed(job.run.seed, epoch, 0 if augment else 1, generation, self.ranks.context.rank)
        cfg = loader_config(
            self.config, augment, self.data.use_precomputed and augment, job.plans.previous_stage_values(job.planned)
        )
        return BatchLoader(
            job.data_folder,
            job.train_ids if augment else job.val_ids,
            cfg,
            seed=seed,
            num_workers=self.data.loader_workers if augment else 0,
            queue_depth=self.config.loader_queue_depth,
            pin_memory=self.step.device.type == "cuda",
            previous_folder=job.previous_folder,
        )

    def save(self, which: str) -> None:
        """``checkpoint_{which}.pt`` of the progress so far. Rank 0 writes; the other ranks hold the same weights
        (gradients are averaged)."""
        if not self.ranks.is_main:
            return
        job = self.job
        path = job.workspace.checkpoint(job.config_name, job.fold, which)
        model_input = model_input_fields(job.plans, job.config_name)
        save_checkpoint(path, self.step, job.planned, job.config_name, self.progress, model_input)

    def watch_memory(self) -> None:
        """Watch the first steps of the configuration in force (``observe_memory``)."""
        self.watch = observe_memory(self.config, self.step, self.job)

    def record_check(self, check: MemoryCheck) -> None:
        """The check's result into the progress (rank 0's) and the steps after it out of the observer."""
        if self.ranks.is_main:
            self.progress = self.progress.with_memory_check(check.to_dict())
        self.watch = None

    def record(self) -> RunRecord:
        """run.json's record of the run as it ended (the final validation is added by the trainer)."""
        config = self.config
        effective = EffectiveConfiguration(config.batch_size, config.accumulation_steps, config.checkpointing)
        return RunRecord.of(self.job.run, self.job.fold, self.job.config_name, self.progress, effective, self.data)


def make_step(config: ConfigurationPlan, run: RunConfig, plans: Plans) -> TrainStep:
    """The plan's training step on the run's device; the plan's precision on CUDA, fp32 on CPU."""
    return configured_step(config, torch.device(run.device), run.optimizer, plans.label_scheme)


def observe_memory(config: ConfigurationPlan, step: TrainStep, job: FoldJob) -> MemoryObserver:
    """The memory model checked over ``config``'s first steps (``memory_check``): a log line, a warning when off.
    Every rank measures its own device; rank 0's checks go to the progress (``TrainingRun.record_check``)."""
    return MemoryObserver(config, step.device, job.run.optimizer, job.plans.label_scheme, log_check)
