"""This machine's CPU training rates (``StepRates``), measured so that they cannot be absurd.

``calibrate_cpu_throughput`` times THE training step (``autoseg.model.step``) of three small U-Nets whose FLOPs per
feature-map element differ fourfold (``CALIBRATION_STEPS``), each with 1 thread and with every CPU, and fits a FLOP
rate and an element rate to them (``autoseg.plan.rate_fit``); ``mapping_rate`` times fresh pages for the third
rate. An attempt is kept only when the machine was quiet and the fit holds:

- other processes took less than ``OTHERS_CPU_SHARE`` of the CPUs meanwhile (``autoseg.core.resources.busy_by_others``;
  ``cpu_busy_seconds`` before and after, minus this process's own CPU seconds: a spinning process, or one busy half
  of every 0.1 s, shows there);
- every step ran steadily (``TimedStep.busy``: one thread got a whole CPU, every CPU ran faster than one, the second
  best run within ``STEADY_SPREAD`` of the best);
- the fit identifies both rates and reproduces every step within 15% (``RateFit.refusal``).

A refused attempt is measured again, ``MAX_ATTEMPTS`` in all. When none is kept, the plan uses a stated fallback,
never cached, with a warning (``fallback_rates``): the rates one thread reaches per CPU second (a floor: the load
does not lengthen CPU seconds, and training on every CPU runs faster), else ``FALLBACK_RATES``.
``cpu_throughput`` keeps a kept measurement per machine (``autoseg.core.machine.MachineCache``, with its date), so
later plans do not depend on the load while planning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoseg.core.machine import MachineCache, Measurement, machine_key
from autoseg.core.resources import OthersBusy, busy_by_others, cpu_count
from autoseg.core.units import MiB
from autoseg.dataset.labels import LabelScheme
from autoseg.model.topology import NetworkTopology
from autoseg.plan.rate_fit import RateFit, fit_rates
from autoseg.plan.throughput import StepRates, conv_flops, step_elements

log = logging.getLogger("autoseg")

MAX_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 2.0  # between refused attempts: a passing load may be over
STEADY_SPREAD = 0.10  # a step's second-best run vs its best: more, and something else ran meanwhile
# planned with when no attempt is kept and one thread's timings do not fit either: a slow CPU core's convolutions
FALLBACK_RATES = StepRates(20e9)
CALIBRATION_VERSION = 5  # part of the cache key: a change to the calibration steps or rule measures again


@dataclass(frozen=True)
class CalibrationStep:
    """A timed training step: ``topology`` at ``patch_size`` x ``batch_size``, named in details and messages."""

    name: str
    topology: NetworkTopology
    patch_size: tuple[int, ...]
    batch_size: int

    @property
    def flops(self) -> float:
        return conv_flops(self.topology, self.patch_size, self.batch_size)

    @property
    def elements(self) -> float:
        return step_elements(self.topology, self.patch_size, self.batch_size)


# FLOPs per feature-map element (forward + backward): ~1470 (2D, 3x3), ~2750 (3D, width 16, an in-plane first
# stage), ~6100 (3D, width 32): the range CPU plans fall in (width 16 at 2D and 3D). Widths of at least 16, as
# oneDNN pads fewer channels to 16 (a width-8 step runs about as slowly as a width-16 one). No stage reaches the
# mmap threshold, so the steps map no fresh pages. About 0.1-0.5 s a step on 2 cores.
_2D, _3D = ((3, 3),) * 4, ((3, 3, 3),) * 4
CALIBRATION_STEPS = (
    CalibrationStep(
        "2d_w16",
        NetworkTopology(2, 1, 3, (16, 32, 64, 128), _2D, ((1, 1),) + ((2, 2),) * 3),
        (96, 96),
        8,
    ),
    CalibrationStep(
        "3d_w16",
        NetworkTopology(
            3, 1, 3, (16, 32, 64, 128), ((1, 3, 3),) + _3D[1:], ((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2))
        ),
        (16, 48, 48),
        2,
    ),
    CalibrationStep(
        "3d_w32",
        NetworkTopology(3, 1, 3, (32, 64, 128, 256), _3D, ((1, 1, 1),) + ((2, 2, 2),) * 3),
        (16, 32, 32),
        2,
    ),
)


def training_step_closure(
    topology: NetworkTopology, patch_size: tuple[int, ...], batch_size: int, seed: int = 0
) -> Callable[[], object]:
    """THE training step (``autoseg.model.step``) on a fresh network and synthetic batches, as a callable to time."""
    import torch

    from autoseg.model.step import build_step, synthetic_batches  # torch: only when a step is timed

    scheme = LabelScheme.for_outputs(topology.num_outputs)
    step = build_step(topology, scheme)
    batches = synthetic_batches(topology, scheme, batch_size, tuple(patch_size), torch.Generator().manual_seed(seed))
    return lambda: step(batches)


def mapping_rate(repeats: int = 5, nbytes: int = 64 * MiB) -> tuple[float, bool]:
    """Bytes per second at which this machine maps fresh pages for a tensor: the CPU seconds of allocating and
    filling a fresh ``nbytes`` block minus those of filling a kept one (best of ``repeats``; CPU seconds, so another
    process on the cores does not lengthen them), and whether they were steady (the fresh fill took at least the
    kept one's time, else the figure is noise)."""
    import torch

    kept = torch.empty(nbytes // 4)
    kept.fill_(1.0)

    def cpu_seconds(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            c0 = time.process_time()
            run()
            times.append(time.process_time() - c0)
        return min(times)

    fresh, reused = cpu_seconds(lambda: torch.empty(nbytes // 4).fill_(1.0)), cpu_seconds(lambda: kept.fill_(1.0))
    return nbytes / max(fresh - reused, 1e-6), fresh > reused


@dataclass(frozen=True)
class StepTimes:
    """The best (shortest) of several timed runs of a step: wall seconds and the process's CPU seconds, and how far
    the second best run of each was from the best (relative; 0 with one run)."""

    threads: int
    wall_seconds: float
    cpu_seconds: float
    wall_spread: float = 0.0
    cpu_spread: float = 0.0


def _best_and_spread(runs: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(runs)
    return ordered[0], (ordered[1] / ordered[0] - 1.0 if len(ordered) > 1 and ordered[0] > 0 else 0.0)


def time_step(run_once: Callable[[], object], threads: int, repeats: int) -> StepTimes:
    """``run_once`` with ``threads`` torch threads: one warm-up, then the best of ``repeats`` runs. The caller's
    thread count is restored."""
    import torch

    previous = torch.get_num_threads()
    walls, cpus = [], []
    try:
        torch.set_num_threads(threads)
        run_once()  # warm-up: allocations, oneDNN kernel choice
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            run_once()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(previous)
    (wall, wall_spread), (cpu, cpu_spread) = _best_and_spread(walls), _best_and_spread(cpus)
    return StepTimes(threads, wall, cpu, wall_spread, cpu_spread)


@dataclass(frozen=True)
class TimedStep:
    """One calibration step (``CalibrationStep``'s name, FLOPs and elements) and its timings with 1 thread
    (``one``) and with every CPU (``every``; None on a 1-CPU machine)."""

    name: str
    flops: float
    elements: float
    one: StepTimes
    every: StepTimes | None

    def seconds(self) -> float:
        """The step's seconds as robust to other processes as timing allows: one thread's CPU seconds do not grow
        when another process takes turns on its core while its wall seconds do (docs/benchmarks.md, "Training step
        speed on CPU"), so they bound it; every CPU's best wall seconds are what an idle machine reaches (training
        uses every CPU). The shorter counts."""
        return min(self.one.cpu_seconds, self.every.wall_seconds) if self.every is not None else self.one.cpu_seconds

    def busy(self) -> str:
        """Why the step's timings look disturbed ("" when they do not): one thread got under 90% of a CPU, every CPU
        ran no faster than one, or the runs that count (``seconds``) were unsteady (the second best more than
        ``STEADY_SPREAD`` over the best)."""
        share = self.one.cpu_seconds / self.one.wall_seconds
        if share < 0.9:
            return f"step {self.name}: one thread got {share:.0%} of a CPU"
        if self.every is not None and self.every.wall_seconds > 0.9 * self.one.wall_seconds:
            return (
                f"step {self.name}: {self.every.threads} threads ran no faster than one "
                f"({self.every.wall_seconds:.3f} vs {self.one.wall_seconds:.3f} s)"
            )
        counted = self.every is not None and self.every.wall_seconds < self.one.cpu_seconds
        spread = self.every.wall_spread if counted and self.every is not None else self.one.cpu_spread
        if spread > STEADY_SPREAD:
            return f"step {self.name}: its second best run took {spread:.0%} longer than its best"
        return ""


@dataclass(frozen=True)
class Attempt:
    """One timing of every calibration step, and how many CPUs other processes kept busy meanwhile on average
    (``others_cpus``; None where the system does not say)."""

    steps: tuple[TimedStep, ...]
    others_cpus: float | None

    def fit(self) -> RateFit:
        """The rates fitted to each step's ``TimedStep.seconds``."""
        return fit_rates(*self._columns(), [s.seconds() for s in self.steps])

    def floor_fit(self) -> RateFit:
        """The rates fitted to one thread's CPU seconds: a floor the load does not lower."""
        return fit_rates(*self._columns(), [s.one.cpu_seconds for s in self.steps])

    def _columns(self) -> tuple[list[str], list[float], list[float]]:
        return [s.name for s in self.steps], [s.flops for s in self.steps], [s.elements for s in self.steps]

    def refusal(self, cpus: int) -> str:
        """Why this attempt's rates are not kept ("" when they are): other processes took more than
        ``OTHERS_CPU_SHARE`` of the ``cpus`` CPUs, a step's timings look disturbed (``TimedStep.busy``), or the fit
        does not hold (``RateFit.refusal``)."""
        return (
            busy_by_others(self.others_cpus, cpus)
            or next((why for why in (s.busy() for s in self.steps) if why), "")
            or self.fit().refusal()
        )

    def details(self) -> dict[str, float]:
        """The timings behind the rates, kept beside them in the machine cache."""
        details = {} if self.others_cpus is None else {"others_cpus": self.others_cpus}
        for step, disagreement in zip(self.steps, self.fit().disagreement):
            details.update(
                {
                    f"{step.name}_step_flops": step.flops,
                    f"{step.name}_step_elements": step.elements,
                    f"{step.name}_one_thread_wall_seconds": step.one.wall_seconds,
                    f"{step.name}_one_thread_cpu_seconds": step.one.cpu_seconds,
                    f"{step.name}_fit_disagreement": disagreement,
                }
            )
            if step.every is not None:
                details.update(
                    {"threads": step.every.threads, f"{step.name}_all_threads_wall_seconds": step.every.wall_seconds}
                )
        return details


def time_calibration_steps(steps: Sequence[CalibrationStep], repeats: int, threads: int) -> Attempt:
    """Each step's best of ``repeats`` runs with 1 thread and with ``threads`` (``time_step``), and the CPU time other
    processes took meanwhile (``OthersBusy``)."""
    timed = []
    with OthersBusy() as others:
        for step in steps:
            run = training_step_closure(step.topology, step.patch_size, step.batch_size)
            every = time_step(run, threads, repeats) if threads > 1 else None
            timed.append(TimedStep(step.name, step.flops, step.elements, time_step(run, 1, repeats), every))
    return Attempt(tuple(timed), others.cpus)


def fallback_rates(attempt: Attempt, mapped: float | None) -> tuple[StepRates, str]:
    """What a plan uses when no attempt is kept, and the words for it: one thread's rates per CPU second where they
    fit (``Attempt.floor_fit``: a floor, as the load does not lengthen CPU seconds and training on every CPU runs
    faster), else ``FALLBACK_RATES``."""
    floor = attempt.floor_fit()
    refusal = floor.refusal()
    if not refusal:
        return floor.rates(mapped), "one thread's rates per CPU second (a floor: training on every CPU runs faster)"
    return FALLBACK_RATES, f"{FALLBACK_RATES.describe()}, a slow CPU core's (one thread's timings: {refusal})"


def calibrate_cpu_throughput(
    repeats: int = 5, max_threads: int | None = None, attempts: int | None = None
) -> Measurement:
    """This machine's ``StepRates`` (as a dict) from ``CALIBRATION_STEPS`` timed with 1 thread and every CPU
    (``max_threads``; default all) and the ``mapping_rate`` (dropped when unsteady); up to ``attempts`` timings
    (default ``MAX_ATTEMPTS``), ``RETRY_PAUSE_SECONDS`` apart, until one is kept (``Attempt.refusal``). When none
    is, the ``fallback_rates``, not to be cached, with a warning. 5-15 s an attempt on 2 cores."""
    threads, attempts = max_threads or cpu_count(), attempts or MAX_ATTEMPTS
    rate, steady = mapping_rate()
    mapped = float(f"{rate:.2g}") if steady else None
    for number in range(1, attempts + 1):
        if number > 1:
            time.sleep(RETRY_PAUSE_SECONDS)
        attempt = time_calibration_steps(CALIBRATION_STEPS, repeats, threads)
        details = {**attempt.details(), "mapping_bytes_per_cpu_second": rate, "attempt": number}
        refusal = attempt.refusal(cpu_count())
        if not refusal:
            return Measurement(attempt.fit().rates(mapped).as_dict(), details=details)
        log.info("CPU calibration attempt %d of %d not kept: %s", number, attempts, refusal)
    rates, what = fallback_rates(attempt, mapped)
    why = (
        f"fallback to {what}: no calibration kept in {attempts} attempt(s) (the last: {refusal}); measured again next "
        "time, --cpu-flops overrides"
    )
    log.warning(
        "CPU throughput: none of %d calibration(s) kept; planning with %s, not cached", attempts, rates.describe()
    )
    return Measurement(rates.as_dict(), keep=False, why_not_kept=why, details=details)


def cpu_throughput(cache: MachineCache) -> tuple[StepRates, str]:
    """This machine's ``StepRates`` and where they came from: read from ``cache`` for this machine
    (``autoseg.core.machine.machine_key``; "cached in PATH, measured DATE"), else measured now with
    ``calibrate_cpu_throughput`` and cached when kept ("measured now, ..."; a fallback says so)."""
    key = {**machine_key(), "calibration": CALIBRATION_VERSION}
    value, source = cache.measured("cpu_throughput", key, calibrate_cpu_throughput)
    return StepRates(**value), source
