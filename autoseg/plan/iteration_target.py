"""How long one CPU training iteration is planned to take: ``iteration_target`` chooses it from the time budget
training will have (``autoseg plan --time-budget T``) by a measured rule, or takes it as given
(``--seconds-per-iteration``), or keeps the default; the planner sizes every CPU configuration's patch, batch and
width so that the step's *predicted* seconds stay within it (``autoseg.plan.configuration.step_limits``), and
plans.json records the target, the budget and the reason (``Plans.iteration``).

The rule (issue 28; the sweep behind it: docs/benchmarks.md "Seconds per iteration from the time budget"). Within a
time budget, accuracy on thin and small structures is decided by the number of iterations before the patch size, so
the plan aims at ``MIN_ITERATIONS`` iterations within the share of the budget the steps get (``STEP_SHARE``: the
rest is the loader's start, patch validation, checkpoints and the final validation), and only a longer budget lets
the iteration grow beyond that, up to ``MAX_SECONDS`` (a longer budget runs more iterations of it):

    seconds = min(MAX_SECONDS, STEP_SHARE * T / MIN_ITERATIONS)

CUDA plans are sized by memory (a GPU step takes a fraction of a second): the target applies to CPU training only.
A plan for another budget changes patches, batches and widths, not the target spacing of 3d_fullres and 2d, so
``autoseg plan_and_preprocess --time-budget T --overwrite`` keeps their preprocessed cases
(``autoseg.preprocess.plan_fields``); 3d_lowres's spacing follows the full-resolution patch, so its cases may be
redone.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError
from autoseg.core.units import format_duration

DEFAULT_SECONDS = 1.0  # no time budget given
MAX_SECONDS = DEFAULT_SECONDS  # the rule's longest step: the longest target the sweep measured
# the fewest iterations a budget's plan aims at: the small-structures sweep (docs/benchmarks.md): at 30 minutes 2794
# iterations of 16x64x64 learnt the lesions (Dice 0.87) where 2449 of 16x80x80 and 1980 of 20x80x80 did not (0.62-0.77
# only with the decision weights), 901 of 20x80x80 in 15 minutes learnt neither lesions nor most tubes
MIN_ITERATIONS = 3000
# the share of a time budget a run spends in training steps: 1980 steps x 0.77 s of a 30-minute run (0.85); 720 x
# 0.86 s of 12 minutes (0.86); the rest is the loader's start, patch validation, checkpoints, the final validation
STEP_SHARE = 0.85
# a run's time budget asks for another plan when the rule's target differs from the plan's by more than this share
REPLAN_TOLERANCE = 0.15


@dataclass(frozen=True)
class IterationTarget:
    """The seconds one CPU training iteration may take, why (``reason``, recorded in plans.json and printed), and the
    time budget it was chosen for (None: none given)."""

    seconds: float
    reason: str
    time_budget_seconds: float | None = None

    @property
    def given(self) -> bool:
        """Whether the seconds were given by hand (``--seconds-per-iteration``), not chosen by the rule or default."""
        return self.time_budget_seconds is None and self.seconds != DEFAULT_SECONDS


def iteration_target(time_budget_seconds: float | None = None, seconds: float | None = None) -> IterationTarget:
    """The target for a run of ``time_budget_seconds`` (None: no budget), or ``seconds`` where the user gave them."""
    for name, value in (("time budget", time_budget_seconds), ("seconds per iteration", seconds)):
        if value is not None and not value > 0:
            raise InputError(f"the {name} to plan for must be positive; got {value}")
    if seconds is not None:
        return IterationTarget(seconds, f"{seconds:g} s per iteration as given (--seconds-per-iteration)")
    if time_budget_seconds is None:
        return IterationTarget(
            DEFAULT_SECONDS,
            f"no time budget given: the default {DEFAULT_SECONDS:g} s per iteration (plan with --time-budget to size "
            "the patch for the run's length)",
        )
    fit = STEP_SHARE * time_budget_seconds / MIN_ITERATIONS
    share = f"{MIN_ITERATIONS} iterations in {STEP_SHARE:.0%} of the {format_duration(time_budget_seconds)} time budget"
    if fit >= MAX_SECONDS:
        reason = f"{share} would allow {fit:.2f} s each; held at {MAX_SECONDS:g} s, so the run has more iterations"
        return IterationTarget(MAX_SECONDS, reason, time_budget_seconds)
    return IterationTarget(fit, f"{share}: {fit:.2f} s each", time_budget_seconds)


DEFAULT_TARGET = iteration_target()


def replan_note(planned: IterationTarget, time_budget_seconds: float, dataset: str, workspace: str) -> str | None:
    """What to say when a CPU run of ``time_budget_seconds`` trains a plan whose iterations were sized to ``planned``
    while the rule aims elsewhere by more than ``REPLAN_TOLERANCE`` (the command names the workspace's ``dataset``);
    None when the plan fits the budget or its target was given by hand."""
    target = iteration_target(time_budget_seconds)
    if planned.given or abs(target.seconds / planned.seconds - 1) <= REPLAN_TOLERANCE:
        return None
    budget = format_duration(time_budget_seconds)
    return (
        f"the plan sized an iteration to {planned.seconds:.2f} s ({planned.reason}); for this {budget} budget the "
        f"rule aims at {target.seconds:.2f} s ({target.reason}). Training goes on with the plan as it is; to size it "
        f"for this budget, plan again with the flags it was planned with (--architecture, --ram, ...) and `autoseg "
        f"plan_and_preprocess {dataset} -w {workspace} --device cpu --time-budget {budget} --overwrite` (3d_fullres' "
        "preprocessed cases are kept; trained folds of a changed plan are moved aside)"
    )
