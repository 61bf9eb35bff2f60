"""The time budget decides epochs from the times it is given: every test passes fabricated clock readings."""

from __future__ import annotations

import pytest

from autoseg.train.schedule import TimeBudget, final_validation_seconds

# Budget 100 s, the run started at t = 90 s and its first epoch at t = 100 s (10 s of setup); 10 iterations
# and 4 validation iterations per epoch, micro-batch 2, no accumulation, one validation case of (12, 28, 28)
# with (8, 16, 16) patches: 2 x 3 x 3 = 18 tiles.
STARTED, EPOCH_STARTED = 90.0, 100.0


def _budget(probe_iterations: int = 3, iterations_per_epoch: int = 10) -> TimeBudget:
    return TimeBudget(100.0, STARTED, iterations_per_epoch, 4, micro_batches=1, batch_size=2,
                      patch_size=(8, 16, 16), validation_case_shapes=[(12, 28, 28)],
                      probe_iterations=probe_iterations)


def test_first_decision_after_the_probe_iterations_leaves_out_the_warm_up() -> None:
    budget = _budget()
    # a slow warm-up iteration (1 s), then 0.5 s each
    assert budget.iteration_done(101.0, EPOCH_STARTED) is None
    assert budget.iteration_done(101.5, EPOCH_STARTED) is None
    assert budget.iteration_done(102.0, EPOCH_STARTED) == 12
    assert budget.iteration_done(102.5, EPOCH_STARTED) is None  # decided once
    assert budget.seconds_per_iteration == 0.5  # (102 - 101) / 2: not (102 - 100) / 3
    # final validation: 18 tiles x 8 mirrorings x 0.25 s per sample step / 3, x 1.5 = 18 s
    assert budget.final_seconds == pytest.approx(18.0)
    (decision,) = budget.decisions
    # an epoch: 10 x 0.5 s + 4 validation iterations x 0.5 / 3 s + 0.3 s overhead = 5.967 s; 12 s spent,
    # 0.7 of the first epoch left (4.18 s), 18 s kept for the final validation: 65.8 s hold 11 more epochs
    assert decision.source == "first iterations" and decision.elapsed_seconds == 12.0
    assert decision.seconds_per_epoch == pytest.approx(5.0 + 2.0 / 3.0 + 0.3)
    assert decision.epochs == 12


def test_one_probe_iteration_is_timed_from_the_epoch_start() -> None:
    budget = _budget(probe_iterations=1, iterations_per_epoch=1)
    epochs = budget.iteration_done(102.0, EPOCH_STARTED)
    assert budget.seconds_per_iteration == 2.0
    # epoch: 2 s + 4 x 2 / 3 s + 0.3 s = 4.967 s; final validation 18 x 8 x 1 / 3 x 1.5 = 72 s;
    # 100 - 12 - 72 = 16 s after the first epoch: 3 more epochs
    assert budget.final_seconds == pytest.approx(72.0)
    assert epochs == 4


def test_first_epoch_sets_the_schedule_later_epochs_only_shorten_it() -> None:
    budget = _budget()
    for now in (101.0, 101.5, 102.0):
        budget.iteration_done(now, EPOCH_STARTED)
    # epoch 0 took 8 s (t = 110): 100 - 20 - 18 = 62 s hold 7 more -> 8, fewer than the first guess of 12
    assert budget.epoch_done(0, 8.0, 110.0, epochs=12) == 8
    assert budget.epoch_done(1, 8.0, 118.0, epochs=8) == 8  # on schedule: no new decision
    assert len(budget.decisions) == 2
    # epoch 2 took 14 s: mean 10 s, 100 - 42 - 18 = 40 s hold 4 more -> 7
    assert budget.epoch_done(2, 14.0, 132.0, epochs=8) == 7
    # epoch 3 took 2 s: mean 8 s would allow 8, but the schedule is never lengthened after the first epoch
    assert budget.epoch_done(3, 2.0, 134.0, epochs=7) == 7
    assert [(d.source, d.epochs, d.elapsed_seconds, d.seconds_per_epoch) for d in budget.decisions] == [
        ("first iterations", 12, 12.0, pytest.approx(5.0 + 2.0 / 3.0 + 0.3)),
        ("first epoch", 8, 20.0, 8.0),
        ("epoch 2", 7, 42.0, 10.0),
    ]


def test_over_budget_finishes_the_epochs_started() -> None:
    budget = _budget()
    for now in (101.0, 101.5, 102.0):
        budget.iteration_done(now, EPOCH_STARTED)
    assert budget.epoch_done(0, 8.0, 110.0, epochs=12) == 8
    assert budget.epoch_done(1, 80.0, 190.0, epochs=8) == 2  # 100 s spent after 2 epochs: stop there


@pytest.mark.parametrize(("setup_s", "seconds_per_iteration"), [(0.0, 0.05), (7.0, 0.05), (3.0, 0.3), (1.0, 1.7)])
def test_simulated_run_ends_within_the_budget_and_no_epoch_more_would_fit(
        setup_s: float, seconds_per_iteration: float) -> None:
    """A run at constant speed, timed by a simulated clock: iterations, then validation iterations (a third of
    a training step each) and a 0.3 s checkpoint per epoch. Training plus the estimated final validation fit
    the budget; one epoch more would not."""
    budget_s, ipe, val_iterations, shapes, patch = 200.0, 10, 4, [(12, 28, 28)], (8, 16, 16)
    budget = TimeBudget(budget_s, 0.0, ipe, val_iterations, 1, 2, patch, shapes)
    epoch_s = ipe * seconds_per_iteration + val_iterations * seconds_per_iteration / 3 + 0.3
    now, epochs, epoch = setup_s, 10**6, 0
    while epoch < epochs:
        epoch_started = now
        for _ in range(ipe):
            now += seconds_per_iteration
            if epoch == 0:
                decided = budget.iteration_done(now, epoch_started)
                epochs = epochs if decided is None else decided
        now += epoch_s - ipe * seconds_per_iteration
        epochs = budget.epoch_done(epoch, now - epoch_started, now, epochs)
        epoch += 1
    final_s = final_validation_seconds(shapes, patch, seconds_per_iteration / 2)
    assert epochs >= 1 and budget.final_seconds == pytest.approx(final_s)
    assert now + final_s <= budget_s + 1e-9 < now + epoch_s + final_s
