"""Training one fold from the plan: a plain loop (SGD Nesterov, poly LR, Dice + CE with deep supervision).

This module sets a run up (a fresh one, or resumed from checkpoint_latest.pt) and ends it (checkpoint_final.pt,
run.json, the final validation); the epochs between are ``autoseg.train.epochs``'. Per epoch:
``iterations_per_epoch`` optimizer steps (each ``accumulation_steps`` micro-batches), a pseudo-Dice on validation
patches, one log line, metrics.jsonl, progress.png and an atomic checkpoint (``autoseg.train.checkpoint``: enough
to resume bit for bit). Where the run is, what it measured and what it decided is one frozen
``autoseg.train.progress.TrainingProgress``, replaced as the run goes on; the checkpoints hold it whole and run.json
(``autoseg.train.run_record``) takes its record from it.

Safety: an out-of-memory error in a step is never fatal; the step is retried with a degraded
configuration (``autoseg.train.degrade``), recorded in run.json and the checkpoints. ``time_budget_s`` sets
epochs, iterations per epoch and the final validation's cases and mirroring from measured speed
(``autoseg.train.schedule.TimeBudget``, timed by the run's ``clock``). The first steps of every run check the
memory model on this machine (``autoseg.train.memory_check``): one log line, run.json, a warning when off.
``run.init_from``: a fresh run starts from a trained model's weights (``autoseg.train.init_weights``, recorded in the
progress); a resumed run never applies it again.

Distributed (torchrun, ``autoseg.model.distributed``): each rank takes its share of the planned global batch
(``rank_batch``) from its own loader stream; the loss's Dice sums and, after backward, the gradients are
summed over ranks; an out-of-memory error on any rank degrades every rank. Only rank 0 writes (train.log,
metrics, progress.png, checkpoints, run.json) and validates; its time-budget decisions are broadcast.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from logging.handlers import MemoryHandler
from pathlib import Path

import torch

from autoseg.core.artifacts import LogFile, atomic_write_text, remove_stale_temporaries, to_dict
from autoseg.core.errors import InputError
from autoseg.core.machine import use_cpu_threads
from autoseg.core.resources import cpu_count
from autoseg.core.workspace import Workspace
from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext, rank_batch
from autoseg.model.step import distribute
from autoseg.plan.iteration_target import replan_note
from autoseg.plan.like import LIKE_MODEL
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.preprocess.run import check_preprocessed
from autoseg.preprocess.store import open_case
from autoseg.train.checkpoint import Checkpoint, check_same_plan, load_checkpoint
from autoseg.train.data_pipeline import choose_data_pipeline
from autoseg.train.degrade import apply_degradations
from autoseg.train.epochs import run_epochs
from autoseg.train.fold_data import fold_cases, prepare_previous_stage
from autoseg.train.init_weights import initialise_from
from autoseg.train.progress import TrainingProgress
from autoseg.train.run_config import RunConfig
from autoseg.train.run_record import DataRecord
from autoseg.train.run_state import FoldJob, TrainingRun, make_step, observe_memory
from autoseg.train.schedule import BudgetedRun, PredictionTiming, TimeBudget, time_prediction
from autoseg.train.tracking import Tracking, check_trackers, tracked

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
    """Train one fold; returns the fold's results folder. ``progress``: progress bars. ``distributed``: this
    process's rank in a torchrun launch, its process group open (``autoseg.model.distributed.process_group``).
    ``clock``: seconds, what the time budget and the epoch times are measured with (tests pass a simulated one)."""
    started = clock()
    check_trackers(run.track)  # a missing extra is refused before any work
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config = plans.configuration(config_name)
    check_preprocessed(workspace, plans, config_name, needs_dataset=run.validate)  # refused, not mixed
    train_ids, val_ids = fold_cases(workspace, config.data_configuration, fold)
    previous = prepare_previous_stage(workspace, plans, config_name, sorted({*train_ids, *val_ids}))  # cascade
    out = workspace.results(config_name, fold)
    resumed = _checkpoint_to_resume(workspace, config, config_name, fold, distributed) if run.resume else None
    # the set-up's lines wait here for train.log: a set-up that is refused leaves no fold folder and no train.log
    opening = MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    log.addHandler(opening)
    handlers: list[logging.Handler] = [opening]
    threads = torch.get_num_threads()
    try:
        job = FoldJob(
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
        training = _setup(job, resumed, distributed)
        handlers.append(_open_log(out, distributed, opening))
        opening.setTarget(handlers[-1])
        opening.flush()  # the set-up's lines, with the times they were logged at
        _log_start(training)
        with _tracked(training) as training.tracking:
            run_epochs(training)
            return _finish(training)
    finally:
        torch.set_num_threads(threads)
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()


@contextmanager
def _tracked(training: TrainingRun) -> Iterator[Tracking | None]:
    """``--track``'s trackers for the run (rank 0 only; None without): the plan now, each epoch (``run_epochs``), then
    progress.png and run.json once the fold's files are written."""
    job, names = training.job, training.job.run.track if training.ranks.is_main else ()
    experiment = f"autoseg {job.plans.dataset_name}"
    with tracked(names, job.workspace.root, job.out, experiment, job.plans.label_scheme.names) as tracking:
        if tracking is not None:
            tracking.start(training.config, training.progress.memory_checks)
        yield tracking
        if tracking is not None:
            tracking.finish(training.progress.epoch, [job.out / "progress.png", job.out / "run.json"])


def _open_log(out: Path, distributed: DistributedContext, opening: MemoryHandler) -> logging.Handler:
    """The fold's folder, cleared of what killed writes left, and its train.log (rank 0; the others log nowhere),
    attached to the trainer's log in place of ``opening``, which holds the set-up's lines for it."""
    out.mkdir(parents=True, exist_ok=True)
    if distributed.is_main:
        for stale in remove_stale_temporaries(out) + remove_stale_temporaries(out / "validation"):  # killed writes
            log.info("removed %s, left by an interrupted run", stale)
    handler = LogFile(out / "train.log") if distributed.is_main else logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.removeHandler(opening)
    log.addHandler(handler)
    return handler


def _checkpoint_to_resume(
    workspace: Workspace, config: ConfigurationPlan, config_name: str, fold: int | str, distributed: DistributedContext
) -> Checkpoint:
    """The fold's checkpoint_latest.pt, refused when the plan changed or it was trained on another number of
    processes."""
    latest = workspace.checkpoint(config_name, fold, "latest")
    resumed = load_checkpoint(latest)
    check_same_plan(resumed, config, config_name)
    world = resumed.progress.world_size
    if world != distributed.world_size:
        raise InputError(
            f"{latest} was trained on {world} process(es), this run has {distributed.world_size} (the "
            f"micro-batches and data streams are per process); resume with --gpus {world}, or train again "
            "without --resume"
        )
    return resumed


def _setup(job: FoldJob, resumed: Checkpoint | None, distributed: DistributedContext) -> TrainingRun:
    """Threads, seed, network and optimizer; from the checkpoint when resuming (random states last)."""
    planned, run = job.planned, job.run
    micro, accumulation = rank_batch(planned.batch_size, planned.accumulation_steps, distributed.world_size)
    share = planned.with_(batch_size=micro, accumulation_steps=accumulation)  # this rank's part of a step
    config = apply_degradations(share, list(resumed.progress.degradations)) if resumed else share
    if run.device == "cpu":
        shared = max(1, cpu_count() // distributed.local_world_size)  # the node's cores shared by its ranks
        use_cpu_threads(run.cpu_threads or (shared if distributed.local_world_size > 1 else None), "training")
    torch.manual_seed(run.seed)
    step = make_step(config, run, job.plans)
    init = _initial_weights(job, step.network) if resumed is None else None
    distribute(step, distributed)
    watch = observe_memory(config, step, job)
    data = DataRecord(
        *choose_data_pipeline(run, job.data_folder, config, job.plans, job.train_ids, distributed.local_world_size)
    )
    if resumed is None:
        if distributed.is_main:
            (job.out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run
        budget, probe = (None, None)
        if run.time_budget_s is not None:
            budget, probe = _time_budget(job, config, step.network, distributed)
        fresh = TrainingProgress.start(run.epochs, run.iterations_per_epoch, distributed.world_size, init)
        return TrainingRun(job, step, data, budget, config, fresh, watch, probe)
    training = TrainingRun(job, step, data, None, config, resumed.progress, watch)
    _resume(training, resumed)
    return training


def _initial_weights(job: FoldJob, network: torch.nn.Module) -> dict | None:
    """--init-from: the model's weights copied into the fresh ``network``; their record (None without)."""
    run = job.run
    if run.init_from is None:
        return None
    return to_dict(initialise_from(network, job.plans, run.init_from, job.config_name, run.init_fold))


def _resume(training: TrainingRun, resumed: Checkpoint) -> None:
    """The checkpoint's weights, optimizer and progress (its schedule, not the run's), then its random states."""
    job, step, progress = training.job, training.step, resumed.progress
    step.network.load_state_dict(resumed.network)
    step.optimizer.load_state_dict(resumed.optimizer)
    step.scaler.load_state_dict(resumed.grad_scaler)
    # this process checks the memory again (it may run on another machine); the earlier checks stay in the record
    metrics = tuple(r for r in progress.metrics if r["epoch"] <= progress.epoch)
    training.progress = replace(progress, metrics=metrics, rng=None)
    if training.ranks.is_main:
        atomic_write_text(job.out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in metrics))
    schedule = progress.schedule
    if (schedule.epochs, schedule.iterations_per_epoch) != (job.run.epochs, job.run.iterations_per_epoch):
        log.info(
            "resuming with the checkpoint's schedule: %d epochs x %d iterations",
            schedule.epochs,
            schedule.iterations_per_epoch,
        )
    log.info("resumed %s fold %s from %s after epoch %d", job.config_name, job.fold, resumed.path, progress.epoch)
    if job.run.init_from is not None:  # the trained weights are the checkpoint's: an init would undo them
        started = "its own initialisation" if progress.init is None else progress.init["model"]
        log.info(
            "--init-from %s not applied: a resumed run goes on from its checkpoint (it started from %s)",
            job.run.init_from,
            started,
        )
    progress.rng.restore()


def _log_start(training: TrainingRun) -> None:
    job, config, world = training.job, training.config, training.ranks.world_size
    schedule = training.progress.schedule
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
        world * config.batch_size * config.accumulation_steps,
        job.planned.batch_size * job.planned.accumulation_steps,
        schedule.epochs,
        schedule.iterations_per_epoch,
    )


def _finish(training: TrainingRun) -> Path:
    """checkpoint_final.pt; on rank 0 run.json and, when the run validates, the final validation, the class
    decision weights fitted on it (``autoseg.train.class_weights``) and then the bf16 agreement check
    (``run.precision_check``)."""
    job, run = training.job, training.job.run
    training.save("final")
    if not training.ranks.is_main:
        return job.out  # rank 0 writes run.json and runs the final validation alone
    record = training.record()
    if not run.validate:
        record.to_json(job.out / "run.json")
        return job.out
    from autoseg.train.validation import final_validation, validate_fold

    final = final_validation(job.val_ids, run.device, training.budget)
    replace(record, final_validation=final).to_json(job.out / "run.json")
    t0 = job.clock()
    validate_fold(
        job.workspace,
        job.plans,
        job.config_name,
        training.step.network,
        final,
        job.out / "validation",
        run.device,
        job.show_progress,
    )
    validation_seconds = job.clock() - t0
    from autoseg.train.class_weights import fit_after_validation

    fit_after_validation(job.workspace, job.plans, job.config_name, job.fold, job.out / "validation", final.cases)
    if training.budget is not None:
        log.info(
            "time budget %.0f s: the final validation took %.1f s (estimated %.1f s); the run ended at %.1f s",
            training.budget.budget_seconds,
            validation_seconds,
            final.estimated_seconds,
            job.clock() - job.started,
        )
    if run.precision_check:
        from autoseg.train.precision_check import check_after_validation

        budget = training.budget
        left = None if budget is None else budget.budget_seconds - (job.clock() - job.started)
        check_after_validation(job.workspace, job.plans, job.config_name, job.fold, final, validation_seconds, left)
    return job.out


def _time_budget(
    job: FoldJob, config: ConfigurationPlan, network: torch.nn.Module, distributed: DistributedContext
) -> tuple[TimeBudget, PredictionTiming | None]:
    """The run's ``TimeBudget`` and, on the rank that validates, the probe that times the final validation's
    prediction (timed here, before the first step). The final validation is the fold's validation cases with the
    device's default ``--tta`` (``autoseg.predict.window.default_tta``) until the budget reduces it."""
    from autoseg.model.tta import parse_tta
    from autoseg.predict.window import default_tta
    from autoseg.train.prediction_rates import PredictionProbe, validation_work

    run, folder = job.run, job.data_folder
    validates = run.validate and distributed.is_main and bool(job.val_ids)
    shapes = {c: open_case(folder, c).arrays()[0].shape[1:] for c in job.val_ids} if validates else {}
    tta = default_tta(run.device)
    budgeted = BudgetedRun(
        run.epochs,
        run.iterations_per_epoch,
        run.val_iterations,
        config.accumulation_steps,
        validation_work(job.planned, run.device, shapes),
        tta,
        parse_tta(tta, config.dim),
    )
    budget = TimeBudget(run.time_budget_s, job.started, budgeted)
    planned = job.plans.iteration  # a CPU plan's step was sized to a time; a --like plan's is the model's
    if run.device == "cpu" and planned is not None and job.planned.limited_by != LIKE_MODEL and distributed.is_main:
        note = replan_note(planned, run.time_budget_s, str(job.workspace.dataset_root()), str(job.workspace.root))
        if note:
            log.warning("time budget: %s", note)
    probe = PredictionProbe(job, network, shapes) if shapes else None
    time_prediction(probe, budget, job.clock)
    return budget, probe
