"""The plan's budget from ``autoseg plan``'s flags: ``BudgetFlags`` (what was given), ``measure_budget`` (what the
flags leave open measured on this machine, and the ``Budget`` built), and the lines that say where each value came
from (``describe_budget``), which the command prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from autoseg.core.machine import MachineCache
from autoseg.core.resources import available_ram_bytes, cuda_total_memory
from autoseg.core.units import GiB
from autoseg.model.topology import ARCHITECTURES
from autoseg.plan.budget import Budget
from autoseg.plan.iteration_target import DEFAULT_TARGET, iteration_target

NO_CUDA_GPU_BYTES = 8 * GiB  # planned for when no CUDA device is found and --gpu-memory is not given


@dataclass(frozen=True)
class BudgetFlags:
    """``--gpu-memory``, ``--ram``, ``--device``, ``--architecture``, ``--cpu-flops``, ``--time-budget`` and
    ``--seconds-per-iteration`` as parsed (None: not given)."""

    gpu_memory_bytes: int | None
    ram_bytes: int | None
    device: str
    architecture: str
    cpu_flops: float | None
    time_budget_seconds: float | None = None
    seconds_per_iteration: float | None = None


@dataclass(frozen=True)
class MeasuredBudget:
    """A ``Budget`` and where its values came from (``describe_budget`` says it)."""

    budget: Budget
    gpu_memory_found: bool  # False: no CUDA device and no --gpu-memory: NO_CUDA_GPU_BYTES
    rates_text: str | None = None  # CPU training: the rates, described (where from: budget.cpu_rates_source)


def measure_budget(flags: BudgetFlags, cache_dir: Path) -> MeasuredBudget:
    """The budget ``flags`` ask for, each value they leave open measured here: the CUDA device's memory (none:
    ``NO_CUDA_GPU_BYTES``), the host RAM available now, and for CPU training the CPU's throughput (measured once and
    kept in ``cache_dir``, ``autoseg.plan.calibration.cpu_throughput``) or for CUDA training the GPU's name."""
    gpu = flags.gpu_memory_bytes if flags.gpu_memory_bytes is not None else cuda_total_memory()
    found = gpu is not None
    architecture = ARCHITECTURES[flags.architecture]
    budget = Budget(
        gpu_memory_bytes=gpu if found else NO_CUDA_GPU_BYTES,
        host_ram_bytes=flags.ram_bytes or available_ram_bytes(),
        device=flags.device,
        architecture=architecture,
        iteration=iteration_target(flags.time_budget_seconds, flags.seconds_per_iteration),
    )
    if flags.device != "cpu":
        from autoseg.plan.throughput import cuda_device_name

        return MeasuredBudget(replace(budget, gpu_name=cuda_device_name()), found)
    from autoseg.plan.calibration import cpu_throughput
    from autoseg.plan.throughput import StepRates

    rates, source = (
        (StepRates(flags.cpu_flops), "--cpu-flops") if flags.cpu_flops else cpu_throughput(MachineCache(cache_dir))
    )
    budget = replace(
        budget,
        cpu_flops_per_second=rates.flops_per_second,
        cpu_elements_per_second=rates.elements_per_second,
        cpu_mapped_bytes_per_second=rates.mapped_bytes_per_second,
        cpu_rates_source=source,
    )
    return MeasuredBudget(budget, found, rates.describe())


def describe_budget(measured: MeasuredBudget) -> list[str]:
    """The lines ``autoseg plan`` prints about its budget: a note when no GPU memory was found, the budget, and on
    CPU the throughput it plans for."""
    budget = measured.budget
    lines = []
    if not measured.gpu_memory_found:
        lines.append(
            f"note: no CUDA device found; planning for {NO_CUDA_GPU_BYTES / GiB:.0f} GiB of GPU memory (set "
            "--gpu-memory to change)"
        )
    lines.append(
        f"budget: GPU memory {budget.gpu_memory_bytes / GiB:.1f} GiB, host RAM {budget.host_ram_bytes / GiB:.1f} GiB, "
        f"training device {budget.device}, network {budget.architecture}"
    )
    if measured.rates_text is not None:
        lines.append(
            f"CPU throughput {measured.rates_text} ({budget.cpu_rates_source}); planning for "
            f"{budget.cpu_seconds_per_iteration:.2f} s per iteration: {budget.iteration.reason}"
        )
    elif budget.iteration != DEFAULT_TARGET:
        lines.append(
            "note: --time-budget and --seconds-per-iteration size CPU training only; a CUDA plan is sized by its "
            "memory (its steps take a fraction of a second)"
        )
    return lines
