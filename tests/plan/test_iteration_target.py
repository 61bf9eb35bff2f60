"""The seconds a CPU training iteration is sized to: the time budget's rule (at least MIN_ITERATIONS in STEP_SHARE of
the budget, never longer than MAX_SECONDS), a given target, the default, and the note a run gets when its budget asks
for another plan."""

from __future__ import annotations

import pytest

from autoseg.core.errors import InputError
from autoseg.plan.iteration_target import (
    DEFAULT_SECONDS,
    DEFAULT_TARGET,
    MAX_SECONDS,
    MIN_ITERATIONS,
    STEP_SHARE,
    iteration_target,
    replan_note,
)


def test_a_budget_gets_the_iterations_the_rule_asks_for() -> None:
    for budget in (120.0, 900.0, 1800.0):
        target = iteration_target(budget)
        assert target.seconds * MIN_ITERATIONS == pytest.approx(STEP_SHARE * budget)
        assert target.time_budget_seconds == budget
    assert iteration_target(1800.0).seconds == pytest.approx(0.51)
    assert "3000 iterations in 85% of the 30m time budget: 0.51 s each" in iteration_target(1800.0).reason


def test_a_long_budget_runs_more_iterations_at_the_longest_measured_step() -> None:
    target = iteration_target(7200.0)
    assert target.seconds == MAX_SECONDS
    assert "of the 2h time budget" in target.reason and "held at 1 s" in target.reason
    assert "of the 1h30m time budget" in iteration_target(5400.0).reason


def test_given_seconds_and_no_budget() -> None:
    assert iteration_target(1800.0, seconds=0.5).seconds == 0.5
    assert "--seconds-per-iteration" in iteration_target(seconds=0.5).reason
    default = iteration_target()
    assert (default.seconds, default.time_budget_seconds) == (DEFAULT_SECONDS, None)
    assert "--time-budget" in default.reason


@pytest.mark.parametrize(("budget", "seconds"), [(0.0, None), (-60.0, None), (None, 0.0), (None, float("nan"))])
def test_a_target_that_is_not_positive_is_refused(budget, seconds) -> None:
    with pytest.raises(InputError, match="must be positive"):
        iteration_target(budget, seconds)


def test_a_run_whose_budget_asks_for_another_plan_is_told_how_to_plan_for_it() -> None:
    planned = iteration_target(1800.0)
    assert replan_note(planned, 1800.0, "/data", "/ws") is None
    assert replan_note(planned, 1700.0, "/data", "/ws") is None  # within the tolerance
    note = replan_note(planned, 600.0, "/data", "/ws")
    assert note is not None
    assert "autoseg plan_and_preprocess /data -w /ws --device cpu --time-budget 10m --overwrite" in note
    assert "0.51 s" in note and "0.17 s" in note
    assert replan_note(DEFAULT_TARGET, 7200.0, "/data", "/ws") is None  # a long budget's rule: the default 1 s
    assert "no time budget given" in replan_note(DEFAULT_TARGET, 900.0, "/data", "/ws")


def test_a_target_given_by_hand_is_not_second_guessed() -> None:
    given = iteration_target(seconds=2.5)
    assert given.given and not iteration_target(1800.0).given and not DEFAULT_TARGET.given
    assert replan_note(given, 900.0, "/data", "/ws") is None
