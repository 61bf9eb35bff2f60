"""The training schedule: poly learning rate, and epochs chosen to fit a wall-clock budget (``--time-budget``).

A budget fixes the *number of epochs* (iterations per epoch stay as configured), so the poly schedule
still runs to zero at the end. The trainer decides twice: after the first few iterations (measured seconds
per iteration, an estimate of the per-epoch validation), then at the end of the first epoch from its full
measured time (validation, checkpoint and plot included); after that it only shortens the schedule, if
epochs get slower. The final validation (sliding-window prediction of the fold's validation cases) is
estimated beforehand and kept free at the end of the budget.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoseg.core.errors import InputError
from autoseg.model.tiles import tile_layout

log = logging.getLogger("autoseg.train.trainer")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def poly_lr(initial_lr: float, step: int, total_steps: int, exponent: float = 0.9) -> float:
    """``initial_lr * (1 - step / total_steps) ** exponent``, zero at ``step == total_steps``."""
    return initial_lr * max(0.0, 1 - step / max(total_steps, 1)) ** exponent


def parse_duration(text: str) -> float:
    """'2h', '30m', '90s', '1h30m', '1.5h' or a plain number of seconds -> seconds (> 0)."""
    compact = text.strip().lower().replace(" ", "")
    parts = re.findall(r"([0-9]*\.?[0-9]+)([hms]?)", compact)
    if not compact or "".join(v + u for v, u in parts) != compact or \
            (len(parts) > 1 and any(not u for _, u in parts)):
        raise InputError(f"cannot read {text!r} as a duration; use e.g. 2h, 30m, 90s or 1h30m")
    seconds = sum(float(v) * _UNIT_SECONDS[u or "s"] for v, u in parts)
    if seconds <= 0:
        raise InputError(f"the time budget must be positive; got {text!r}")
    return seconds


@dataclass(frozen=True)
class BudgetDecision:
    """One decision on the number of epochs, with the figures it came from (all seconds)."""

    epochs: int
    budget_seconds: float
    elapsed_seconds: float
    seconds_per_iteration: float
    seconds_per_epoch: float
    final_validation_seconds: float
    source: str  # "first iterations", "first epoch", "epoch k" (a later correction)

    def to_dict(self) -> dict[str, float | int | str]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def epochs_within_budget(budget_seconds: float, elapsed_seconds: float, epochs_done: float,
                         seconds_per_epoch: float, final_validation_seconds: float) -> int:
    """Total epochs such that the rest of the run fits: ``epochs_done`` (may be fractional: the first epoch
    in progress) plus as many whole epochs of ``seconds_per_epoch`` as the time left after the final
    validation holds. At least ``ceil(epochs_done)`` and at least 1: an epoch in progress is finished."""
    started = math.ceil(epochs_done)
    left = budget_seconds - elapsed_seconds - final_validation_seconds - (started - epochs_done) * seconds_per_epoch
    more = math.floor(max(left, 0.0) / max(seconds_per_epoch, 1e-9) + 1e-9)
    return max(1, started + more)


def final_validation_seconds(case_shapes: Sequence[Sequence[int]], patch_size: Sequence[int],
                             seconds_per_sample_step: float, mirror: bool = True) -> float:
    """Estimated seconds to predict the validation cases (preprocessed shapes (Z, Y, X)): per tile a
    forward pass costs about a third of a training step per sample (forward + backward ~ 3 forwards),
    times ``2 ** dim`` mirrorings; x1.5 for preprocessing, resampling and export."""
    passes = 2 ** len(patch_size) if mirror else 1
    tiles = sum(tile_layout(s, patch_size).num_tiles for s in case_shapes)
    return 1.5 * tiles * passes * seconds_per_sample_step / 3.0


EPOCH_OVERHEAD_SECONDS = 0.3  # first guess for checkpoint + progress plot per epoch; measured after epoch 0


class TimeBudget:
    """Chooses the total number of epochs from measured speed so that the run ends within the budget.

    ``started``: ``time.perf_counter()`` when the run started (setup counts against the budget).
    ``validation_case_shapes``: preprocessed (Z, Y, X) of the cases the final validation predicts ([] if
    there is none). ``micro_batches``: accumulation steps; ``batch_size``: the micro-batch.
    """

    def __init__(self, budget_seconds: float, started: float, iterations_per_epoch: int, val_iterations: int,
                 micro_batches: int, batch_size: int, patch_size: Sequence[int],
                 validation_case_shapes: Sequence[Sequence[int]], probe_iterations: int = 3) -> None:
        self.budget_seconds, self.started = float(budget_seconds), started
        self.iterations_per_epoch, self.val_iterations = iterations_per_epoch, val_iterations
        self.micro_batches, self.batch_size, self.patch_size = micro_batches, batch_size, tuple(patch_size)
        self.validation_case_shapes = [tuple(s) for s in validation_case_shapes]
        self.probe_iterations = max(1, min(probe_iterations, iterations_per_epoch))
        self.decisions: list[BudgetDecision] = []
        self.seconds_per_iteration = 0.0
        self.final_seconds = 0.0
        self._marks: list[float] = []
        self._epoch_seconds: list[float] = []

    def iteration_done(self, now: float, epoch_started: float) -> int | None:
        """Call after each iteration of the first epoch; returns the total epochs once the first
        ``probe_iterations`` are measured (the first one, a warm-up, is left out when there are more)."""
        if self.decisions:
            return None
        self._marks.append(now)
        k = self.probe_iterations
        if len(self._marks) < k:
            return None
        marks = [epoch_started, *self._marks]
        span = marks[1:] if k > 1 else marks
        self.seconds_per_iteration = (span[-1] - span[0]) / (len(span) - 1)
        s_it = self.seconds_per_iteration
        self.final_seconds = final_validation_seconds(
            self.validation_case_shapes, self.patch_size, s_it / (self.micro_batches * self.batch_size))
        per_epoch = self.iterations_per_epoch * s_it + self.val_iterations * s_it / self.micro_batches / 3 \
            + EPOCH_OVERHEAD_SECONDS
        return self._decide(now, k / self.iterations_per_epoch, per_epoch, "first iterations")

    def epoch_done(self, epoch: int, epoch_seconds: float, now: float, epochs: int) -> int:
        """Call after each epoch (checkpoint written); returns the total epochs from now on. After the first
        epoch the decision follows its measured time; later ones only shorten the schedule."""
        self._epoch_seconds.append(epoch_seconds)
        per_epoch = float(np.mean(self._epoch_seconds))
        fit = epochs_within_budget(self.budget_seconds, now - self.started, epoch + 1, per_epoch,
                                   self.final_seconds)
        first = len(self._epoch_seconds) == 1
        new = fit if first else min(epochs, fit)
        if first or new != epochs:
            self._decide(now, epoch + 1, per_epoch, "first epoch" if first else f"epoch {epoch}")
        return new

    def _decide(self, now: float, epochs_done: float, per_epoch: float, source: str) -> int:
        elapsed = now - self.started
        epochs = epochs_within_budget(self.budget_seconds, elapsed, epochs_done, per_epoch, self.final_seconds)
        decision = BudgetDecision(epochs=epochs, budget_seconds=self.budget_seconds, elapsed_seconds=elapsed,
                                  seconds_per_iteration=self.seconds_per_iteration, seconds_per_epoch=per_epoch,
                                  final_validation_seconds=self.final_seconds, source=source)
        self.decisions.append(decision)
        log.info("time budget %.0f s (%s): %.3f s/iteration, %.2f s/epoch, %.1f s elapsed, final validation "
                 "~%.1f s -> %d epochs", self.budget_seconds, source, self.seconds_per_iteration, per_epoch,
                 elapsed, self.final_seconds, epochs)
        return epochs
