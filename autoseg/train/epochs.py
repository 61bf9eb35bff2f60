"""The epoch loop: each epoch's optimizer steps (an out-of-memory error degrades the configuration and the step is
retried), its pseudo-Dice, its log line, metrics row and progress.png, and its checkpoints; the time budget's plan
followed as it changes. Each step of progress replaces the run's ``TrainingProgress``."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from autoseg.data.loader import BatchLoader
from autoseg.train.curves import record_epoch, run_times
from autoseg.train.degrade import choose_degradation, log_degradation
from autoseg.train.patch_validation import validate_patches
from autoseg.train.run_state import TrainingRun
from autoseg.train.schedule import poly_lr, time_prediction

__all__ = ["run_epochs"]

log = logging.getLogger("autoseg.train.trainer")


def run_epochs(run: TrainingRun) -> None:
    """From the progress's next epoch to the end of the schedule in force: after each epoch its metrics row (rank 0),
    checkpoint_best.pt when the pseudo-Dice's EMA improved, the time budget's new plan and checkpoint_latest.pt."""
    job = run.job
    epoch = run.progress.next_epoch
    while epoch < run.progress.schedule.epochs:
        t0 = job.clock()
        if run.budget is not None:
            run.budget.epoch_started(t0)
        steps, row, ema = _run_epoch(run, epoch, t0)
        if row is not None:  # rank 0: the other ranks have no row
            schedule, seconds = run.progress.schedule, [m["epoch_seconds"] for m in run.progress.metrics]
            elapsed = job.clock() - job.started
            row.update(run_times(elapsed, epoch + 1, schedule.epochs, [*seconds, row["epoch_seconds"]], _planned(run)))
        before = run.progress
        run.progress = before.with_epoch(epoch, row, ema, steps)
        if row is not None:
            record_epoch(row, job.out, list(run.progress.metrics))
            if run.tracking is not None:
                run.tracking.epoch(row, run.config, run.progress.memory_checks)
            if run.progress.best_ema > before.best_ema:
                run.save("best")
        if run.budget is not None:
            time_prediction(run.probe, run.budget, job.clock)  # where due: counted in the epoch's time besides
            _follow_plan(run, run.budget.epoch_done(job.clock()))
        run.save("latest")
        epoch += 1


def _run_epoch(run: TrainingRun, epoch: int, t0: float) -> tuple[int, dict[str, Any] | None, float | None]:
    """Train the epoch's steps (a time budget may change their number while the epoch runs) and measure the
    pseudo-Dice; returns (the steps run, the metrics row, the pseudo-Dice's EMA), the last two None on the ranks
    other than 0 (they skip the pseudo-Dice)."""
    step, settings = run.step, run.job.run
    wait, losses, lr, it = 0.0, [], settings.optimizer.initial_lr, 0
    steps_done = run.progress.schedule.steps_done
    train_loader = run.loader(epoch, augment=True)
    try:
        step.network.train()
        schedule = run.progress.schedule
        bar = tqdm(
            total=schedule.iterations_per_epoch,
            desc=f"epoch {epoch}",
            unit="it",
            disable=not run.job.show_progress,
            leave=False,
        )
        while it < run.progress.schedule.iterations_per_epoch:
            schedule = run.progress.schedule
            done, planned = steps_done + it, steps_done + (schedule.epochs - epoch) * schedule.iterations_per_epoch
            lr = poly_lr(settings.optimizer.initial_lr, done, planned)  # over the steps of the plan in force
            for group in step.optimizer.param_groups:
                group["lr"] = lr
            (loss, waited), train_loader = _step_or_degrade(run, train_loader, epoch, it)
            loss = loss.item()  # syncs with the device, once per step
            losses.append(loss)
            wait, it = wait + waited, it + 1
            bar.total = run.progress.schedule.iterations_per_epoch
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")
            if run.budget is not None and (plan := run.budget.iteration_done(run.job.clock())) is not None:
                _follow_plan(run, plan)  # at the same iteration on every rank
        bar.close()
    finally:
        train_loader.close()
    train_loss = run.ranks.mean(float(np.mean(losses)))  # the global batch's loss
    if not run.ranks.is_main:
        return it, None, None
    with run.loader(epoch, augment=False) as val_loader:
        val_loss, dice = validate_patches(
            step.network, val_loader, step.loss_fn, settings.val_iterations, step.device, run.job.plans.label_scheme
        )
    mean_dice = float(np.nanmean(dice)) if len(dice) else 0.0
    ema = mean_dice if run.progress.ema is None else 0.9 * run.progress.ema + 0.1 * mean_dice
    epoch_s = run.job.clock() - t0
    row = {
        "epoch": epoch,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "pseudo_dice": [float(d) for d in dice],
        "ema_pseudo_dice": ema,
        "lr": lr,
        "epoch_seconds": epoch_s,
        "data_wait_fraction": wait / max(epoch_s, 1e-9),
    }
    return it, row, ema


def _step_or_degrade(
    run: TrainingRun, loader: BatchLoader, epoch: int, iteration: int
) -> tuple[tuple[torch.Tensor, float], BatchLoader]:
    """One step; on out-of-memory degrade the configuration (``autoseg.train.degrade``), rebuild the loader with
    the new micro-batch and retry. Returns ((loss, data wait seconds), the loader now in use)."""
    while True:
        try:
            return _step(run, loader), loader
        except torch.OutOfMemoryError:
            run.step.optimizer.zero_grad(set_to_none=True)  # drop the partial gradients
            if run.step.device.type == "cuda":
                torch.cuda.empty_cache()
            degraded, record = choose_degradation(run.config, run.step.device)
            record.update(epoch=epoch, iteration=iteration)
            log_degradation(record)
            run.config = degraded
            run.progress = run.progress.with_degradation(record)
            run.step.accumulation_steps = degraded.accumulation_steps
            run.step.network.checkpointing = degraded.checkpointing
            run.watch_memory()  # the degraded configuration has its own prediction: checked afresh
            loader.close()
            loader = run.loader(epoch, augment=True)


def _step(run: TrainingRun, loader: BatchLoader) -> tuple[torch.Tensor, float]:
    """One optimizer step: through the memory check's observer while it watches the configuration's first steps,
    then the step itself."""
    if run.watch is None:
        return run.step(loader)
    out = run.watch.step(run.step, loader)
    if run.watch.result is not None:
        run.record_check(run.watch.result)
    return out


def _planned(run: TrainingRun) -> float | None:
    """The run's planned seconds: the time budget, else the plan's seconds per iteration (when planned for this
    device) times the iterations."""
    if run.budget is not None:
        return run.budget.budget_seconds
    s, schedule = run.config.predicted_seconds_per_iteration, run.progress.schedule
    same_device = run.config.device == run.step.device.type
    return s * schedule.epochs * schedule.iterations_per_epoch if s and same_device else None


def _follow_plan(run: TrainingRun, plan: tuple[int, int]) -> None:
    """Run rank 0's plan (epochs, iterations per epoch) on every rank; keep the decisions for run.json."""
    epochs, iterations = (run.ranks.broadcast_int(v) for v in plan)
    decisions = tuple(d.to_dict() for d in run.budget.decisions)
    run.progress = run.progress.with_plan((epochs, iterations), decisions)
