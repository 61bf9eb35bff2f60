"""Does the memory model hold on this machine? The first real training steps, measured against the prediction.

Every training run (``trainer``) and ``autoseg check-memory`` (``check_plan``: a plan's configuration on synthetic
batches, no training) watch their first ``CHECK_STEPS`` optimizer steps with a ``MemoryObserver`` and compare what
they measured with the memory model's prediction for the configuration that ran (``compare``, the one comparison;
docs/memory.md has the table). The observer runs those steps only: the trainer calls the step itself after the
check has reported, so the rest of a run never passes through it. The modules around this one:

- ``memory_probes``: what is measured. CUDA (``CudaProbe``; peak statistics reset before the first step):
  ``torch.cuda.max_memory_allocated`` against the simulated tensor peak; ``max_memory_reserved`` against tensors +
  the modelled allocator rounding, fragmentation and convolution workspace; the device's used memory after the
  steps (``mem_get_info``: total - free, so other processes on the GPU count too) against the whole prediction, the
  CUDA context included. CPU (``CpuProbe``): step ``TRACKED_STEP``'s tracked tensor peak against the simulated one;
  the process's peak RSS over the other steps against the RSS measured before the first step (a measured
  baseline: interpreter, libraries, data, the tensors already alive) + what the simulated step adds to those
  tensors + what glibc's heap keeps beyond them (``fragmentation``). A third row, peak RSS against the
  whole-process model (+ ``CPU_RUNTIME_BYTES``), is shown but not checked: a training process holds more than the
  step (its loader, the dataset's mapped pages).
- ``memory_report``: the rows, the verdict and how they read (the run's log line, ``check-memory``'s table).

A row whose measurement differs from its prediction by more than ``TOLERANCE`` (of the prediction; the CPU peak
RSS row: and by more than ``RSS_SLACK_BYTES``) makes the check fail: training logs a warning and goes on,
``autoseg check-memory`` exits with ``EXIT_MEMORY_MISMATCH``. The prediction is simulated before the measured
steps (``predict_step``: one ``simulate_training_step`` for the configuration that runs), so the steps' timing (the
time budget's first iterations) does not include it, and the RSS baseline, measured after it, holds whatever the
simulation left behind.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.core.resources import available_ram_bytes
from autoseg.core.units import format_bytes
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.device import predict_device_peak
from autoseg.memory.step_record import StepConfig, TrainingMemory
from autoseg.memory.training import simulate_training_step
from autoseg.model.optimizer import OPTIMIZERS, OptimizerSettings
from autoseg.model.step import TrainStep, build_step, synthetic_batches
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.train.memory_probes import TRACKED_STEP, CpuProbe, CudaProbe, Probe
from autoseg.train.memory_report import RSS_SLACK_BYTES, TOLERANCE, MemoryCheck, MemoryRow

__all__ = [
    "CHECK_STEPS",
    "EXIT_MEMORY_MISMATCH",
    "MemoryObserver",
    "StepPrediction",
    "check_plan",
    "compare",
    "configured_step",
    "optimizer_key",
    "predict_step",
]

# optimizer steps watched: the first creates the optimizer state, the second is tracked (TRACKED_STEP), the peak
# RSS is taken over the others (the third starts with optimizer state, as the simulated step does)
CHECK_STEPS = 3
EXIT_MEMORY_MISMATCH = 3  # autoseg check-memory: measured and predicted differ (1: failure, 2: bad input)

log = logging.getLogger("autoseg.train.trainer")


@dataclass(frozen=True)
class StepPrediction:
    """The memory model's figures for one configuration: the simulated step and the device's terms on top."""

    memory: TrainingMemory
    device_terms: dict[str, int]  # predict_device_peak: tensors, the device's terms, total


def optimizer_key(optimizer: OptimizerSettings) -> str:
    """The ``OPTIMIZERS`` name of ``optimizer``'s kind: the simulation's optimizer state depends on the kind only
    (SGD keeps a momentum buffer per parameter, AdamW two moments), not on its learning rate or decay."""
    return next(key for key, settings in OPTIMIZERS.items() if settings.name == optimizer.name)


def predict_step(
    config: ConfigurationPlan, device_type: str, optimizer: OptimizerSettings, scheme: LabelScheme
) -> StepPrediction:
    """One simulation of the step as it runs on ``device_type``: the configuration's batch, accumulation and
    checkpointing (after degradations, a rank's share), the precision it runs at there, the run's optimizer."""
    device = "cuda" if device_type == "cuda" else "cpu"
    memory = simulate_training_step(
        StepConfig(
            config.network,
            config.batch_size,
            tuple(config.patch_size),
            precision=effective_precision(config.precision, device_type),
            checkpointing=config.checkpointing,
            optimizer=optimizer_key(optimizer),
            accumulation_steps=config.accumulation_steps,
            labels=scheme,
            device=device,
        )
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
    rows = _cuda_rows(prediction, measured) if device_type == "cuda" else _cpu_rows(prediction, measured)
    return MemoryCheck(device_type, configuration, steps, rows, TOLERANCE, notes)


def _cuda_rows(prediction: StepPrediction, measured: dict[str, int]) -> tuple[MemoryRow, ...]:
    """The caching allocator's peaks and the device's used memory against the predicted device terms."""
    terms, tensors = prediction.device_terms, prediction.device_terms["tensors"]
    cached = tensors + terms["allocator_rounding"] + terms["fragmentation"] + terms["conv_workspace"]
    return (
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


def _cpu_rows(prediction: StepPrediction, measured: dict[str, int]) -> tuple[MemoryRow, ...]:
    """The tracked tensor peak and the process's peak RSS against the prediction: the RSS row adds what the step
    adds to its tensors and glibc's kept heap to the RSS measured before the step (checked); the model's own
    total is shown beside it, not checked."""
    terms, tensors = prediction.device_terms, prediction.device_terms["tensors"]
    added, heap = tensors - measured["baseline_tensor_bytes"], terms["fragmentation"]
    return (
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


@dataclass
class MemoryObserver:
    """Runs a configuration's first ``steps`` steps (``observer.step(train_step, batches)`` instead of
    ``train_step(batches)``), then compares their memory with the prediction, keeps the ``MemoryCheck`` in
    ``result`` and hands it to ``on_result``. The steps after those are the caller's (``watching`` is then False):
    the observer refuses them. A new configuration (a degradation) needs a new observer. The prediction is
    simulated when the observer is made (one ``simulate_training_step``), so the time budget's first timed
    iterations do not include it; the RSS baseline is measured after it."""

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

    @property
    def watching(self) -> bool:
        """Whether the check still needs steps."""
        return self.done < self.steps

    def step(self, step: TrainStep, batches: Iterator) -> Any:
        if not self.watching:
            raise RuntimeError(f"the memory check ran its {self.steps} steps; run the training step itself")
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
            f"Check it on the machine it was planned for ({config.device}: `autoseg check-memory -c {config_name} "
            f"--device {config.device} -w WORKSPACE`, WORKSPACE a copy of this workspace there), or plan for this one"
        )
