"""Training one fold from the plan: a plain loop (SGD Nesterov, poly LR, Dice + CE with deep supervision).

Per epoch: ``iterations_per_epoch`` optimizer steps (each ``accumulation_steps`` micro-batches),
a pseudo-Dice on validation patches, one log line, metrics.jsonl, progress.png and an atomic
checkpoint (``autoseg.train.checkpoint``: enough to resume bit for bit). At the end the fold's validation
cases are predicted and evaluated.

Safety: an out-of-memory error in a step is never fatal; the step is retried with a degraded
configuration (``autoseg.train.degrade``), recorded in run.json and the checkpoints. ``time_budget_s`` sets
epochs, iterations per epoch and the final validation's cases and mirroring from measured speed
(``autoseg.train.schedule.TimeBudget``, timed by the run's ``clock``). The first steps of every run check the
memory model on this machine (``autoseg.train.memory_check``): one log line, run.json, a warning when off.

Distributed (torchrun, ``autoseg.model.distributed``): each rank takes its share of the planned global batch
(``rank_batch``) from its own loader stream; the loss's Dice sums and, after backward, the gradients are
summed over ranks; an out-of-memory error on any rank degrades every rank. Only rank 0 writes (train.log,
metrics, progress.png, checkpoints, run.json) and validates; its time-budget decisions are broadcast.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.artifacts import LogFile, atomic_write_text, remove_stale_temporaries
from autoseg.core.errors import InputError
from autoseg.core.machine import use_cpu_threads
from autoseg.core.resources import cpu_count
from autoseg.core.workspace import Workspace
from autoseg.data.loader import BatchLoader
from autoseg.dataset.labels import LabelScheme
from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext, Ranks, rank_batch
from autoseg.model.step import TrainStep, distribute
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.training_data import loader_config
from autoseg.preprocess.run import check_preprocessed
from autoseg.preprocess.store import open_case
from autoseg.train.checkpoint import check_same_plan, load_checkpoint, loader_seed, restore_rng_states, save_checkpoint
from autoseg.train.curves import record_epoch, run_times
from autoseg.train.data_pipeline import choose_data_pipeline
from autoseg.train.degrade import apply_degradations, choose_degradation, log_degradation
from autoseg.train.fold_data import fold_cases, prepare_previous_stage
from autoseg.train.memory_check import MemoryObserver, configured_step
from autoseg.train.memory_report import MemoryCheck, log_check
from autoseg.train.patch_validation import validate_patches
from autoseg.train.run_config import RunConfig
from autoseg.train.schedule import BudgetedRun, TimeBudget, poly_lr

__all__ = ["train"]

log = logging.getLogger("autoseg.train.trainer")


def train(
    workspace: Workspace,
    config_name: str,
    fold: int | str,
    run: RunConfig,
    progress: bool = True,
    distributed: DistributedContext = SINGLE_PROCESS,
    clock: Callable[[], float] = time.perf_counter,
) -> Path:
    """Train one fold; returns the fold's results folder. ``distributed``: this process's rank in a torchrun
    launch, its process group open (``autoseg.model.distributed.process_group``). ``clock``: seconds, what the
    time budget and the epoch times are measured with (tests pass a simulated one)."""
    started = clock()
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config = plans.configuration(config_name)
    check_preprocessed(workspace, plans, config_name, needs_dataset=run.validate)  # refused, not mixed
    train_ids, val_ids = fold_cases(workspace, config.data_configuration, fold)
    previous = prepare_previous_stage(workspace, plans, config_name, sorted({*train_ids, *val_ids}))  # cascade
    out = workspace.results(config_name, fold)
    resumed = None
    if run.resume:
        latest = workspace.checkpoint(config_name, fold, "latest")
        resumed = load_checkpoint(latest)
        check_same_plan(resumed, config, config_name, latest)
        if resumed["world_size"] != distributed.world_size:
            raise InputError(
                f"{latest} was trained on {resumed['world_size']} process(es), this run has "
                f"{distributed.world_size} (the micro-batches and data streams are per process); "
                f"resume with --gpus {resumed['world_size']}, or train again without --resume"
            )
    out.mkdir(parents=True, exist_ok=True)
    if distributed.is_main:
        for stale in remove_stale_temporaries(out) + remove_stale_temporaries(out / "validation"):  # killed writes
            log.info("removed %s, left by an interrupted run", stale)
    handler = LogFile(out / "train.log") if distributed.is_main else logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    threads = torch.get_num_threads()
    try:
        job = _Job(
            workspace,
            plans,
            config,
            config_name,
            fold,
            train_ids,
            val_ids,
            out,
            run,
            progress,
            clock,
            started,
            previous,
        )
        ctx = _setup(job, resumed, distributed)
        return _train(ctx)
    finally:
        torch.set_num_threads(threads)
        log.removeHandler(handler)
        handler.close()


@dataclass(frozen=True)
class _Job:
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
    progress: bool
    clock: Callable[[], float]
    started: float  # clock() when train() was called
    previous_folder: Path | None  # a cascade stage's previous-stage label maps (autoseg.train.fold_data)

    @property
    def data_folder(self) -> Path:
        return self.workspace.preprocessed(self.planned.data_configuration)


@dataclass
class _Context:
    """One run in progress: the job, the step, and the progress a checkpoint keeps."""

    job: _Job
    config: ConfigurationPlan  # the planned one after degradations
    step: TrainStep
    epochs: int
    iterations_per_epoch: int
    first_epoch: int = 0
    steps_done: int = 0  # optimizer steps before the current epoch (epochs may differ in length under a budget)
    metrics: list[dict] = field(default_factory=list)
    ema: float | None = None
    best_ema: float = -1.0
    degradations: list[dict[str, Any]] = field(default_factory=list)
    budget: TimeBudget | None = None
    budget_decisions: list[dict[str, Any]] = field(default_factory=list)
    loader_workers: int = 0
    use_precomputed: bool = False
    memory: MemoryObserver | None = None  # runs the steps; checks the memory model over the first ones
    memory_checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ranks(self) -> Ranks:
        return self.step.ranks

    def loader(self, epoch: int, augment: bool) -> BatchLoader:
        """Training batches (augmented, in ``loader_workers`` processes) or validation batches (in-process).
        Each rank draws its own stream from all training cases (see docs/architecture.md, Multi-GPU)."""
        job = self.job
        seed = loader_seed(job.run.seed, epoch, 0 if augment else 1, len(self.degradations), self.ranks.context.rank)
        cfg = loader_config(
            self.config, augment, self.use_precomputed and augment, job.plans.previous_stage_values(job.planned)
        )
        return BatchLoader(
            job.data_folder,
            job.train_ids if augment else job.val_ids,
            cfg,
            seed=seed,
            num_workers=self.loader_workers if augment else 0,
            queue_depth=self.config.loader_queue_depth,
            pin_memory=self.step.device.type == "cuda",
            previous_folder=job.previous_folder,
        )

    def progress_state(self, epoch: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "schedule": {
                "epochs": self.epochs,
                "iterations_per_epoch": self.iterations_per_epoch,
                "steps_done": self.steps_done,
            },
            "ema": self.ema,
            "best_ema": self.best_ema,
            "metrics": self.metrics,
            "degradations": self.degradations,
            "time_budget": self.budget_decisions,
            "world_size": self.ranks.world_size,
            "memory_checks": self.memory_checks,
        }

    def save(self, which: str, epoch: int) -> None:
        """``checkpoint_{which}.pt``. Rank 0 writes; the other ranks hold the same weights (gradients are averaged)."""
        if not self.ranks.is_main:
            return
        job = self.job
        save_checkpoint(
            job.workspace.checkpoint(job.config_name, job.fold, which),
            self.step.network,
            self.step.optimizer,
            self.step.scaler,
            job.planned,
            job.config_name,
            self.progress_state(epoch),
        )


def _setup(job: _Job, resumed: dict[str, Any] | None, distributed: DistributedContext) -> _Context:
    """Threads, seed, network and optimizer; from the checkpoint when resuming (random states last)."""
    planned, run, out = job.planned, job.run, job.out
    micro, accumulation = rank_batch(planned.batch_size, planned.accumulation_steps, distributed.world_size)
    share = planned.with_(batch_size=micro, accumulation_steps=accumulation)  # this rank's part of a step
    config = apply_degradations(share, resumed["degradations"]) if resumed else share
    if run.device == "cpu":
        shared = max(1, cpu_count() // distributed.local_world_size)  # the node's cores shared by its ranks
        use_cpu_threads(run.cpu_threads or (shared if distributed.local_world_size > 1 else None), "training")
    torch.manual_seed(run.seed)
    ctx = _Context(
        job,
        config,
        step=_make_step(config, run, job.plans.label_scheme),
        epochs=run.epochs,
        iterations_per_epoch=run.iterations_per_epoch,
    )
    distribute(ctx.step, distributed)
    _watch_memory(ctx)
    ctx.loader_workers, ctx.use_precomputed = choose_data_pipeline(
        run, job.data_folder, config, job.plans, job.train_ids, distributed.local_world_size
    )
    if resumed is None:
        if ctx.ranks.is_main:
            (out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run
        if run.time_budget_s is not None:
            ctx.budget = _time_budget(job, config)
        return ctx
    ctx.step.network.load_state_dict(resumed["network"])
    ctx.step.optimizer.load_state_dict(resumed["optimizer"])
    ctx.step.scaler.load_state_dict(resumed["grad_scaler"])
    ctx.epochs = resumed["schedule"]["epochs"]
    ctx.iterations_per_epoch = resumed["schedule"]["iterations_per_epoch"]
    ctx.first_epoch = resumed["epoch"] + 1
    ctx.steps_done = resumed["schedule"].get("steps_done", ctx.first_epoch * ctx.iterations_per_epoch)  # older ones
    ctx.metrics = [r for r in resumed["metrics"] if r["epoch"] <= resumed["epoch"]]
    ctx.ema, ctx.best_ema = resumed["ema"], resumed["best_ema_dice"]
    ctx.degradations, ctx.budget_decisions = resumed["degradations"], resumed["time_budget"] or []
    ctx.memory_checks = resumed["memory_checks"]  # this process checks again: it may run on another machine
    if ctx.ranks.is_main:
        atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in ctx.metrics))
    if (ctx.epochs, ctx.iterations_per_epoch) != (run.epochs, run.iterations_per_epoch):
        log.info(
            "resuming with the checkpoint's schedule: %d epochs x %d iterations", ctx.epochs, ctx.iterations_per_epoch
        )
    log.info(
        "resumed %s fold %s from %s after epoch %d",
        job.config_name,
        job.fold,
        job.workspace.checkpoint(job.config_name, job.fold, "latest"),
        resumed["epoch"],
    )
    restore_rng_states(resumed["rng"])
    return ctx


def _train(ctx: _Context) -> Path:
    config, run, world = ctx.config, ctx.job.run, ctx.ranks.world_size
    global_batch = world * config.batch_size * config.accumulation_steps
    job = ctx.job
    log.info(
        "training %s fold %s: %d train / %d val cases, patch %s, batch %d x %d accumulation x %d process(es) = "
        "global batch %d (planned %d), %d epochs x %d it",
        job.config_name,
        job.fold,
        len(job.train_ids),
        len(job.val_ids),
        config.patch_size,
        config.batch_size,
        config.accumulation_steps,
        world,
        global_batch,
        job.planned.batch_size * job.planned.accumulation_steps,
        ctx.epochs,
        ctx.iterations_per_epoch,
    )
    epoch = ctx.first_epoch
    while epoch < ctx.epochs:
        t0 = job.clock()
        if ctx.budget is not None:
            ctx.budget.epoch_started(t0)
        row = _run_epoch(ctx, epoch, t0)
        if ctx.ranks.is_main:  # the other ranks have no row
            row.update(
                run_times(
                    job.clock() - job.started,
                    epoch + 1,
                    ctx.epochs,
                    [m["epoch_seconds"] for m in ctx.metrics] + [row["epoch_seconds"]],
                    _planned(ctx),
                )
            )
            ctx.metrics.append(row)
            record_epoch(row, ctx.job.out, ctx.metrics)
            if ctx.ema > ctx.best_ema:
                ctx.best_ema = ctx.ema
                ctx.save("best", epoch)
        if ctx.budget is not None:
            _follow_plan(ctx, ctx.budget.epoch_done(job.clock()))
        ctx.save("latest", epoch)
        epoch += 1
    ctx.save("final", ctx.epochs - 1)
    if not ctx.ranks.is_main:
        return ctx.job.out  # rank 0 writes run.json and runs the final validation alone
    record = {
        "run": asdict(run),
        "fold": str(ctx.job.fold),
        "config": ctx.job.config_name,
        "schedule": {"epochs": ctx.epochs, "iterations_per_epoch": ctx.iterations_per_epoch},
        "degradations": ctx.degradations,
        "time_budget": ctx.budget_decisions,
        "effective_configuration": {
            "batch_size": ctx.config.batch_size,
            "accumulation_steps": ctx.config.accumulation_steps,
            "checkpointing": ctx.config.checkpointing,
        },
        "data": {"loader_workers": ctx.loader_workers, "use_precomputed": ctx.use_precomputed},
        "distributed": {"world_size": world, "global_batch": global_batch},
        "memory_checks": ctx.memory_checks,
    }
    if not run.validate:
        atomic_write_text(job.out / "run.json", json.dumps(record, indent=2))
        return job.out
    from autoseg.train.validation import final_validation_record, validate_fold

    record["final_validation"] = final = final_validation_record(job.val_ids, run.device, ctx.budget)
    atomic_write_text(job.out / "run.json", json.dumps(record, indent=2))
    t0 = job.clock()
    validate_fold(
        job.workspace,
        job.plans,
        job.config_name,
        ctx.step.network,
        final["cases"],
        job.out / "validation",
        run.device,
        job.progress,
        tta=final["tta"],
    )
    if ctx.budget is not None:
        log.info(
            "time budget %.0f s: the final validation took %.1f s (estimated %.1f s); the run ended at %.1f s",
            ctx.budget.budget_seconds,
            job.clock() - t0,
            final["estimated_seconds"],
            job.clock() - job.started,
        )
    return job.out


def _time_budget(job: _Job, config: ConfigurationPlan) -> TimeBudget:
    """The run's ``TimeBudget``: its final validation is the fold's validation cases with the device's default
    ``--tta`` (``autoseg.predict.predictor.default_tta``) until the budget reduces it."""
    from autoseg.model.tta import parse_tta
    from autoseg.predict.predictor import default_tta

    run, folder = job.run, job.data_folder
    cases = {c: open_case(folder, c).arrays()[0].shape[1:] for c in job.val_ids} if run.validate else {}
    tta = default_tta(run.device)
    budgeted = BudgetedRun(
        run.epochs,
        run.iterations_per_epoch,
        run.val_iterations,
        config.accumulation_steps,
        config.batch_size,
        tuple(config.patch_size),
        cases,
        tta,
        parse_tta(tta, config.dim),
    )
    return TimeBudget(run.time_budget_s, job.started, budgeted)


def _planned(ctx: _Context) -> float | None:
    """The run's planned seconds: the time budget, else the plan's seconds per iteration (when planned for this
    device) times the iterations."""
    if ctx.budget is not None:
        return ctx.budget.budget_seconds
    s = ctx.config.predicted_seconds_per_iteration
    same_device = ctx.config.device == ctx.step.device.type
    return s * ctx.epochs * ctx.iterations_per_epoch if s and same_device else None


def _follow_plan(ctx: _Context, plan: tuple[int, int]) -> None:
    """Run rank 0's plan (epochs, iterations per epoch) on every rank; keep the decisions for run.json."""
    ctx.epochs, ctx.iterations_per_epoch = (ctx.ranks.broadcast_int(v) for v in plan)
    ctx.budget_decisions = [d.to_dict() for d in ctx.budget.decisions]


def _run_epoch(ctx: _Context, epoch: int, t0: float) -> dict[str, Any] | None:
    """Train ``iterations_per_epoch`` steps (a time budget may change it while the epoch runs) and measure the
    pseudo-Dice; returns the metrics row (rank 0; the other ranks skip the pseudo-Dice and return None)."""
    step, run = ctx.step, ctx.job.run
    wait, losses, lr, it = 0.0, [], run.optimizer.initial_lr, 0
    train_loader = ctx.loader(epoch, augment=True)
    try:
        step.network.train()
        bar = tqdm(
            total=ctx.iterations_per_epoch, desc=f"epoch {epoch}", unit="it", disable=not ctx.job.progress, leave=False
        )
        while it < ctx.iterations_per_epoch:
            done, planned = ctx.steps_done + it, ctx.steps_done + (ctx.epochs - epoch) * ctx.iterations_per_epoch
            lr = poly_lr(run.optimizer.initial_lr, done, planned)  # over the steps of the plan in force
            for group in step.optimizer.param_groups:
                group["lr"] = lr
            (loss, waited), train_loader = _step_or_degrade(ctx, train_loader, epoch, it)
            loss = loss.item()  # syncs with the device, once per step
            losses.append(loss)
            wait, it = wait + waited, it + 1
            bar.total = ctx.iterations_per_epoch
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")
            if ctx.budget is not None and (plan := ctx.budget.iteration_done(ctx.job.clock())) is not None:
                _follow_plan(ctx, plan)  # at the same iteration on every rank
        bar.close()
    finally:
        train_loader.close()
    ctx.steps_done += it
    train_loss = ctx.ranks.mean(float(np.mean(losses)))  # the global batch's loss
    if not ctx.ranks.is_main:
        return None
    with ctx.loader(epoch, augment=False) as val_loader:
        val_loss, dice = validate_patches(
            step.network, val_loader, step.loss_fn, run.val_iterations, step.device, ctx.job.plans.label_scheme
        )
    mean_dice = float(np.nanmean(dice)) if len(dice) else 0.0
    ctx.ema = mean_dice if ctx.ema is None else 0.9 * ctx.ema + 0.1 * mean_dice
    epoch_s = ctx.job.clock() - t0
    return {
        "epoch": epoch,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "pseudo_dice": [float(d) for d in dice],
        "ema_pseudo_dice": ctx.ema,
        "lr": lr,
        "epoch_seconds": epoch_s,
        "data_wait_fraction": wait / max(epoch_s, 1e-9),
    }


def _step_or_degrade(
    ctx: _Context, loader: BatchLoader, epoch: int, iteration: int
) -> tuple[tuple[float, float], BatchLoader]:
    """One step; on out-of-memory degrade the configuration (``autoseg.train.degrade``), rebuild the loader
    with the new micro-batch and retry. Returns ((loss, data wait seconds), the loader now in use)."""
    while True:
        try:
            return ctx.memory.step(ctx.step, loader), loader
        except torch.OutOfMemoryError:
            ctx.step.optimizer.zero_grad(set_to_none=True)  # drop the partial gradients
            if ctx.step.device.type == "cuda":
                torch.cuda.empty_cache()
            degraded, record = choose_degradation(ctx.config, ctx.step.device)
            record.update(epoch=epoch, iteration=iteration)
            log_degradation(record)
            ctx.config = degraded
            ctx.degradations.append(record)
            ctx.step.accumulation_steps = degraded.accumulation_steps
            ctx.step.network.checkpointing = degraded.checkpointing
            _watch_memory(ctx)  # the degraded configuration has its own prediction: checked afresh
            loader.close()
            loader = ctx.loader(epoch, augment=True)


def _make_step(config: ConfigurationPlan, run: RunConfig, scheme: LabelScheme) -> TrainStep:
    """The plan's training step on the run's device; the plan's precision on CUDA, fp32 on CPU."""
    return configured_step(config, torch.device(run.device), run.optimizer, scheme)


def _watch_memory(ctx: _Context) -> None:
    """Check the memory model over the configuration's first steps (``memory_check``): a log line, a warning when
    off. Every rank measures its own device; rank 0's checks go to run.json and the checkpoints."""

    def record(check: MemoryCheck) -> None:
        log_check(check)
        if ctx.ranks.is_main:
            ctx.memory_checks.append(check.to_dict())

    ctx.memory = MemoryObserver(ctx.config, ctx.step.device, ctx.job.run.optimizer, ctx.job.plans.label_scheme, record)
