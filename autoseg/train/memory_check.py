"""Does the memory model hold on this machine? The first real training steps, measured against the prediction.

Every training run (``trainer``) and ``autoseg check-memory`` (a plan's configuration on synthetic batches) watch
their first ``CHECK_STEPS`` optimizer steps with a ``MemoryObserver`` and compare them with the memory model's
prediction for the configuration that ran (``compare``, the one comparison; docs/memory.md has the table):

- CUDA (``CudaProbe``, peak statistics reset first): ``max_memory_allocated`` against the simulated tensor peak;
  ``max_memory_reserved`` against tensors + the modelled allocator rounding, fragmentation and convolution
  workspace; the device's used memory (``mem_get_info``) against the whole prediction, the CUDA context included.
- CPU (``CpuProbe``): step ``TRACKED_STEP`` (the first that starts with optimizer state, as the simulated step)
  runs under ``StorageTracker``, the state and its batches counted as they enter: its tensor peak against the
  simulated one (4 B to 0.001% below it so far). The peak RSS over the other steps (VmHWM; not the tracked step's
  Python records) against the RSS before the first step (measured) + what the simulated step adds to its tensors +
  what glibc's heap keeps beyond them (``fragmentation``). The whole-process model row (+ ``CPU_RUNTIME_BYTES``)
  is shown, not checked: a training process holds more than the step.

A row off by more than ``TOLERANCE`` of its prediction (the CPU peak RSS row: and by more than ``RSS_SLACK_BYTES``)
fails the check: training logs a warning and goes on, ``autoseg check-memory`` exits with ``EXIT_MEMORY_MISMATCH``.
The prediction is simulated before the measured steps (``predict_step``): their timing and RSS baseline exclude it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.core.resources import available_ram_bytes, peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.core.units import MiB, format_bytes
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.device import predict_device_peak
from autoseg.memory.step_record import TrainingMemory
from autoseg.memory.tracker import StorageTracker
from autoseg.memory.training import simulate_training_step
from autoseg.model.optimizer import OPTIMIZERS, OptimizerSettings
from autoseg.model.step import TrainStep, build_step, synthetic_batches
from autoseg.plan.plans import ConfigurationPlan, Plans

__all__ = [
    "CHECK_STEPS",
    "EXIT_MEMORY_MISMATCH",
    "TOLERANCE",
    "CpuProbe",
    "CudaProbe",
    "MemoryCheck",
    "MemoryObserver",
    "MemoryRow",
    "StepPrediction",
    "check_plan",
    "compare",
    "configured_step",
    "log_check",
    "predict_step",
]

TOLERANCE = 0.10  # a row is off when |measured - predicted| > TOLERANCE x predicted
RSS_SLACK_BYTES = 64 * MiB  # the CPU peak RSS row also by more than this: its spread between fresh processes
CHECK_STEPS = 3  # steps watched: the 1st makes the optimizer state, the 2nd is tracked, the 3rd's peak RSS is checked
TRACKED_STEP = 1  # on CPU, this step (0-based) runs under StorageTracker
EXIT_MEMORY_MISMATCH = 3  # autoseg check-memory: measured and predicted differ (1: failure, 2: bad input)

log = logging.getLogger("autoseg.train.trainer")


@dataclass(frozen=True)
class MemoryRow:
    """One comparison: ``measured`` bytes (``source``: how) against ``predicted`` bytes (``model``: which terms)."""

    name: str
    measured_bytes: int
    predicted_bytes: int
    source: str
    model: str
    checked: bool = True
    slack_bytes: int = 0  # a gap of at most this many bytes is not off, whatever its share

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_bytes - self.predicted_bytes) / max(self.predicted_bytes, 1)

    def off(self, tolerance: float = TOLERANCE) -> bool:
        return (
            self.checked
            and abs(self.error) > tolerance
            and abs(self.measured_bytes - self.predicted_bytes) > self.slack_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured_bytes": self.measured_bytes,
            "predicted_bytes": self.predicted_bytes,
            "error": self.error,
            "checked": self.checked,
            "slack_bytes": self.slack_bytes,
            "source": self.source,
            "model": self.model,
        }


@dataclass(frozen=True)
class MemoryCheck:
    """The result of a check: the configuration that ran, how many steps, one ``MemoryRow`` per comparison."""

    device: str
    configuration: dict[str, Any]  # batch_size, accumulation_steps, patch_size, precision, checkpointing, optimizer
    steps: int
    rows: tuple[MemoryRow, ...]
    tolerance: float = TOLERANCE
    notes: tuple[str, ...] = ()

    @property
    def off_rows(self) -> list[MemoryRow]:
        return [r for r in self.rows if r.off(self.tolerance)]

    @property
    def ok(self) -> bool:
        return not self.off_rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "configuration": self.configuration,
            "steps": self.steps,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """One line: the configuration, each checked row as measured / predicted (error), the verdict."""
        c = self.configuration
        rows = ", ".join(
            f"{r.name} {format_bytes(r.measured_bytes)} / {format_bytes(r.predicted_bytes)} ({r.error:+.1%})"
            for r in self.rows
            if r.checked
        )
        verdict = (
            f"within {self.tolerance:.0%}"
            if self.ok
            else f"OFF by more than {self.tolerance:.0%}: {', '.join(r.name for r in self.off_rows)}"
        )
        return (
            f"memory check on {self.device} ({self.steps} steps, batch {c['batch_size']} x "
            f"{c['accumulation_steps']}, patch {'x'.join(map(str, c['patch_size']))}, {c['precision']}"
            f"{', checkpointing' if c['checkpointing'] else ''}): measured / predicted {rows}; {verdict}"
        )

    def warning(self) -> str | None:
        """What is off and what to do, or None when every checked row is within the tolerance."""
        if self.ok:
            return None
        what = "; ".join(
            f"{r.name}: measured {format_bytes(r.measured_bytes)}, predicted "
            f"{format_bytes(r.predicted_bytes)} ({r.error:+.1%}; {r.model})"
            for r in self.off_rows
        )
        return (
            f"the memory model is off by more than {self.tolerance:.0%} on this {self.device}: {what}. Plans for "
            "this machine may over- or under-fill it; please report this line (with `autoseg check-memory "
            "--json`'s output) so the device terms in autoseg/memory/device.py can be calibrated"
        )

    def table(self) -> str:
        """The comparison table of ``autoseg check-memory``."""
        header = [
            "term",
            "measured",
            "predicted",
            "error",
            f"within {self.tolerance:.0%}",
            "measured by / predicted as",
        ]
        body = [
            [
                r.name,
                format_bytes(r.measured_bytes),
                format_bytes(r.predicted_bytes),
                f"{r.error:+.2%}",
                (
                    "NO"
                    if r.off(self.tolerance)
                    else "yes"
                    if abs(r.error) <= self.tolerance
                    else f"yes (by < {format_bytes(r.slack_bytes)})"
                )
                if r.checked
                else "(not checked)",
                f"{r.source} / {r.model}",
            ]
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.rjust(w) if 0 < i < 5 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
            for row in [header, *body]
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join([self.describe(), *lines, *(f"note: {n}" for n in self.notes)])


@dataclass(frozen=True)
class StepPrediction:
    """The memory model's figures for one configuration: the simulated step and the device's terms on top."""

    memory: TrainingMemory
    device_terms: dict[str, int]  # predict_device_peak: tensors, the device's terms, total


def predict_step(
    config: ConfigurationPlan, device_type: str, optimizer: OptimizerSettings, scheme: LabelScheme
) -> StepPrediction:
    """One simulation of the step as it runs on ``device_type``: the configuration's batch, accumulation and
    checkpointing (after degradations, a rank's share), the precision it runs at there, the run's optimizer."""
    device = "cuda" if device_type == "cuda" else "cpu"
    kind = next(key for key, settings in OPTIMIZERS.items() if settings.name == optimizer.name)  # state: by kind
    memory = simulate_training_step(
        config.network,
        config.batch_size,
        tuple(config.patch_size),
        precision=effective_precision(config.precision, device_type),
        checkpointing=config.checkpointing,
        optimizer=kind,
        accumulation_steps=config.accumulation_steps,
        labels=scheme,
        device=device,
    )
    return StepPrediction(memory, predict_device_peak(memory, device))


def compare(
    prediction: StepPrediction,
    measured: dict[str, int],
    device_type: str,
    configuration: dict[str, Any],
    steps: int,
    notes: tuple[str, ...] = (),
) -> MemoryCheck:
    """THE comparison of a measurement (``CudaProbe.finish`` or ``CpuProbe.finish``) with a prediction."""
    terms, tensors = prediction.device_terms, prediction.device_terms["tensors"]
    if device_type == "cuda":
        cached = tensors + terms["allocator_rounding"] + terms["fragmentation"] + terms["conv_workspace"]
        rows = (
            MemoryRow(
                "allocated",
                measured["max_memory_allocated"],
                tensors,
                "torch.cuda.max_memory_allocated",
                "simulated tensor peak",
            ),
            MemoryRow(
                "reserved",
                measured["max_memory_reserved"],
                cached,
                "torch.cuda.max_memory_reserved",
                "tensors + allocator rounding, fragmentation, conv workspace",
            ),
            MemoryRow(
                "device used",
                measured["device_used"],
                terms["total"],
                "mem_get_info: total - free",
                "the above + CUDA context",
            ),
        )
    else:
        added, heap = tensors - measured["baseline_tensor_bytes"], terms["fragmentation"]
        rows = (
            MemoryRow(
                "tensors",
                measured["tracked_peak"],
                tensors,
                f"StorageTracker, step {TRACKED_STEP}",
                "simulated tensor peak",
            ),
            MemoryRow(
                "peak RSS",
                measured["peak_rss"],
                measured["baseline_rss"] + added + heap,
                "VmHWM over the untracked steps",
                f"RSS before them ({format_bytes(measured['baseline_rss'])}, measured) + "
                f"what the step adds to its tensors ({format_bytes(added)}, simulated) + what glibc's heap "
                f"keeps beyond them ({format_bytes(heap)}, modelled)",
                slack_bytes=RSS_SLACK_BYTES,
            ),
            MemoryRow(
                "peak RSS (model)",
                measured["peak_rss"],
                terms["total"],
                "VmHWM over the untracked steps",
                "tensors + fragmentation + CPU_RUNTIME_BYTES",
                checked=False,
            ),
        )
    return MemoryCheck(device_type, configuration, steps, rows, TOLERANCE, notes)


class Probe(Protocol):
    """What a ``MemoryObserver`` measures with: ``start`` before the first step, ``run`` each step, ``finish``."""

    def start(self, step: TrainStep) -> None: ...
    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any: ...
    def finish(self) -> dict[str, int]: ...


class CudaProbe:
    """Peak statistics of the CUDA caching allocator and the device's used memory. ``cuda``: ``torch.cuda`` or a
    stand-in with the same five functions (tests inject one; there is no GPU to test on)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device, self.cuda = device, torch.cuda if cuda is None else cuda

    def start(self, step: TrainStep) -> None:
        self.cuda.synchronize(self.device)
        self.cuda.reset_peak_memory_stats(self.device)

    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any:
        return step(batches)

    def finish(self) -> dict[str, int]:
        self.cuda.synchronize(self.device)  # the steps' kernels have run
        free, total = self.cuda.mem_get_info(self.device)
        return {
            "max_memory_allocated": int(self.cuda.max_memory_allocated(self.device)),
            "max_memory_reserved": int(self.cuda.max_memory_reserved(self.device)),
            "device_used": int(total - free),
            "device_total": int(total),
        }


class _Counted:
    """The step's batches, each counted by ``tracker`` as it is handed over (the loader's own work runs untracked)."""

    def __init__(self, batches: Iterator, tracker: StorageTracker) -> None:
        self.batches, self.tracker = batches, tracker

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self.tracker.paused = True
        try:
            batch = next(self.batches)
        finally:
            self.tracker.paused = False
        self.tracker.count(batch.values())
        return batch


class CpuProbe:
    """Peak RSS over the steps and the tracked tensor peak of step ``TRACKED_STEP`` (see the module docstring).
    ``peak_rss``: where the peak RSS is read (None: ``peak_rss_bytes``; tests inject a stand-in)."""

    def __init__(self, peak_rss: Callable[[], int | None] | None = None) -> None:
        self.peak_rss = peak_rss
        self.measured: dict[str, int] = {}

    def start(self, step: TrainStep) -> None:
        self.measured["baseline_tensor_bytes"] = _storage_bytes(_state_tensors(step))
        self.measured["baseline_rss"] = process_rss_bytes()
        reset_peak_rss()

    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any:
        if index != TRACKED_STEP:
            return step(batches)
        self.measured["peak_rss"] = self._read_peak()  # so far: the tracked step's Python records are no training's
        tracker = StorageTracker(cpu_conv_scratch=True)  # as the CPU simulation; costs one step's Python dispatch
        tracker.count(_state_tensors(step))
        with tracker:
            out = step(_Counted(batches, tracker))
        self.measured["tracked_peak"] = tracker.peak_bytes
        del tracker
        reset_peak_rss()
        return out

    def finish(self) -> dict[str, int]:
        self.measured["peak_rss"] = max(self.measured.get("peak_rss", 0), self._read_peak())
        return dict(self.measured)

    def _read_peak(self) -> int:
        return int((self.peak_rss or peak_rss_bytes)() or process_rss_bytes())


def _state_tensors(step: TrainStep) -> list[torch.Tensor]:
    """What a step starts with: parameters, their gradients (from the previous step) and the optimizer state."""
    params = list(step.network.parameters())
    state = [v for s in step.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + [p.grad for p in params if p.grad is not None] + state


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclass
class MemoryObserver:
    """Runs a configuration's steps (``observer.step(train_step, batches)`` instead of ``train_step(batches)``) and,
    after the first ``steps`` of them, compares their memory with the prediction and hands ``on_result`` the
    ``MemoryCheck``; later steps run unobserved. A new configuration (a degradation) needs a new observer. The
    prediction is simulated when the observer is made (one ``simulate_training_step``), so the time budget's
    first timed iterations do not include it; the RSS baseline is measured after it."""

    config: ConfigurationPlan
    device: torch.device
    optimizer: OptimizerSettings
    scheme: LabelScheme
    on_result: Callable[[MemoryCheck], None]
    steps: int = CHECK_STEPS
    probe: Probe | None = None
    prediction: StepPrediction | None = None  # None: simulated now, before the steps
    done: int = 0
    result: MemoryCheck | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.probe is None:
            self.probe = CudaProbe(self.device) if self.device.type == "cuda" else CpuProbe()
        if self.prediction is None:  # before the steps: neither their timing nor their memory includes it
            self.prediction = predict_step(self.config, self.device.type, self.optimizer, self.scheme)

    def step(self, step: TrainStep, batches: Iterator) -> Any:
        if self.done >= self.steps:
            return step(batches)
        if self.done == 0:
            self.probe.start(step)
        out = self.probe.run(step, batches, self.done)
        self.done += 1
        if self.done == self.steps:
            self.result = self.check(self.probe.finish())
            self.on_result(self.result)
        return out

    def check(self, measured: dict[str, int]) -> MemoryCheck:
        c = self.config
        prediction = self.prediction
        configuration = {
            "batch_size": c.batch_size,
            "accumulation_steps": c.accumulation_steps,
            "patch_size": list(c.patch_size),
            "checkpointing": c.checkpointing,
            "precision": effective_precision(c.precision, self.device.type),
            "optimizer": self.optimizer.name,
        }
        notes = _plan_note(c, prediction, self.device.type)
        return compare(prediction, measured, self.device.type, configuration, self.steps, notes)


def _plan_note(config: ConfigurationPlan, prediction: StepPrediction, device_type: str) -> tuple[str, ...]:
    """A note when plans.json's own tensor figure for this device differs from today's simulation."""
    planned = config.memory.get("tensors")
    if (
        config.device != device_type
        or planned is None
        or math.isclose(planned, prediction.memory.peak_bytes, rel_tol=1e-3)
    ):
        return ()
    return (
        f"plans.json predicts {format_bytes(planned)} of tensors for this configuration, the memory model now "
        f"{format_bytes(prediction.memory.peak_bytes)} (an older plan, or the configuration changed: degraded, "
        "a rank's share, another optimizer)",
    )


def configured_step(
    config: ConfigurationPlan, device: torch.device, optimizer: OptimizerSettings, scheme: LabelScheme
) -> TrainStep:
    """The configuration's training step on ``device``: the plan's precision on CUDA, fp32 on CPU."""
    return build_step(
        config.network,
        scheme,
        precision=effective_precision(config.precision, device.type),
        checkpointing=config.checkpointing,
        accumulation_steps=config.accumulation_steps,
        device=device,
        optimizer=optimizer,
    )


def check_plan(
    plans: Plans,
    config_name: str,
    device: torch.device,
    steps: int = CHECK_STEPS,
    probe: Probe | None = None,
    seed: int = 0,
) -> MemoryCheck:
    """``autoseg check-memory``: ``steps`` real steps of the planned configuration on synthetic batches (SGD, as
    planned), then the comparison. Refuses, before allocating anything, a configuration whose predicted peak
    exceeds what the machine has (``InputError``): on CPU it would swap instead of measuring."""
    if steps < CHECK_STEPS:
        raise InputError(
            f"--steps {steps}: the check needs at least {CHECK_STEPS} steps (the first creates the "
            "optimizer state, the second is tracked, the peak RSS is taken over the others)"
        )
    config, scheme, optimizer = plans.configuration(config_name), plans.label_scheme, OPTIMIZERS["sgd"]
    prediction = predict_step(config, device.type, optimizer, scheme)
    if probe is None:
        _refuse_if_too_large(config_name, config, prediction, device)
    results: list[MemoryCheck] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        step = configured_step(config, device, optimizer, scheme)
        step.network.train()
        batches = synthetic_batches(
            config.network, scheme, config.batch_size, tuple(config.patch_size), torch.Generator().manual_seed(seed)
        )
        observer = MemoryObserver(
            config, device, optimizer, scheme, results.append, steps, probe, prediction=prediction
        )
        for _ in range(steps):
            loss, _ = observer.step(step, batches)
            loss.item()  # syncs with the device
    return results[0]


def _refuse_if_too_large(
    config_name: str, config: ConfigurationPlan, prediction: StepPrediction, device: torch.device
) -> None:
    if device.type == "cuda":
        need, (have, _) = prediction.device_terms["total"], torch.cuda.mem_get_info(device)
        where = f"{device} has {format_bytes(have)} free"
    else:
        need, have = prediction.memory.peak_bytes, available_ram_bytes()
        where = f"this machine has {format_bytes(have)} of RAM available (it would swap, not measure)"
    if need > have:
        raise InputError(
            f"configuration {config_name!r} (patch {'x'.join(map(str, config.patch_size))}, batch "
            f"{config.batch_size}) is predicted to need {format_bytes(need)} on {device.type}; {where}. "
            f"Check it on the machine it was planned for ({config.device}: `autoseg check-memory "
            f"--device {config.device}`), or plan for this one"
        )


def log_check(check: MemoryCheck, logger: logging.Logger = log) -> None:
    """The run's log line; a warning when a row is off."""
    warning = check.warning()
    logger.info("%s", check.describe())
    if warning is not None:
        logger.warning("%s", warning)
