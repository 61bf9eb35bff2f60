"""The training schedule: poly learning rate, and a plan that fits a wall-clock budget (``--time-budget``).

``TimeBudget`` owns every decision. It measures seconds per iteration after a warm-up (the first
``WARMUP_ITERATIONS`` are left out: loader start, first-call kernels) as the median of the recent ones, and the
per-epoch cost beside the iterations (pseudo-Dice, checkpoints, plot, loader restart) from the epochs run. The
final validation's estimate (``final_validation_seconds``) comes from this run's own prediction, timed by the trainer
(``autoseg.train.prediction_rates``) before the first step and again at epoch ends while timing costs at most
``TIMING_SHARE`` of the run (``prediction_due``); it reduces the validation when it would take more than
``VALIDATION_SHARE`` of the budget: no test-time mirroring first, then only the first validation cases (sorted ids).
The rest goes to training: as many epochs as the configured iterations per epoch need, each shortened to fill the
time (down to ``MIN_ITERATIONS_PER_EPOCH``). It re-estimates after the first steady iterations, every
``CHECK_EVERY`` iterations and after every epoch; a plan is kept while its predicted end stays within ``KEEP_BAND``
of the budget, otherwise a new one aims at ``TARGET_SHARE`` (shorter or longer).
The learning rate follows the plan in force: ``poly_lr(steps done, steps done + steps still planned)``, so a
new plan changes the curve's remaining length from the current step on, and the plan's last step runs near zero.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autoseg.core.errors import InputError

log = logging.getLogger("autoseg.train.trainer")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0}

WARMUP_ITERATIONS = 2  # left out of the rate: loader workers starting, allocator and kernels on first use
PROBE_ITERATIONS = 3  # steady iterations measured before the first decision
CHECK_EVERY = 10  # iterations between re-estimates (and one after every epoch)
RATE_WINDOW = 20  # the rate: median of the last 20 iteration times (a lasting slow-down shows in 10)
TARGET_SHARE = 0.95  # a new plan aims to end here (a margin for the final validation's estimate) ...
KEEP_BAND = (0.90, 0.98)  # ... and is kept while its predicted end stays in this share of the budget
VALIDATION_SHARE = 0.25  # the final validation is reduced to fit in a quarter of the budget
MIN_ITERATIONS_PER_EPOCH = 10  # iterations per epoch are shortened to fit, not below this
EPOCH_OVERHEAD_SECONDS = 0.3  # first guess for checkpoint + progress plot per epoch; measured after epoch 0
TIMING_SHARE = 0.05  # timing the final validation's prediction again takes at most 5% of the run


def poly_lr(initial_lr: float, step: int, total_steps: int, exponent: float = 0.9) -> float:
    """``initial_lr * (1 - step / total_steps) ** exponent``, zero at ``step == total_steps``."""
    return initial_lr * max(0.0, 1 - step / max(total_steps, 1)) ** exponent


def parse_duration(text: str) -> float:
    """'2h', '30m', '90s', '1h30m', '1.5h' or a plain number of seconds -> seconds (> 0)."""
    compact = text.strip().lower().replace(" ", "")
    parts = re.findall(r"([0-9]*\.?[0-9]+)([hms]?)", compact)
    if not compact or "".join(v + u for v, u in parts) != compact or (len(parts) > 1 and any(not u for _, u in parts)):
        raise InputError(f"cannot read {text!r} as a duration; use e.g. 2h, 30m, 90s or 1h30m")
    seconds = sum(float(v) * _UNIT_SECONDS[u or "s"] for v, u in parts)
    if seconds <= 0:
        raise InputError(f"the time budget must be positive; got {text!r}")
    return seconds


@dataclass(frozen=True)
class ValidationWork:
    """One validation case's prediction (``autoseg.train.prediction_rates.validation_work``): its sliding window's
    ``tiles`` of ``tile_voxels`` voxels each (one pass per mirror variant), and the voxels of its preprocessed image."""

    tiles: int
    tile_voxels: int
    voxels: int


@dataclass(frozen=True)
class PredictionRates:
    """This run's own prediction, timed (``autoseg.train.prediction_rates.PredictionProbe``): seconds per tile voxel
    of one (tile, mirror variant) pass of the sliding window (the forward pass in the planned tile batch, the flips,
    the accumulation), seconds per preprocessed voxel of the rest of a case (reading, preprocessing, export,
    evaluation), and ``timing_seconds``: what timing the passes again costs."""

    window_seconds_per_voxel: float
    case_seconds_per_voxel: float
    timing_seconds: float


class PredictionTiming(Protocol):
    """What times the final validation's prediction (``autoseg.train.prediction_rates.PredictionProbe``)."""

    def measure(self) -> PredictionRates: ...


def time_prediction(timing: PredictionTiming | None, budget: TimeBudget, clock: Callable[[], float]) -> None:
    """Time the prediction with ``timing`` (None: this rank does not validate) where ``budget`` asks for it."""
    if timing is not None and budget.prediction_due(clock()):
        rates = timing.measure()
        budget.prediction_measured(rates, clock())


def final_validation_seconds(work: Sequence[ValidationWork], rates: PredictionRates, variants: int) -> float:
    """Estimated seconds to predict and evaluate the validation cases ``work`` with ``variants`` mirror variants:
    per case, its tiles x variants passes at the measured seconds per tile voxel, and its voxels at the measured
    seconds per case voxel."""
    return sum(
        w.tiles * variants * w.tile_voxels * rates.window_seconds_per_voxel + w.voxels * rates.case_seconds_per_voxel
        for w in work
    )


@dataclass(frozen=True)
class ValidationChoice:
    """What the final validation predicts: ``tta`` (the ``--tta`` value), ``case_ids``, and its estimate."""

    tta: str
    case_ids: tuple[str, ...]
    seconds: float


def choose_validation(
    cases: Mapping[str, ValidationWork],
    rates: PredictionRates,
    tta: str,
    variants: int,
    reserve_seconds: float,
) -> ValidationChoice:
    """Every case of ``cases`` (id -> its work) with ``tta`` (``variants`` mirror variants) if that fits
    ``reserve_seconds``; else without mirroring; else the first cases in sorted order that fit, at least one."""
    ids = sorted(cases)

    def cost(chosen: Sequence[str], v: int) -> float:
        return final_validation_seconds([cases[c] for c in chosen], rates, v)

    if cost(ids, variants) <= reserve_seconds:
        return ValidationChoice(tta, tuple(ids), cost(ids, variants))
    k = len(ids)
    while k > 1 and cost(ids[:k], 1) > reserve_seconds:
        k -= 1
    return ValidationChoice("none", tuple(ids[:k]), cost(ids[:k], 1))


def plan_epochs(
    seconds_left: float,
    seconds_per_iteration: float,
    epoch_overhead_seconds: float,
    iterations_per_epoch: int,
    iterations_done: int,
    minimum_epochs: int,
) -> tuple[int, int]:
    """(epochs still to run, the one in progress included; iterations per epoch) filling ``seconds_left``.

    An epoch of I iterations costs ``I * seconds_per_iteration + epoch_overhead_seconds``; ``iterations_done`` of
    the epoch in progress are paid already. Epochs: as many as the configured ``iterations_per_epoch`` need to
    fill the time (rounded up), then each shortened to fill it exactly; if epochs of ``MIN_ITERATIONS_PER_EPOCH``
    would not fit, fewer of them. At least ``minimum_epochs`` (1 while an epoch is in progress or none ran)."""
    s = max(seconds_per_iteration, 1e-9)
    floor_iterations = min(MIN_ITERATIONS_PER_EPOCH, iterations_per_epoch)
    room = max(seconds_left, 0.0) + iterations_done * s  # the epoch in progress counted whole
    epochs = max(minimum_epochs, math.ceil(room / (iterations_per_epoch * s + epoch_overhead_seconds) - 1e-9))
    if epochs and room / epochs - epoch_overhead_seconds < floor_iterations * s:
        epochs = max(minimum_epochs, math.floor(room / (floor_iterations * s + epoch_overhead_seconds)))
    if epochs == 0:
        return 0, iterations_per_epoch
    fill = math.floor((room / epochs - epoch_overhead_seconds) / s + 1e-9)
    return epochs, min(iterations_per_epoch, max(floor_iterations, fill))


@dataclass(frozen=True)
class BudgetDecision:
    """One plan (epochs x iterations per epoch, the final validation) with the figures it came from (seconds)."""

    source: str  # where in the run: "iteration 5 of epoch 0", "end of epoch 3"
    epochs: int
    iterations_per_epoch: int
    budget_seconds: float
    elapsed_seconds: float
    seconds_per_iteration: float
    epoch_overhead_seconds: float
    final_validation_seconds: float
    validation_tta: str
    validation_cases: tuple[str, ...]
    predicted_end_seconds: float
    window_seconds_per_voxel: float  # the prediction's rates the validation's estimate came from (0: no cases)
    case_seconds_per_voxel: float

    def to_dict(self) -> dict[str, object]:
        record = {k: getattr(self, k) for k in self.__dataclass_fields__}
        record["validation_cases"] = list(self.validation_cases)
        return record

    def describe(self, total_cases: int) -> str:
        """The decision's log line."""
        return (
            f"time budget {self.budget_seconds:.0f} s, {self.source} ({self.elapsed_seconds:.1f} s elapsed): "
            f"{self.seconds_per_iteration:.3f} s/iteration + {self.epoch_overhead_seconds:.1f} s per epoch "
            f"besides, final validation ~{self.final_validation_seconds:.1f} s (tta {self.validation_tta}, "
            f"{len(self.validation_cases)} of {total_cases} cases; measured "
            f"{1e9 * self.window_seconds_per_voxel:.0f} ns per tile voxel and pass, "
            f"{1e9 * self.case_seconds_per_voxel:.0f} ns per case voxel) -> {self.epochs} epoch(s) x "
            f"{self.iterations_per_epoch} iterations, ending at ~{self.predicted_end_seconds:.0f} s "
            f"({100 * self.predicted_end_seconds / self.budget_seconds:.0f}%)"
        )


@dataclass(frozen=True)
class BudgetedRun:
    """What a ``TimeBudget`` plans: the run's configured ``epochs`` (the plan before the first decision),
    ``iterations_per_epoch`` (the most an epoch runs) and ``val_iterations`` (the pseudo-Dice's batches); its step's
    ``micro_batches`` (accumulation steps); its final validation, ``validation_cases`` (case id -> its work; {} if
    there is none, or on a rank that does not validate) with ``tta`` (the default ``--tta``) and the mirror
    ``tta_variants`` that gives."""

    epochs: int
    iterations_per_epoch: int
    val_iterations: int
    micro_batches: int
    validation_cases: Mapping[str, ValidationWork]
    tta: str
    tta_variants: int


class TimeBudget:
    """Plans epochs, iterations per epoch and the final validation so that the run ends within the budget.

    The trainer calls ``epoch_started``, ``iteration_done`` after every optimizer step and ``epoch_done``; each
    passes ``now`` from the run's clock, so tests drive it with fabricated times. With validation cases, it gives
    ``prediction_measured`` the prediction's rates before the first step, and again before an ``epoch_done`` where
    ``prediction_due``. ``started``: the clock when the run started (setup counts against the budget). ``run``: what
    it plans (``BudgetedRun``).
    """

    def __init__(self, budget_seconds: float, started: float, run: BudgetedRun) -> None:
        self.budget_seconds, self.started = float(budget_seconds), started
        self.plan = (run.epochs, run.iterations_per_epoch)  # in force: (epochs, iterations per epoch)
        self.iterations_per_epoch, self.val_iterations = run.iterations_per_epoch, run.val_iterations
        self.micro_batches = run.micro_batches
        self.validation_cases = dict(run.validation_cases)
        self.tta, self.tta_variants = run.tta, run.tta_variants
        self.validation = ValidationChoice(run.tta, tuple(sorted(self.validation_cases)), 0.0)
        self.prediction: PredictionRates | None = None  # the latest timing of this run's prediction
        self._timed_at = started
        self.decisions: list[BudgetDecision] = []
        self._seconds: list[float] = []  # of every iteration, warm-up included
        self._overheads: list[float] = []  # of every finished epoch: its time besides its iterations
        self._epochs_done = self._in_epoch = 0
        self._epoch_steps_seconds = 0.0  # the epoch's iterations after its first
        self._epoch_started = self._last = self._epoch_ended = started

    def prediction_due(self, now: float) -> bool:
        """Whether to time the prediction (again): never timed yet, or the time since the last timing is at least
        ``1 / TIMING_SHARE`` times what timing costs (a CPU shared with another process shows within a few epochs)."""
        if not self.validation_cases:
            return False
        return self.prediction is None or now - self._timed_at >= self.prediction.timing_seconds / TIMING_SHARE

    def prediction_measured(self, rates: PredictionRates, now: float) -> None:
        """The final validation is estimated from ``rates`` (timed up to ``now``) from the next check on."""
        self.prediction, self._timed_at = rates, now

    def epoch_started(self, now: float) -> None:
        """The time since the last ``epoch_done`` (the latest checkpoint) counts to that epoch's overhead."""
        if self._overheads:
            self._overheads[-1] += now - self._epoch_ended
        self._epoch_started = self._last = now
        self._in_epoch, self._epoch_steps_seconds = 0, 0.0

    def iteration_done(self, now: float) -> tuple[int, int] | None:
        """Returns the plan (epochs, iterations per epoch) at a check (after the warm-up and probe iterations,
        then every ``CHECK_EVERY``; the same iterations on every rank), None between checks."""
        self._seconds.append(now - self._last)
        self._epoch_steps_seconds += self._seconds[-1] if self._in_epoch else 0.0
        self._last = now
        self._in_epoch += 1
        since_probe = len(self._seconds) - WARMUP_ITERATIONS - PROBE_ITERATIONS
        if since_probe < 0 or since_probe % CHECK_EVERY:
            return None
        return self._check(now, f"iteration {self._in_epoch} of epoch {self._epochs_done}")

    def epoch_done(self, now: float) -> tuple[int, int]:
        """Measures the epoch's overhead: its time besides its iterations, the first one's excess over the rate
        included (the loader starting again); returns the plan from now on."""
        first = self.seconds_per_iteration() if self._in_epoch else 0.0
        self._overheads.append(max(0.0, now - self._epoch_started - self._epoch_steps_seconds - first))
        self._epoch_ended, self._in_epoch = now, 0
        self._epochs_done += 1
        return self._check(now, f"end of epoch {self._epochs_done - 1}")

    def seconds_per_iteration(self) -> float:
        """Median of the last ``RATE_WINDOW`` iteration times after the warm-up (the warm-up ones until then)."""
        steady = self._seconds[WARMUP_ITERATIONS:] or self._seconds
        return float(np.median(steady[-RATE_WINDOW:])) if steady else 0.0

    def epoch_overhead_seconds(self, seconds_per_iteration: float) -> float:
        """Mean measured overhead of the epochs run; before the first ends, the pseudo-Dice's validation iterations
        (a forward of one micro-batch each, a third of a step's share) + ``EPOCH_OVERHEAD_SECONDS``."""
        if self._overheads:
            return float(np.mean(self._overheads))
        return self.val_iterations * seconds_per_iteration / self.micro_batches / 3 + EPOCH_OVERHEAD_SECONDS

    def _remaining_seconds(self, plan: tuple[int, int], s: float, overhead: float) -> float:
        epochs, iterations = plan
        left = (epochs - self._epochs_done) * (iterations * s + overhead) - min(self._in_epoch, iterations) * s
        return max(left, 0.0)

    def _check(self, now: float, source: str) -> tuple[int, int]:
        """Keep the plan while its predicted end stays in ``KEEP_BAND`` and the validation choice holds; else a
        new plan aimed at ``TARGET_SHARE`` of the budget, recorded and logged."""
        s, elapsed = self.seconds_per_iteration(), now - self.started
        overhead = self.epoch_overhead_seconds(s)
        rates = self.prediction or PredictionRates(0.0, 0.0, 0.0)
        if self.validation_cases and self.prediction is None:
            raise RuntimeError("the time budget needs the prediction's rates (prediction_measured) before its checks")
        validation = choose_validation(
            self.validation_cases, rates, self.tta, self.tta_variants, VALIDATION_SHARE * self.budget_seconds
        )
        end = elapsed + self._remaining_seconds(self.plan, s, overhead) + validation.seconds
        same_validation = validation.case_ids == self.validation.case_ids and validation.tta == self.validation.tta
        if (
            self.decisions
            and same_validation
            and KEEP_BAND[0] * self.budget_seconds <= end <= KEEP_BAND[1] * self.budget_seconds
        ):
            return self.plan
        left = TARGET_SHARE * self.budget_seconds - elapsed - validation.seconds
        minimum = 1 if self._in_epoch or not self._epochs_done else 0
        more, iterations = plan_epochs(left, s, overhead, self.iterations_per_epoch, self._in_epoch, minimum)
        plan = (self._epochs_done + more, iterations if more else self.plan[1])  # more == 0: the run ends here
        end = elapsed + self._remaining_seconds(plan, s, overhead) + validation.seconds
        if self.decisions and plan == self.plan and same_validation:
            return self.plan
        self.plan, self.validation = plan, validation
        decision = BudgetDecision(
            source,
            plan[0],
            plan[1],
            self.budget_seconds,
            elapsed,
            s,
            overhead,
            validation.seconds,
            validation.tta,
            validation.case_ids,
            end,
            rates.window_seconds_per_voxel,
            rates.case_seconds_per_voxel,
        )
        self.decisions.append(decision)
        log.info(decision.describe(len(self.validation_cases)))
        return plan
