"""What to do when a training step runs out of device memory: a planned, recorded degradation.

Both options keep the effective batch (micro-batch x accumulation steps), so the optimisation is the same
problem: (a) halve the micro-batch and double the accumulation steps (for an odd micro-batch: its largest
proper divisor), (b) turn on activation checkpointing. The memory model (``simulate_training_step`` +
``predict_device_peak``) ranks them; the one with the lower predicted peak is taken. With a micro-batch
of 1 and checkpointing already on nothing is left: the error says what was predicted, what the device
has, and what to change.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from autoseg.core.precision import effective_precision
from autoseg.core.units import GiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.step_record import StepConfig
from autoseg.memory.training import simulate_training_step
from autoseg.plan.plans import ConfigurationPlan

log = logging.getLogger("autoseg.train.trainer")


def _smaller_micro_batch(batch_size: int) -> int | None:
    """The largest divisor of ``batch_size`` that is at most half of it (None for 1)."""
    for b in range(batch_size // 2, 0, -1):
        if batch_size % b == 0:
            return b
    return None


def _predicted(config: ConfigurationPlan, device: str) -> int:
    """Predicted device bytes of one step (one simulation; cheaper here than fitting a memory model)."""
    memory = simulate_training_step(
        StepConfig(
            config.network,
            config.batch_size,
            tuple(config.patch_size),
            precision=effective_precision(config.precision, device),
            checkpointing=config.checkpointing,
            accumulation_steps=config.accumulation_steps,
            device="cuda" if device == "cuda" else "cpu",
        )
    )
    return predict_device_peak(memory, "cuda" if device == "cuda" else "cpu")["total"]


def degradation_options(config: ConfigurationPlan) -> list[tuple[str, ConfigurationPlan]]:
    """(name, degraded configuration) pairs, each keeping the effective batch."""
    options = []
    smaller = _smaller_micro_batch(config.batch_size)
    if smaller is not None:
        options.append(
            (
                "halve_micro_batch",
                config.with_(
                    batch_size=smaller, accumulation_steps=config.accumulation_steps * config.batch_size // smaller
                ),
            )
        )
    if not config.checkpointing:
        options.append(("activation_checkpointing", config.with_(checkpointing=True)))
    return options


def device_memory_bytes(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(device)


def choose_degradation(config: ConfigurationPlan, device: torch.device) -> tuple[ConfigurationPlan, dict[str, Any]]:
    """The degraded configuration with the lower predicted peak, and its record for run.json / the
    checkpoint. Raises ``torch.OutOfMemoryError`` (explaining predicted vs available memory) if the
    micro-batch is 1 and checkpointing is already on."""
    current = _predicted(config, device.type)
    options = degradation_options(config)
    if not options:
        memory = device_memory_bytes(device)
        available = (
            "unknown on this device"
            if memory is None
            else f"{memory[1] / GiB:.2f} GiB in total, {memory[0] / GiB:.2f} GiB free now"
        )
        raise torch.OutOfMemoryError(
            f"out of device memory with a micro-batch of 1 and activation checkpointing on: nothing left to "
            f"degrade. The memory model predicts {current / GiB:.2f} GiB for patch {tuple(config.patch_size)} "
            f"({config.precision}); the device has {available}. Plan again with a lower --gpu-memory (e.g. "
            "what the device has free, minus other processes), or edit a smaller patch_size into plans.json"
        )
    ranked = sorted(((_predicted(c, device.type), name, c) for name, c in options), key=lambda t: t[0])
    predicted, name, chosen = ranked[0]
    record = {
        "action": name,
        "from": {
            "batch_size": config.batch_size,
            "accumulation_steps": config.accumulation_steps,
            "checkpointing": config.checkpointing,
            "predicted_bytes": current,
        },
        "to": {
            "batch_size": chosen.batch_size,
            "accumulation_steps": chosen.accumulation_steps,
            "checkpointing": chosen.checkpointing,
            "predicted_bytes": predicted,
        },
        "alternatives": {n: p for p, n, _ in ranked[1:]},
    }
    return chosen, record


def apply_degradations(config: ConfigurationPlan, degradations: list[dict[str, Any]]) -> ConfigurationPlan:
    """The configuration after the recorded degradations (what a resumed run trains with)."""
    for d in degradations:
        to = d["to"]
        config = config.with_(
            batch_size=to["batch_size"], accumulation_steps=to["accumulation_steps"], checkpointing=to["checkpointing"]
        )
    return config


def log_degradation(record: dict[str, Any]) -> None:
    f, t = record["from"], record["to"]
    others = ", ".join(f"{n} {p / GiB:.3f} GiB" for n, p in record["alternatives"].items()) or "none"
    log.warning(
        "out of memory at epoch %d iteration %d: %s -> micro-batch %d x %d accumulation, checkpointing "
        "%s (predicted peak %.3f GiB, was %.3f GiB; other options: %s)",
        record["epoch"],
        record["iteration"],
        record["action"],
        t["batch_size"],
        t["accumulation_steps"],
        "on" if t["checkpointing"] else "off",
        t["predicted_bytes"] / GiB,
        f["predicted_bytes"] / GiB,
        others,
    )
