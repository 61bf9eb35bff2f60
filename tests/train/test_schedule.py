"""The time budget plans from the times it is given: every test passes fabricated clock readings.

The simulated runs drive ``TimeBudget`` the way the trainer does (the prediction timed before the first step and at
epoch ends where ``prediction_due``, ``epoch_started``, ``iteration_done`` after every step, ``epoch_done``) and pay
the final validation at the end at the prediction's rates of the moment: what they check is the control (warm-up,
re-estimates, shortened epochs, a reduced validation), not the timing's accuracy, which the benchmark measures
(benchmarks/time_budget.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from autoseg.train.schedule import (
    MIN_ITERATIONS_PER_EPOCH,
    TIMING_SHARE,
    BudgetedRun,
    PredictionRates,
    TimeBudget,
    ValidationWork,
    choose_validation,
    final_validation_seconds,
    plan_epochs,
)

# 8 validation cases of 125 tiles of 32 x 64 x 64 (a 96 x 192 x 192 image). While a training step takes 1 s, a tile's
# pass takes 0.24 s and the rest of a case 1.25 s: 31.25 s a case without mirroring, 121.25 s with the CPU's 4 mirror
# variants, 970 s in all, far over a quarter of 720 s
WORK = ValidationWork(tiles=125, tile_voxels=32 * 64 * 64, voxels=96 * 192 * 192)
CASES = {f"case_{i:02d}": WORK for i in range(8)}
TTA, VARIANTS = "4", 4


def _rates(step_s: float, slower: float = 1.0) -> PredictionRates:
    """The prediction's rates while a training step takes ``step_s`` (a pass 0.24 s, a case's rest 1.25 s at 1 s a
    step), ``slower`` times slower; timing them is the passes of one tile."""
    pass_s, rest_s = 0.24 * step_s * slower, 1.25 * step_s * slower
    return PredictionRates(pass_s / WORK.tile_voxels, rest_s / WORK.voxels, VARIANTS * pass_s)


def _budget(budget_s: float, cases: dict = CASES, ipe: int = 250, val_iterations: int = 50) -> TimeBudget:
    run = BudgetedRun(
        1000,
        ipe,
        val_iterations,
        micro_batches=1,
        validation_cases=cases,
        tta=TTA,
        tta_variants=VARIANTS,
    )
    return TimeBudget(budget_s, 0.0, run)


def _time_prediction(budget: TimeBudget, now: float, rates: PredictionRates) -> float:
    """The trainer's ``time_prediction`` on the simulated clock: where due, the timing's seconds pass."""
    if budget.prediction_due(now):
        now += rates.timing_seconds
        budget.prediction_measured(rates, now)
    return now


def _simulate(
    budget: TimeBudget,
    step_seconds: Callable[[float, int], float],
    setup_s: float = 5.0,
    overhead_s: float = 0.4,
    slower: float = 1.0,
) -> tuple[float, list[int]]:
    """Run ``budget``'s plan on a simulated clock: ``step_seconds(now, step index)`` per iteration, the prediction
    at ``_rates`` of the step's time (``slower`` times slower); per epoch the pseudo-Dice (``val_iterations``
    forwards, a third of a step each) and ``overhead_s`` (checkpoints, plot). Returns (the time the final
    validation ends, the iterations each epoch ran)."""
    now, epoch, steps, ran = setup_s, 0, 0, []
    now = _time_prediction(budget, now, _rates(step_seconds(now, 2), slower))
    epochs, ipe = budget.plan
    while epoch < epochs:
        budget.epoch_started(now)
        it = 0
        while it < ipe:
            now += step_seconds(now, steps)
            steps, it = steps + 1, it + 1
            plan = budget.iteration_done(now)
            epochs, ipe = plan or (epochs, ipe)
        ran.append(it)
        now += budget.val_iterations * step_seconds(now, steps) / 3 + overhead_s
        now = _time_prediction(budget, now, _rates(step_seconds(now, steps), slower))
        epochs, ipe = budget.epoch_done(now)
        now += 0.1  # the latest checkpoint, after the decision
        epoch += 1
    choice = budget.validation
    variants = VARIANTS if choice.tta == TTA else 1
    work = [budget.validation_cases[c] for c in choice.case_ids]
    return now + final_validation_seconds(work, _rates(step_seconds(now, steps), slower), variants), ran


def _warm_then(seconds: float, warmup_s: float = 2.4) -> Callable[[float, int], float]:
    return lambda now, step: warmup_s if step < 2 else seconds


def test_the_reported_run_ends_within_its_budget_with_shorter_epochs_and_a_reduced_validation() -> None:
    """The run a user saw: 12 min, 250 iterations per epoch, 2.4 s warm-up iterations then 1 s, a validation
    costing more than the budget. It decided 1 epoch x 250 and a 1328 s validation; it must end in 684-756 s."""
    budget = _budget(720.0)
    end, ran = _simulate(budget, _warm_then(1.0))
    assert 0.85 * 720 <= end <= 1.05 * 720
    assert budget.decisions[0].seconds_per_iteration == 1.0  # the warm-up left out
    assert ran[-1] < 250 and all(n < 250 for n in ran)  # epochs shortened to fill the time
    # no mirroring, then the first cases in sorted order that fit in a quarter of the budget (180 s / 31.25 s)
    assert budget.validation.tta == "none" and budget.validation.case_ids == tuple(sorted(CASES)[:5])
    first = budget.decisions[0].to_dict()
    assert first["validation_tta"] == "none" and first["validation_cases"] == sorted(CASES)[:5]
    assert first["source"] == "iteration 5 of epoch 0" and first["iterations_per_epoch"] < 250


def test_a_run_that_slows_down_halfway_still_ends_within_5_percent() -> None:
    """Another process takes half the CPU at t = 300 s: iterations take 2 s from then on (and the final
    validation too). The plan is re-estimated within a check or two and shortened."""
    budget = _budget(720.0)
    end, ran = _simulate(budget, lambda now, step: 2.4 if step < 2 else 1.0 if now < 300 else 2.0)
    assert 0.85 * 720 <= end <= 1.05 * 720
    assert budget.decisions[-1].seconds_per_iteration == 2.0
    assert len(budget.validation.case_ids) < 5  # the validation shrinks with the rate


def test_a_run_that_speeds_up_is_lengthened() -> None:
    """The other process stops at t = 200 s: iterations take 1 s instead of 2 s; more iterations are planned."""
    budget = _budget(720.0, cases={})
    end, _ = _simulate(budget, lambda now, step: 2.4 if step < 2 else 2.0 if now < 200 else 1.0)
    assert 0.85 * 720 <= end <= 1.05 * 720
    first, last = budget.decisions[0], budget.decisions[-1]
    assert last.epochs * last.iterations_per_epoch > first.epochs * first.iterations_per_epoch


@pytest.mark.parametrize(
    ("budget_s", "seconds", "ipe"),
    [
        (60.0, 0.05, 250),
        (300.0, 0.3, 250),
        (720.0, 1.0, 250),
        (3600.0, 1.7, 250),
        (7200.0, 0.4, 250),
        (900.0, 3.0, 50),
    ],
)
def test_simulated_runs_use_85_to_105_percent_of_the_budget(budget_s: float, seconds: float, ipe: int) -> None:
    budget = _budget(budget_s, ipe=ipe)
    end, ran = _simulate(budget, _warm_then(seconds, warmup_s=3 * seconds))
    assert 0.85 * budget_s <= end <= 1.05 * budget_s, (end, ran, budget.decisions)
    assert all(n >= MIN_ITERATIONS_PER_EPOCH for n in ran)


def test_the_first_decision_leaves_out_the_warm_up_and_takes_the_median() -> None:
    budget = _budget(720.0, cases={})
    budget.epoch_started(10.0)
    plans = [budget.iteration_done(now) for now in (15.0, 20.0, 21.0, 23.0, 24.0)]  # 5 s, 5 s, then 1, 2, 1
    assert plans[:4] == [None] * 4 and plans[4] is not None
    assert budget.seconds_per_iteration() == 1.0
    # 684 s aimed at, 24 s spent: 660 s + the 5 iterations done = 665 s of 1 s iterations and 50 / 3 + 0.3 s
    # per epoch: ceil(665 / 266.97) = 3 epochs of floor(665 / 3 - 16.97) = 204 iterations
    assert plans[4] == (3, 204)
    assert [budget.iteration_done(24.0 + k) for k in range(1, 10)] == [None] * 9  # the next check: 10 later
    assert budget.iteration_done(34.0) == (3, 204)  # on time: kept, no new decision
    assert len(budget.decisions) == 1


def test_decisions_are_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    budget = _budget(720.0)
    with caplog.at_level(logging.INFO, logger="autoseg.train.trainer"):
        _simulate(budget, _warm_then(1.0))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time budget")]
    assert len(lines) == len(budget.decisions) >= 1 and all("\n" not in line for line in lines)
    assert "1.000 s/iteration" in lines[0] and "tta none, 5 of 8 cases" in lines[0] and "iterations" in lines[0]


def test_plan_epochs_fills_the_time_with_shortened_epochs() -> None:
    # 510 s, 1 s iterations, 8 s per epoch besides: 2 epochs of 250 would leave 500 - 516 < 0: ceil -> 2 epochs,
    # shortened to floor(255 - 8) = 247 iterations
    assert plan_epochs(510.0, 1.0, 8.0, 250, 0, 1) == (2, 247)
    # 5 iterations of the epoch in progress are paid already: counted in the room
    assert plan_epochs(505.0, 1.0, 8.0, 250, 5, 1) == (2, 247)
    # plenty of time: the configured length, the last bit of time spread over the epochs
    assert plan_epochs(10_000.0, 1.0, 10.0, 250, 0, 1) == (39, 246)
    # not even one epoch of the floor: one epoch of the floor while one is in progress, none at an epoch's end
    assert plan_epochs(5.0, 1.0, 8.0, 250, 0, 1) == (1, MIN_ITERATIONS_PER_EPOCH)
    assert plan_epochs(-3.0, 1.0, 8.0, 250, 0, 0) == (0, 250)
    # 45 s of 12-iteration epochs (20 s each) need 3, but 3 of 15 s leave 7 iterations, under the floor: 2 epochs
    # of floor(45 / 2 - 8) = 14, capped at the configured 12
    assert plan_epochs(45.0, 1.0, 8.0, 12, 0, 0) == (2, 12)
    assert plan_epochs(60.0, 1.0, 8.0, 250, 0, 0) == (1, 52)  # one epoch filled to 60 - 8 s
    assert plan_epochs(30.0, 1.0, 0.5, 4, 0, 1) == (6, 4)  # a configured length under the floor is never shortened


def test_choose_validation_drops_mirroring_then_cases() -> None:
    rates = _rates(1.0)
    assert final_validation_seconds([WORK], rates, 1) == pytest.approx(125 * 0.24 + 1.25)
    assert final_validation_seconds([WORK], rates, VARIANTS) == pytest.approx(4 * 125 * 0.24 + 1.25)
    full = choose_validation(CASES, rates, TTA, VARIANTS, 970.0)
    assert (full.tta, len(full.case_ids), full.seconds) == (TTA, 8, pytest.approx(970.0))
    no_tta = choose_validation(CASES, rates, TTA, VARIANTS, 969.0)
    assert (no_tta.tta, len(no_tta.case_ids), no_tta.seconds) == ("none", 8, pytest.approx(250.0))
    subset = choose_validation(CASES, rates, TTA, VARIANTS, 100.0)
    assert (subset.tta, subset.case_ids) == ("none", ("case_00", "case_01", "case_02"))
    assert choose_validation(CASES, rates, TTA, VARIANTS, 1.0).case_ids == ("case_00",)  # at least one
    assert choose_validation({}, rates, TTA, VARIANTS, 0.0).case_ids == ()


def test_the_estimate_follows_the_measured_prediction_rate_not_the_training_step() -> None:
    """Two runs with the same 1 s steps: one whose prediction was timed at 0.15 of the other's seconds. The estimate
    is the measured rates times each case's work: the fast one keeps every case and the mirroring (145.5 s within a
    quarter of 720 s), the slow one drops the mirroring and cases (970 s)."""
    fast, slow = _budget(720.0), _budget(720.0)
    for budget, slower in ((fast, 0.15), (slow, 1.0)):
        budget.prediction_measured(_rates(1.0, slower), 5.0)
        budget.epoch_started(5.0)
        for k in range(5):
            budget.iteration_done(5.0 + 2.4 * min(k + 1, 2) + max(0, k - 1))
    quick, measured = fast.decisions[0], slow.decisions[0]
    assert quick.final_validation_seconds == pytest.approx(8 * (4 * 125 * 0.15 * 0.24 + 0.15 * 1.25)) == 145.5
    assert (quick.validation_tta, len(quick.validation_cases)) == (TTA, 8)
    assert measured.validation_tta == "none" and len(measured.validation_cases) == 5
    assert quick.window_seconds_per_voxel == pytest.approx(0.15 * 0.24 / WORK.tile_voxels)
    assert quick.case_seconds_per_voxel == pytest.approx(0.15 * 1.25 / WORK.voxels)


def test_a_prediction_timed_slower_at_an_epoch_end_shrinks_the_validation() -> None:
    """The training steps keep their speed, but the prediction is timed 3 times slower at the end of epoch 0 (another
    process took the CPU during the timing): the next decision estimates from the new rates, 436.5 s with the
    mirroring instead of 145.5 s, and drops the mirroring."""
    budget = _budget(720.0, ipe=50)
    budget.prediction_measured(_rates(1.0, 0.15), 5.0)
    budget.epoch_started(5.0)
    now = 5.0
    for _ in range(50):
        now += 1.0
        budget.iteration_done(now)
    before = budget.decisions[-1]
    now += 30.0  # past 20 times the timing's 0.144 s: due
    assert budget.prediction_due(now)
    budget.prediction_measured(_rates(1.0, 0.45), now + 0.5)
    budget.epoch_done(now + 0.5)
    after = budget.decisions[-1]
    assert after.source == "end of epoch 0"
    assert after.window_seconds_per_voxel == pytest.approx(3 * before.window_seconds_per_voxel)
    assert (before.validation_tta, after.validation_tta) == (TTA, "none")
    assert after.final_validation_seconds == pytest.approx(8 * (125 * 0.45 * 0.24 + 0.45 * 1.25))


def test_the_prediction_is_timed_again_when_timing_costs_at_most_its_share() -> None:
    budget = _budget(720.0)
    assert budget.prediction_due(0.0)  # never timed
    rates = _rates(1.0)  # timing: 4 passes of 0.24 s
    budget.prediction_measured(rates, 10.0)
    due_after = rates.timing_seconds / TIMING_SHARE
    assert not budget.prediction_due(10.0 + due_after - 0.01)
    assert budget.prediction_due(10.0 + due_after)
    assert not _budget(720.0, cases={}).prediction_due(0.0)  # no final validation: nothing to time


def test_a_check_without_the_prediction_timed_is_refused() -> None:
    budget = _budget(720.0)
    budget.epoch_started(0.0)
    with pytest.raises(RuntimeError, match="prediction_measured"):
        for k in range(5):
            budget.iteration_done(float(k + 1))
