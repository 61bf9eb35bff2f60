"""One configuration planned under the budget: the settings tried, the search under each, the one chosen, its
predicted memory and the plan's notes (used by ``autoseg.plan.planner``).

Settings are tried in order of cost, the first whose patch is large enough wins (see ``_settings``):
CUDA: fp16 autocast with fp32 master weights (nnU-Net's AMP), then + activation checkpointing (about a
third more compute), then + micro-batch 1 with 2 accumulation steps. CPU: fp32, base width 16, then 8.
"Large enough": covers the whole median image or holds ``MIN_PATCH_VOXELS`` voxels.

Under each setting ``autoseg.plan.patch_search`` searches patch and batch so that the predicted device peak
of one training step (``autoseg.memory``: simulated, with the device's own overheads) stays under the budget
minus the safety margin, and on CPU an iteration stays within a time target. ``cascade_configuration``
derives ``3d_cascade_fullres`` from 3d_fullres's plan.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autoseg.core.errors import InputError
from autoseg.core.units import MiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.fit import predicted_training_bytes, training_memory_model
from autoseg.model.topology import NetworkTopology
from autoseg.plan.budget import Budget
from autoseg.plan.patch_search import SearchSpace, canonical, search
from autoseg.plan.plans import ConfigurationPlan
from autoseg.plan.step_cost import Candidate, Limits, PeakFn, Setting, StepCost, step_flops
from autoseg.plan.throughput import StepRates, cuda_flops_per_second, gpu_spec
from autoseg.plan.topology_rules import FEATURE_CAP, MIN_FEATURE_MAP

MIN_PATCH_VOXELS = {"cuda": {3: 96**3, 2: 256**2}, "cpu": {3: 24**3, 2: 64**2}}
CPU_BASE_FEATURES = (16, 8)
AMP_PRECISION = "fp16"  # the autocast dtype planned on CUDA (nnU-Net's AMP); Budget.precision overrides
FILL_TARGET = 0.85  # a memory-limited plan's predicted peak is at least this fraction of the budget
CASCADE = "3d_cascade_fullres"  # planned with 3d_lowres: 3d_fullres given 3d_lowres's prediction


def model_peak_fn(device: str) -> PeakFn:
    """The simulated memory model (``autoseg.memory.fit.predicted_training_bytes``) as the search's peak_fn."""

    def peak(topology, batch, patch, precision, checkpointing, accumulation_steps) -> int:
        return predicted_training_bytes(
            topology, batch, patch, precision, checkpointing, device=device, accumulation_steps=accumulation_steps
        )

    return peak


def checked_peak_fn(device: str) -> PeakFn:
    """The device peak of one step, simulated for just that step unless the setting's model is fitted
    already: the CPU search checks one chosen step, where fitting would cost three simulations."""

    def peak(topology, batch, patch, precision, checkpointing, accumulation_steps) -> int:
        model = training_memory_model(topology, precision, checkpointing, "sgd", accumulation_steps, device)
        return predict_device_peak(model.predict_or_simulate(batch, tuple(patch)), device)["total"]

    return peak


def cascade_configuration(
    full: ConfigurationPlan, space: SearchSpace, budget: Budget, peak_fn: PeakFn | None = None
) -> ConfigurationPlan:
    """``3d_cascade_fullres``: 3d_fullres (``full``) given 3d_lowres's prediction. Its data is 3d_fullres's
    (``preprocessed_as``, nothing preprocessed twice); its network takes ``space.in_channels`` inputs (the image's
    and one one-hot channel per predicted foreground value). Its patch, batch and settings are 3d_fullres's, its
    bytes predicted again by the same memory model (the wider input and first convolution counted); only where
    those no longer fit the budget is it searched afresh over ``space``."""
    network = replace(full.network, in_channels=space.in_channels)
    step = (
        network,
        full.batch_size,
        tuple(full.patch_size),
        full.precision,
        full.checkpointing,
        full.accumulation_steps,
    )
    memory = memory_terms(*step, budget.device) if peak_fn is None else {"predicted_peak_bytes": float(peak_fn(*step))}
    stages = {"previous_stage": "3d_lowres", "preprocessed_as": "3d_fullres"}
    note = (
        f"the cascade's second stage: 3d_fullres given 3d_lowres's predicted label map, one-hot, as "
        f"{space.in_channels - full.network.in_channels} extra input channel(s); trains on 3d_fullres's "
        "preprocessed data"
    )
    if memory["predicted_peak_bytes"] > budget.memory_limit_bytes:
        planned = configuration(CASCADE, full.spacing_mm, full.median_shape_zyx, space, budget, peak_fn)
        return planned.with_(
            notes=(note + "; searched afresh: 3d_fullres's patch and batch do not fit with the extra channels",)
            + planned.notes,
            **stages,
        )
    # the FLOPs of 3d_fullres's step (recomputation and accumulation included) scaled by the wider first convolution;
    # the feature maps are 3d_fullres's, so only the added FLOPs add seconds
    ratio = step_flops(network, full.patch_size, full.batch_size) / step_flops(
        full.network, full.patch_size, full.batch_size
    )
    seconds = full.predicted_seconds_per_iteration
    if seconds is not None and full.flops_per_iteration is not None:
        rates = step_limits(budget, full.precision)[0].rates
        seconds += full.flops_per_iteration * (ratio - 1) / rates.flops_per_second
    return full.with_(
        name=CASCADE,
        network=network,
        memory=memory,
        notes=(note,) + full.notes,
        flops_per_iteration=full.flops_per_iteration and full.flops_per_iteration * ratio,
        predicted_seconds_per_iteration=seconds,
        **stages,
    )


def candidate_settings(budget: Budget, dim: int) -> list[Setting]:
    """The settings to try, cheapest first (see the module docstring)."""
    cap, arch = FEATURE_CAP[dim], budget.architecture
    if budget.device == "cuda":
        base, precision = budget.base_features or 32, budget.precision or AMP_PRECISION
        return [
            Setting(base, cap, precision, False, False, arch),
            Setting(base, cap, precision, True, False, arch),
            Setting(base, cap, precision, True, True, arch),
        ]
    bases = (budget.base_features,) if budget.base_features else CPU_BASE_FEATURES
    return [Setting(b, cap, "fp32", False, False, arch) for b in bases]


def step_limits(budget: Budget, precision: str) -> tuple[Limits, str]:
    """Memory and time limits, and where the throughput comes from (for the plan's notes)."""
    fill_bytes = (FILL_TARGET + 0.01) * budget.memory_bytes
    if budget.device == "cpu":
        return (
            Limits(budget.memory_limit_bytes, budget.cpu_seconds_per_iteration, budget.cpu_rates, fill_bytes),
            f"CPU throughput {budget.cpu_rates.describe()}",
        )
    spec, matched = gpu_spec(budget.gpu_name, budget.gpu_memory_bytes)
    source = f"{spec.name}'s tabulated throughput" + ("" if matched else " (a typical GPU of this memory)")
    rates = StepRates(cuda_flops_per_second(spec, precision))
    return Limits(budget.memory_limit_bytes, None, rates, fill_bytes), source


def _search(
    space: SearchSpace, setting: Setting, limits: Limits, peak_fn: PeakFn, device: str, check_fn: PeakFn | None = None
) -> tuple[Candidate | None, bool]:
    """``search`` under one setting; returns (candidate, limited by time). On CPU the time limit is searched
    first and the bytes checked at the end with ``check_fn`` (default ``peak_fn``), and searched with bytes
    too only if they do not fit."""
    if device == "cuda":
        return search(space, setting, StepCost(peak_fn, setting, limits)), False
    found = search(space, setting, StepCost(peak_fn, setting, limits, use_memory=False))
    if found is None:
        return None, True
    peak = StepCost(check_fn or peak_fn, setting, limits).peak(found.topology, found.batch, found.patch)
    cost = StepCost(peak_fn, setting, limits)
    if peak <= limits.memory_bytes:
        return replace(found, peak_bytes=peak), True
    return search(space, setting, cost), False


def configuration(
    name: str,
    spacing_mm: tuple[float, float, float],
    median_shape_zyx: tuple[int, ...],
    space: SearchSpace,
    budget: Budget,
    peak_fn: PeakFn | None = None,
) -> ConfigurationPlan:
    """Plan one configuration over ``space`` (its network's axes)."""
    model_backed = peak_fn is None
    peak_fn = peak_fn or model_peak_fn(budget.device)
    check_fn = checked_peak_fn(budget.device) if model_backed else peak_fn
    settings = candidate_settings(budget, len(space.median_shape))
    limits, source = step_limits(budget, settings[0].precision)
    setting, chosen, limited_by, notes = _choose(name, space, settings, limits, budget, peak_fn, check_fn)
    notes += _limit_notes(chosen, limited_by, budget, limits, source)
    return ConfigurationPlan(
        name=name,
        spacing_mm=spacing_mm,
        median_shape_zyx=tuple(median_shape_zyx),
        limited_by=limited_by,
        notes=notes,
        **chosen_fields(chosen, setting, budget, model_backed),
    )


def chosen_fields(chosen: Candidate, setting: Setting, budget: Budget, model_backed: bool) -> dict:
    """The ``ConfigurationPlan`` fields a search's ``chosen`` candidate in ``setting`` decides: patch, batch,
    accumulation, network, precision, checkpointing, device, the memory terms (``memory_terms``; a test's own
    ``peak_fn``, not ``model_backed``: its peak alone) and the predicted time and FLOPs of an iteration."""
    memory = (
        memory_terms(
            chosen.topology,
            chosen.batch,
            chosen.patch,
            setting.precision,
            setting.checkpointing,
            chosen.accumulation_steps,
            budget.device,
        )
        if model_backed
        else {"predicted_peak_bytes": float(chosen.peak_bytes)}
    )
    return dict(
        patch_size=chosen.patch,
        batch_size=chosen.batch,
        accumulation_steps=chosen.accumulation_steps,
        network=chosen.topology,
        precision=setting.precision,
        checkpointing=setting.checkpointing,
        device=budget.device,
        memory=memory,
        predicted_seconds_per_iteration=chosen.seconds,
        flops_per_iteration=chosen.flops,
    )


def _choose(
    name: str,
    space: SearchSpace,
    settings: list[Setting],
    limits: Limits,
    budget: Budget,
    peak_fn: PeakFn,
    check_fn: PeakFn,
) -> tuple[Setting, Candidate, str, tuple[str, ...]]:
    """The settings searched in order until one's patch is large enough; the first large enough, else the one
    covering the most; if none fits, the smallest network (an ``InputError`` naming the budget it needs when
    even that one does not fit). Returns (setting, candidate, what limited it, notes on why)."""
    minimum = min(MIN_PATCH_VOXELS[budget.device][len(space.median_shape)], math.prod(space.median_shape))
    attempts: list[tuple[Setting, Candidate | None, bool]] = []
    for setting in settings:
        found, by_time = _search(space, setting, limits, peak_fn, budget.device, check_fn)
        attempts.append((setting, found, by_time))
        if found is not None and (found.coverage >= 1.0 or math.prod(found.patch) >= minimum):
            break
    tried = [a for a in attempts if a[1] is not None]
    if tried:
        large = [t for t in tried if t[1].coverage >= 1.0 or math.prod(t[1].patch) >= minimum]
        setting, chosen, by_time = large[0] if large else max(tried, key=lambda t: t[1].coverage)
        notes = _setting_notes(attempts[: [a[0] for a in attempts].index(setting) + 1], minimum)
        limited_by = _limited_by(chosen, by_time)
    else:
        setting = settings[-1]
        chosen, limited_by = _smallest(space, setting, StepCost(peak_fn, setting, limits)), "nothing_fits"
        if chosen.peak_bytes > limits.memory_bytes:
            raise InputError(_too_small_message(name, chosen, setting, budget))
        seconds = chosen.seconds
        notes = (
            f"the search found no patch within the limits; the smallest, {chosen.patch} at batch 1, is "
            f"used: predicted {chosen.peak_bytes / MiB:.0f} MiB of the {limits.memory_bytes / MiB:.0f} MiB "
            f"allowed"
            + ("" if limits.seconds is None else f", {seconds:.2f} s per iteration (target {limits.seconds:g} s)"),
        )
    return setting, chosen, limited_by, notes


def _too_small_message(name: str, smallest: Candidate, setting: Setting, budget: Budget) -> str:
    """Why no network fits, and the smallest budget that holds the smallest one (its peak + the safety margin)."""
    flag = "--gpu-memory" if budget.device == "cuda" else "--ram"
    needed_mib = math.ceil(smallest.peak_bytes / (1.0 - budget.safety_margin) / MiB)
    return (
        f"{name}: no network fits a budget of {budget.memory_bytes / MiB:.0f} MiB ({flag}): the smallest one "
        f"(patch {smallest.patch}, batch 1, {_describe(setting)}) is predicted to need "
        f"{smallest.peak_bytes / MiB:.0f} MiB at its peak; give at least {flag} {needed_mib}MiB "
        f"(with its {budget.safety_margin:.0%} safety margin)"
        + ("" if budget.device == "cpu" else ", or plan for CPU training with --device cpu")
    )


def _setting_notes(attempts: list[tuple[Setting, Candidate | None, bool]], minimum: int) -> tuple[str, ...]:
    """Why the last setting of ``attempts`` was needed: what each earlier one left."""
    chosen = attempts[-1][0]
    uses = [
        what
        for what, used in (
            ("activation checkpointing (about 1/3 more compute)", chosen.checkpointing),
            ("micro-batch 1 with 2 accumulation steps (effective batch 2)", chosen.single),
            (
                f"base width {chosen.base_features} instead of {attempts[0][0].base_features}",
                chosen.base_features != attempts[0][0].base_features,
            ),
        )
        if used
    ]
    if not uses:
        return ()
    left = [
        f"nothing fits with {_describe(s)}"
        if c is None
        else f"with {_describe(s)} the largest patch that fits is {c.patch} at batch {c.batch} "
        f"({math.prod(c.patch)} voxels)"
        for s, c, _ in attempts[:-1]
    ]
    return (f"{' and '.join(uses)}: {'; '.join(left)}, fewer than the minimum {minimum} voxels",)


def _describe(setting: Setting) -> str:
    return (
        f"{setting.precision}, base width {setting.base_features}, checkpointing "
        f"{'on' if setting.checkpointing else 'off'}, micro-batch {'1' if setting.single else '>= 2'}"
    )


def _limited_by(chosen: Candidate, by_time: bool) -> str:
    """What stopped the plan from growing: "median_shape" / "batch_cap" (the patch covers the median image,
    the batch is limited by memory / by the 5% rule), "time" (CPU), or "memory"."""
    if chosen.coverage >= 1.0:
        return "batch_cap" if chosen.batch >= chosen.max_batch and chosen.accumulation_steps == 1 else "median_shape"
    return "time" if by_time else "memory"


def _limit_notes(chosen: Candidate, limited_by: str, budget: Budget, limits: Limits, source: str) -> tuple[str, ...]:
    seconds = chosen.seconds
    notes = [f"predicted {seconds:.2f} s per iteration from {source}"]
    if limited_by == "median_shape":
        what = "memory" if budget.device == "cuda" else "the time target"
        notes.append(
            f"the patch covers the whole median image; the batch is as large as {what} allows, so the "
            f"predicted peak may stay under {FILL_TARGET:.0%} of the budget (exempt)"
        )
    elif limited_by == "batch_cap":
        notes.append(
            f"the patch covers the whole median image and the batch is capped at {chosen.batch} (one "
            "batch covers at most 5% of the dataset's voxels); the rest of the budget is not needed (exempt)"
        )
    elif limited_by == "time":
        notes.append(f"sized for time on CPU: target {limits.seconds} s per iteration; memory is not the limit")
    return tuple(notes)


def _smallest(space: SearchSpace, setting: Setting, cost: StepCost) -> Candidate:
    topology, patch = canonical(space, setting, tuple(min(m, 2 * MIN_FEATURE_MAP) for m in space.median_shape))
    return cost.candidate(topology, 1, patch, space.coverage(patch), space.max_batch(patch), accumulation_steps=2)


def memory_terms(
    topology: NetworkTopology,
    batch: int,
    patch: tuple[int, ...],
    precision: str,
    checkpointing: bool,
    accumulation_steps: int,
    device: str,
) -> dict[str, float]:
    """The predicted peak of one training step and its terms in bytes: the device's (``predict_device_peak``) and
    the tensors' (``TrainingMemory.breakdown``)."""
    model = training_memory_model(topology, precision, checkpointing, "sgd", accumulation_steps, device)
    step = model.predict_or_simulate(batch, tuple(patch))
    device_terms = predict_device_peak(step, device)
    terms = {"predicted_peak_bytes": float(device_terms.pop("total"))}
    terms.update({k: float(v) for k, v in device_terms.items()})
    terms.update({k: float(v) for k, v in step.breakdown().items() if k != "total"})
    return terms
