"""The CPU calibration's fit: a FLOP rate and an element rate (``StepRates``) from timed training steps, by
non-negative least squares, and whether the steps identify them (``RateFit.refusal``).

A step of ``flops`` convolution FLOPs over ``elements`` feature-map elements takes ``flops / flop_rate + elements /
element_rate`` seconds (``StepRates.seconds``; the calibration steps map no fresh pages). Each step's equation is
divided by its own seconds, so the fit weighs every step's relative error alike (a short 2D step counts as much as
a long 3D one). A plan whose FLOPs per element lie between the steps' is predicted within the steps' own
disagreement with the fit: its (FLOPs, elements) is a positive combination of theirs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoseg.plan.throughput import StepRates

MIN_STEPS = 3  # two steps fit two rates exactly, so no timing could contradict the fit
MAX_DISAGREEMENT = 0.15  # a step's seconds vs the fit's, relative: above it the rates are not kept
# the relative spread of a step's best time between calibrations on a quiet machine (best of 5 runs): the least
# noise a rate's uncertainty assumes, so that a fit that happens to leave no residual is not taken as exact
TIMING_NOISE = 0.03
MAX_RATE_UNCERTAINTY = 0.25  # a rate's relative standard error: above it the steps do not identify that rate


@dataclass(frozen=True)
class RateFit:
    """The fitted rates (``flops_per_second``, ``elements_per_second``: 0 where the fit leaves that term none), each
    step's ``disagreement`` (predicted / measured seconds - 1) and each rate's relative ``uncertainty`` (inf where
    the fit leaves it none)."""

    step_names: tuple[str, ...]
    flops_per_second: float
    elements_per_second: float
    disagreement: tuple[float, ...]
    uncertainty: tuple[float, float]

    def rates(self, mapped_bytes_per_second: float | None = None) -> StepRates:
        """The rates, each rounded to 2 significant digits (+-5% noise rarely changes the plan); an element rate the
        fit left none is None (the convolutions alone)."""
        elements = float(f"{self.elements_per_second:.2g}") if self.elements_per_second > 0 else None
        return StepRates(float(f"{self.flops_per_second:.2g}"), elements, mapped_bytes_per_second)

    def refusal(self) -> str:
        """Why these rates are not to be trusted ("" when they are): too few steps, a rate the fit leaves none or
        cannot pin down (steps too alike in FLOPs per element, or timings too noisy), or a step's seconds off the
        fit by more than ``MAX_DISAGREEMENT``."""
        if len(self.step_names) < MIN_STEPS:
            return f"{len(self.step_names)} timed steps fit 2 rates exactly, so no timing can contradict them"
        names = ("FLOP", "feature-map element")
        for name, uncertainty in zip(names, self.uncertainty):
            if math.isinf(uncertainty):
                return f"the fit leaves no {name} rate (the steps' seconds do not grow with that work)"
        worst = int(np.argmax(np.abs(self.disagreement)))
        if abs(self.disagreement[worst]) > MAX_DISAGREEMENT:
            return (
                f"step {self.step_names[worst]} took {1 / (1 + self.disagreement[worst]):.2f}x the seconds the fit "
                f"predicts (more than {MAX_DISAGREEMENT:.0%} off)"
            )
        for name, uncertainty in zip(names, self.uncertainty):
            if uncertainty > MAX_RATE_UNCERTAINTY:
                return (
                    f"the {name} rate is not identified (+-{uncertainty:.0%}, more than "
                    f"{MAX_RATE_UNCERTAINTY:.0%}: the steps' seconds do not separate it from the other)"
                )
        return ""


def fit_rates(
    step_names: Sequence[str], flops: Sequence[float], elements: Sequence[float], seconds: Sequence[float]
) -> RateFit:
    """The FLOP and element rates that best reproduce each step's ``seconds`` (relative least squares, both
    per-unit costs >= 0; ``scipy.optimize.nnls``). A rate's uncertainty is its standard error from the fit's
    residual, at least ``TIMING_NOISE``, relative to the rate."""
    from scipy.optimize import nnls

    design = np.column_stack([flops, elements]).astype(np.float64)
    measured = np.asarray(seconds, dtype=np.float64)
    relative = design / measured[:, None]
    costs, _ = nnls(relative, np.ones(len(measured)))
    disagreement = design @ costs / measured - 1.0
    dof = len(measured) - 2
    noise = max(math.sqrt(float(disagreement @ disagreement) / dof), TIMING_NOISE) if dof > 0 else TIMING_NOISE
    spread = np.sqrt(np.diag(np.linalg.pinv(relative.T @ relative)))
    uncertainty = tuple(float(noise * s / c) if c > 0 else math.inf for s, c in zip(spread, costs))
    return RateFit(
        tuple(step_names),
        float(1.0 / costs[0]) if costs[0] > 0 else 0.0,
        float(1.0 / costs[1]) if costs[1] > 0 else 0.0,
        tuple(float(d) for d in disagreement),
        (uncertainty[0], uncertainty[1]),
    )
