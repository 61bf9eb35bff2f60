"""The CPU calibration's fit (``autoseg.plan.rate_fit``): the rates of timed steps by non-negative least squares, and
the refusal of rates the steps do not identify. The timings are those of machines of the rates measured on this
project's 2-core machine (docs/benchmarks.md): quiet, 380-680 GFLOP/s and 110-170 M elements/s; the absurd figures
kept before the fit had three steps (issue 26): 4,000 GFLOP/s and 47 M elements/s on a busy machine, 150 GFLOP/s and
no element rate on a quiet one."""

from __future__ import annotations

import pytest

from autoseg.plan.calibration import CALIBRATION_STEPS
from autoseg.plan.rate_fit import MAX_DISAGREEMENT, fit_rates
from autoseg.plan.throughput import StepRates

NAMES = [s.name for s in CALIBRATION_STEPS]
FLOPS = [s.flops for s in CALIBRATION_STEPS]
ELEMENTS = [s.elements for s in CALIBRATION_STEPS]


def _seconds(rates: StepRates, noise: tuple[float, ...] = (1.0, 1.0, 1.0)) -> list[float]:
    """Each calibration step's seconds on a machine of ``rates``, times ``noise``."""
    return [rates.seconds(f, e) * n for f, e, n in zip(FLOPS, ELEMENTS, noise)]


@pytest.mark.parametrize("flop_rate", [380e9, 680e9])
@pytest.mark.parametrize("element_rate", [110e6, 170e6])
@pytest.mark.parametrize(
    "noise", [(1.0, 1.0, 1.0), (1.03, 0.97, 1.03), (0.97, 1.03, 0.97)], ids=["exact", "+-3", "-+3"]
)
def test_quiet_timings_are_kept_with_the_machine_s_rates(
    flop_rate: float, element_rate: float, noise: tuple[float, ...]
) -> None:
    """Timings of a quiet machine anywhere in the measured range, each step off by up to 3% (the spread of a step's
    best time between quiet calibrations): kept, each rate within 5% of the machine's."""
    fit = fit_rates(NAMES, FLOPS, ELEMENTS, _seconds(StepRates(flop_rate, element_rate), noise))
    assert fit.refusal() == ""
    assert fit.flops_per_second == pytest.approx(flop_rate, rel=0.05)
    assert fit.elements_per_second == pytest.approx(element_rate, rel=0.05)
    assert max(abs(d) for d in fit.disagreement) < 0.05


def test_kept_rates_are_rounded_to_two_significant_digits() -> None:
    """Timings 0.4% apart (measured idle and beside a busy process) give the same rates, so the same plan."""
    figures = {
        fit_rates(NAMES, FLOPS, ELEMENTS, _seconds(StepRates(500e9, 130e6), (n, n, n))).rates(2.8e9)
        for n in (1.0, 1.004)
    }
    assert figures == {StepRates(500e9, 130e6, 2.8e9)}


def test_the_4000_gflops_of_a_busy_machine_are_refused() -> None:
    """Steps timed as a machine of 4,000 GFLOP/s and 47 M elements/s runs them (the figures a busy machine kept): the
    convolutions are a sliver of every step's seconds, so the steps cannot pin their rate down."""
    fit = fit_rates(NAMES, FLOPS, ELEMENTS, _seconds(StepRates(4000e9, 47e6)))
    assert "the FLOP rate is not identified" in fit.refusal()


def test_two_steps_are_never_kept() -> None:
    """Two steps fit two rates exactly: the old calibration's 3D and 2D steps, timed as they were when they gave
    4,000 GFLOP/s, are refused for that alone."""
    seconds = _seconds(StepRates(4000e9, 47e6))
    fit = fit_rates(NAMES[:2], FLOPS[:2], ELEMENTS[:2], seconds[:2])
    assert fit.refusal() == "2 timed steps fit 2 rates exactly, so no timing can contradict them"


def test_timings_that_leave_no_element_rate_are_refused() -> None:
    """The quiet calibration that gave 150 GFLOP/s and no element rate: every step's seconds in proportion to its
    FLOPs (the 2D step 5% faster per FLOP) leave the element work none; refused, not planned with the FLOPs alone."""
    seconds = [f / 150e9 * n for f, n in zip(FLOPS, (0.95, 1.0, 1.0))]
    fit = fit_rates(NAMES, FLOPS, ELEMENTS, seconds)
    assert fit.elements_per_second == 0.0
    assert fit.refusal() == "the fit leaves no feature-map element rate (the steps' seconds do not grow with that work)"


def test_steps_alike_in_flops_per_element_do_not_identify_the_rates() -> None:
    """The conditioning check: three steps whose FLOPs per element lie within 4% of each other, timed exactly as a
    quiet machine runs them, still leave the rates unidentified (a timing error of 3% moves them by far more than
    25%); the calibration's own steps (1470 to 6100 FLOPs per element) identify the same machine's."""
    rates = StepRates(500e9, 130e6)
    flops = [FLOPS[0] * k for k in (1.0, 1.02, 1.04)]
    alike = fit_rates(NAMES, flops, ELEMENTS[:1] * 3, [rates.seconds(f, ELEMENTS[0]) for f in flops])
    assert alike.flops_per_second == pytest.approx(500e9) and alike.elements_per_second == pytest.approx(130e6)
    assert "is not identified" in alike.refusal()
    assert fit_rates(NAMES, FLOPS, ELEMENTS, _seconds(rates)).refusal() == ""


def test_a_step_off_the_fit_by_more_than_15_percent_is_refused_naming_it() -> None:
    """Five steps spanning FLOPs per element 10 to 100,000 (each rate well identified): the middle one 30% slow is
    off the fit by more than 15%, and named."""
    flops, elements = [1e9, 3e9, 1e10, 3e10, 1e11], [1e8, 3e7, 1e7, 3e6, 1e6]
    rates = StepRates(500e9, 130e6)
    seconds = [rates.seconds(f, e) * (1.3 if i == 2 else 1.0) for i, (f, e) in enumerate(zip(flops, elements))]
    fit = fit_rates(list("abcde"), flops, elements, seconds)
    assert max(fit.uncertainty) < 0.25 and abs(fit.disagreement[2]) > MAX_DISAGREEMENT
    assert fit.refusal() == "step c took 1.24x the seconds the fit predicts (more than 15% off)"
    seconds[2] /= 1.3
    assert fit_rates(list("abcde"), flops, elements, seconds).refusal() == ""
