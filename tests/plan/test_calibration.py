"""The CPU calibration (``autoseg.plan.calibration``): which timings are kept, measured again or replaced by the
fallback, on a fake machine (no real timing): the steps' seconds, this process's CPU seconds and the CPU time of other
processes (``cpu_busy_seconds``) are injected. Figures from issue 26: beside a process busy half of every 0.1 s a
calibration was kept at 88 GFLOP/s and 81 M elements/s, where a quiet one measures 380-680 and 110-170."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autoseg.core.resources as resources
import autoseg.plan.calibration as calibration
from autoseg.core.machine import MachineCache
from autoseg.plan.calibration import (
    CALIBRATION_STEPS,
    FALLBACK_RATES,
    StepTimes,
    TimedStep,
    calibrate_cpu_throughput,
    cpu_throughput,
    training_step_closure,
)
from autoseg.plan.throughput import StepRates, mapped_bytes

QUIET = StepRates(500e9, 130e6)  # every CPU of a quiet machine
ONE_THREAD = StepRates(300e9, 80e6)  # one thread of it
HALF_BUSY = StepRates(88e9, 81e6)  # every CPU beside a process busy half of every 0.1 s (issue 26)


def _seconds(rates: StepRates) -> list[float]:
    return [rates.seconds(s.flops, s.elements) for s in CALIBRATION_STEPS]


class _FakeMachine:
    """Replaces ``training_step_closure``: the i-th closure made (attempt after attempt, step after step) runs with n
    torch threads in ``runs[i][n]`` seconds in turn (the warm-up 0 s), on a fake wall clock (``time.perf_counter``)
    and CPU clock (``time.process_time``: one thread gets ``share`` of a CPU, n threads n CPUs). Other processes keep
    ``others_cpus`` CPUs busy (``cpu_busy_seconds``); ``time.sleep`` is recorded, the mapping rate is 2.83e9 B/s."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, runs: list[dict[int, list[float]]], others_cpus: float = 0.0):
        self.runs = [{n: [0.0, *s] for n, s in by_threads.items()} for by_threads in runs]
        self.wall, self.cpu, self.share, self.others_cpus = 1000.0, 10.0, 1.0, others_cpus
        self.closures, self.step_calls, self.sleeps = 0, 0, []
        monkeypatch.setattr(calibration, "training_step_closure", self.closure)
        monkeypatch.setattr(calibration, "mapping_rate", lambda: (2.83e9, True))
        monkeypatch.setattr(calibration, "cpu_count", lambda: 2)
        monkeypatch.setattr(calibration, "MAX_ATTEMPTS", 3)  # the product's, not the suite's (tests/conftest.py)
        monkeypatch.setattr(resources, "cpu_busy_seconds", lambda: self.cpu + self.others_cpus * self.wall)
        monkeypatch.setattr(time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(time, "process_time", lambda: self.cpu)
        monkeypatch.setattr(time, "sleep", self.sleeps.append)

    def closure(self, topology, patch_size, batch_size):
        assert (topology, patch_size, batch_size) == _step_arguments(self.closures % len(CALIBRATION_STEPS))
        runs = self.runs[self.closures]
        self.closures += 1

        def step() -> None:
            threads = torch.get_num_threads()
            seconds = runs[threads].pop(0)
            self.step_calls += 1
            self.wall += seconds
            self.cpu += seconds * (self.share if threads == 1 else threads)

        return step


def _step_arguments(index: int) -> tuple:
    step = CALIBRATION_STEPS[index]
    return step.topology, step.patch_size, step.batch_size


def _runs(every: StepRates, one: StepRates, spread: float = 0.02) -> list[dict[int, list[float]]]:
    """Each step's runs with 2 threads at ``every``'s rates and with 1 at ``one``'s: the best second, the second best
    third, ``spread`` over it (enough runs for ``repeats`` up to 5)."""
    factors = (1.5, 1.0, 1.0 + spread, 1.3, 1.4)
    return [{2: [f * e for f in factors], 1: [f * o for f in factors]} for e, o in zip(_seconds(every), _seconds(one))]


def test_the_steps_span_fourfold_flops_per_element_at_widths_onednn_does_not_pad_and_map_no_pages() -> None:
    ratios = [s.flops / s.elements for s in CALIBRATION_STEPS]
    assert len(CALIBRATION_STEPS) >= 3 and max(ratios) > 4 * min(ratios)
    assert min(min(s.topology.features_per_stage) for s in CALIBRATION_STEPS) >= 16
    assert all(mapped_bytes(s.topology, s.patch_size, s.batch_size) == 0 for s in CALIBRATION_STEPS)


@pytest.mark.parametrize("index", range(len(CALIBRATION_STEPS)))
def test_calibration_flops_are_those_its_timed_steps_run(index: int) -> None:
    """The FLOPs the calibration divides by are the convolutions its timed training step executes (counted by
    torch), within 2% (the first convolution computes no input gradient)."""
    step = training_step_closure(*_step_arguments(index))
    with FlopCounterMode(display=False) as counter:
        step()
    assert counter.get_total_flops() == pytest.approx(CALIBRATION_STEPS[index].flops, rel=0.02)


def test_a_quiet_calibration_is_kept_from_the_best_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step runs once to warm up and ``repeats`` times timed, with every CPU and with 1 thread; the best run
    counts (a slow run does not lower the rates); kept at the first attempt; the caller's threads are restored."""
    fake = _FakeMachine(monkeypatch, _runs(QUIET, ONE_THREAD))
    before = torch.get_num_threads()
    measured = calibrate_cpu_throughput(repeats=3, max_threads=2)
    assert torch.get_num_threads() == before
    assert fake.step_calls == 3 * 2 * 4 and fake.sleeps == []  # per step and thread count: a warm-up, 3 timed
    assert measured.keep and measured.value == {**QUIET.as_dict(), "mapped_bytes_per_second": 2.8e9}
    assert measured.details["attempt"] == 1 and measured.details["others_cpus"] == 0.0
    assert measured.details["3d_w32_one_thread_cpu_seconds"] == pytest.approx(_seconds(ONE_THREAD)[2])


@pytest.mark.parametrize(
    "others_cpus, every, one",
    [(0.5, HALF_BUSY, StepRates(60e9, 50e6)), (1.0, QUIET, ONE_THREAD), (2.0, QUIET, ONE_THREAD)],
    ids=["half_busy_88_gflops", "one_busy_process", "two_busy_processes"],
)
def test_a_calibration_beside_busy_processes_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    others_cpus: float,
    every: StepRates,
    one: StepRates,
) -> None:
    """Beside a process busy half of the time (the steps timed as the 88 GFLOP/s and 81 M elements/s once kept), or
    one or two spinning processes (the steps timed as if quiet): other processes' CPU time refuses every attempt, 2
    s apart; the plan gets one thread's rates (a floor), not cached, with a warning that says so."""
    fake = _FakeMachine(monkeypatch, _runs(every, one) * 3, others_cpus)
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        measured = calibrate_cpu_throughput(repeats=3, max_threads=2)
    assert not measured.keep and fake.sleeps == [2.0, 2.0]
    assert measured.value == one.as_dict() | {"mapped_bytes_per_second": 2.8e9}
    busy = f"other processes kept {others_cpus:.2f} of 2 CPUs busy meanwhile (at most 0.25)"
    assert measured.why_not_kept.startswith("fallback to one thread's rates per CPU second (a floor")
    assert f"no calibration kept in 3 attempt(s) (the last: {busy}); measured again next time" in measured.why_not_kept
    assert f"none of 3 calibration(s) kept; planning with {StepRates(**measured.value).describe()}, not cached" in (
        caplog.text
    )


def test_only_the_load_beside_it_refuses_the_88_gflops_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timings behind 88 GFLOP/s and 81 M elements/s are self-consistent and show no busy step (one thread got
    its CPU, every CPU ran faster than one): without the other process's CPU time they would be kept."""
    _FakeMachine(monkeypatch, _runs(HALF_BUSY, StepRates(60e9, 50e6)))
    measured = calibrate_cpu_throughput(repeats=3, max_threads=2)
    assert measured.keep and measured.value == {**HALF_BUSY.as_dict(), "mapped_bytes_per_second": 2.8e9}


def test_a_refused_attempt_is_measured_again_and_a_kept_one_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt's runs are unsteady (the second best 20% over the best: something ran meanwhile), the
    second's steady: kept at the second attempt, after one pause."""
    fake = _FakeMachine(monkeypatch, _runs(QUIET, ONE_THREAD, spread=0.2) + _runs(QUIET, ONE_THREAD))
    measured = calibrate_cpu_throughput(repeats=3, max_threads=2)
    assert measured.keep and measured.details["attempt"] == 2 and fake.sleeps == [2.0]
    assert measured.value["flops_per_second"] == 500e9


def test_when_one_thread_s_timings_do_not_fit_either_the_plan_gets_the_stated_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every attempt refused, and one thread's timings leave no element rate (each step's in proportion to its
    FLOPs): ``FALLBACK_RATES``, said so."""
    one = [{1: [s.flops / 100e9] * 5} for s in CALIBRATION_STEPS]
    runs = [{**every_step, **one_step} for one_step, every_step in zip(one, _runs(QUIET, QUIET))]
    _FakeMachine(monkeypatch, runs * 3, others_cpus=1.0)
    measured = calibrate_cpu_throughput(repeats=3, max_threads=2)
    assert not measured.keep and measured.value == FALLBACK_RATES.as_dict()
    assert measured.why_not_kept.startswith("fallback to 20.0 GFLOP/s, a slow CPU core's (one thread's timings: ")


def test_cpu_throughput_caches_a_kept_calibration_with_its_date_and_never_a_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Busy: the fallback, not cached, and measured again next time; quiet: cached; then read with its date."""
    fake = _FakeMachine(monkeypatch, _runs(QUIET, ONE_THREAD) * 4, others_cpus=1.0)
    cache = MachineCache(tmp_path)
    rates, source = cpu_throughput(cache)
    assert rates == StepRates(300e9, 80e6, 2.8e9) and source.startswith("measured now, not cached: fallback to ")
    assert not (tmp_path / "cpu_throughput.json").exists()
    fake.others_cpus = 0.0
    assert cpu_throughput(cache) == (
        StepRates(500e9, 130e6, 2.8e9),
        f"measured now, cached in {cache.path('cpu_throughput')}",
    )
    rates, source = cpu_throughput(cache)
    assert rates == StepRates(500e9, 130e6, 2.8e9) and source.startswith(
        f"cached in {cache.path('cpu_throughput')}, measured "
    )
    assert fake.closures == 3 * 4  # three busy attempts, one quiet, none for the cached read


def _times(threads: int, wall: float, cpu: float, spread: float = 0.0) -> StepTimes:
    return StepTimes(threads=threads, wall_seconds=wall, cpu_seconds=cpu, wall_spread=spread, cpu_spread=spread)


@pytest.mark.parametrize(
    "one, every, why",
    [
        (_times(1, 1.5, 0.5), _times(2, 1.2, 0.7), "step s: one thread got 33% of a CPU"),
        (_times(1, 0.5, 0.5), _times(2, 0.6, 0.7), "step s: 2 threads ran no faster than one (0.600 vs 0.500 s)"),
        (_times(1, 0.5, 0.5), _times(2, 0.3, 0.6, 0.15), "step s: its second best run took 15% longer than its best"),
        (_times(1, 0.5, 0.5, 0.15), _times(2, 0.3, 0.6), ""),  # one thread's runs do not count
        (_times(1, 0.5, 0.5), _times(2, 0.3, 0.6, 0.05), ""),
    ],
    ids=["core_shared", "threads_no_faster", "unsteady", "unsteady_uncounted", "steady"],
)
def test_a_step_s_timings_show_when_something_else_ran(one: StepTimes, every: StepTimes, why: str) -> None:
    """Another process on the cores: one thread's share of a CPU, every CPU's speed-up over one thread, and the
    spread of the runs that count say so, and the step's seconds are the shorter of one thread's CPU seconds and
    every CPU's wall seconds."""
    step = TimedStep("s", 1e9, 1e6, one, every)
    assert step.busy() == why
    assert step.seconds() == min(one.cpu_seconds, every.wall_seconds)


def test_an_unsteady_mapping_rate_drops_its_term(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh block filled no slower than a kept one (noise): no mapping rate, rather than an absurd one."""
    _FakeMachine(monkeypatch, _runs(QUIET, ONE_THREAD))
    monkeypatch.setattr(calibration, "mapping_rate", lambda: (6.7e13, False))
    assert calibrate_cpu_throughput(repeats=3, max_threads=2).value["mapped_bytes_per_second"] is None


def test_a_2d_plan_is_not_predicted_at_the_3d_step_s_flop_rate() -> None:
    """The reason for two rates: the 2D step does fewer FLOPs per element, so on such a machine the FLOPs alone at
    the 3D step's rate predict it 20%+ too fast, and the two rates predict it exactly."""
    two_d, three_d = CALIBRATION_STEPS[0], CALIBRATION_STEPS[1]
    flops_only = StepRates(three_d.flops / QUIET.seconds(three_d.flops, three_d.elements))
    assert flops_only.seconds(two_d.flops) < 0.8 * QUIET.seconds(two_d.flops, two_d.elements)
