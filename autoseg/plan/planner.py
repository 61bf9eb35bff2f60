"""The planner: from a fingerprint and a budget (device memory, host RAM, device kind) to Plans.

Per configuration it derives the target spacing, then searches network depth and pooling per axis (from
the patch and the spacing), width, patch size, micro-batch, gradient accumulation, precision and
activation checkpointing (``autoseg.plan.patch_search``) so that the predicted device peak of one training step
(``autoseg.memory``: simulated, with the device's own overheads) stays under the budget minus the safety
margin, and on CPU an iteration stays within a time target. Configurations: ``3d_fullres`` (3D data),
``3d_lowres`` (when the fullres patch covers less than a quarter of the median image) and with it
``3d_cascade_fullres`` (``cascade_configuration``: 3d_fullres's spacing, patch and data, its network taking the
one-hot of 3d_lowres's predicted label map as extra input channels; docs/find_best.md), ``2d``.

The network's architecture is the budget's (``Budget.architecture``: ``plain_unet`` or ``residual_encoder_unet``,
``autoseg plan --architecture unet|resenc``); every architecture is sized by simulating its own training step.

Settings are tried in order of cost, the first whose patch is large enough wins (see ``_settings``):
CUDA: fp16 autocast with fp32 master weights (nnU-Net's AMP), then + activation checkpointing (about a
third more compute), then + micro-batch 1 with 2 accumulation steps. CPU: fp32, base width 16, then 8.
"Large enough": covers the whole median image or holds ``MIN_PATCH_VOXELS`` voxels.

Host RAM: preprocessing processes, and each configuration's loader workers, are as many as
``HOST_RAM_FRACTION`` of the host RAM budget holds (``autoseg.plan.sizing``, with the bytes of
``autoseg.memory.host``), capped by the CPU count; no loader workers when training on CPU
(they would take the cores the training step uses).

Each configuration's inference tile (``inference_patch_size``) is planned last, from its patch, network and
median image (``autoseg.plan.inference_tile``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.spacing import ANISOTROPY_THRESHOLD
from autoseg.core.units import MiB
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.device import predict_device_peak
from autoseg.memory.fit import predicted_training_bytes, training_memory_model
from autoseg.model.topology import NetworkTopology
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.inference_tile import plan_inference_tile
from autoseg.plan.patch_search import SearchSpace, canonical, search
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.sizing import host_workers, loader_workers
from autoseg.plan.step_cost import Candidate, Limits, PeakFn, Setting, StepCost, step_flops
from autoseg.plan.throughput import StepRates, cuda_flops_per_second, gpu_spec
from autoseg.plan.topology_rules import FEATURE_CAP, MIN_FEATURE_MAP

MIN_PATCH_VOXELS = {"cuda": {3: 96**3, 2: 256**2}, "cpu": {3: 24**3, 2: 64**2}}
CPU_BASE_FEATURES = (16, 8)
LOWRES_THRESHOLD = 0.25  # plan 3d_lowres when the fullres patch covers less of the median image
LOWRES_TARGET = 0.5  # ... with a spacing at which a patch of that size covers this much
LOWRES_STEP = 1.03
AMP_PRECISION = "fp16"  # the autocast dtype planned on CUDA (nnU-Net's AMP); Budget.precision overrides
FILL_TARGET = 0.85  # a memory-limited plan's predicted peak is at least this fraction of the budget
CASCADE = "3d_cascade_fullres"  # planned with 3d_lowres: 3d_fullres given 3d_lowres's prediction


def target_spacing(spacings_mm: np.ndarray, shapes_zyx: np.ndarray) -> tuple[float, float, float]:
    """Median spacing; on a strongly anisotropic axis the 10th percentile instead (finer), never finer
    than the coarsest other axis. ``spacings_mm`` and ``shapes_zyx`` are (N, 3)."""
    target = np.median(spacings_mm, axis=0)
    median_shape = np.median(shapes_zyx, axis=0)
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = target[worst] > ANISOTROPY_THRESHOLD * min(target[others])
    aniso_voxels = median_shape[worst] * ANISOTROPY_THRESHOLD < min(median_shape[others])
    if aniso_spacing and aniso_voxels:
        p10 = float(np.percentile(spacings_mm[:, worst], 10))
        target[worst] = max(p10, max(target[others])) + 1e-5
    return tuple(float(v) for v in target)  # type: ignore[return-value]


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


def plan(fp: Fingerprint, budget: Budget, peak_fn: PeakFn | None = None) -> Plans:
    """Plans for every configuration that suits the dataset. ``peak_fn`` replaces the simulated memory
    model (e.g. ``rough_training_peak_bytes`` for a fast, approximate plan)."""
    spacing = target_spacing(fp.spacings, fp.cropped_shapes)
    # network outputs: classes with background, or regions (ignore is never one)
    in_ch, num_outputs = (
        len(fp.channel_names),
        LabelScheme.from_labels(fp.labels, fp.regions_class_order, where="fingerprint.json labels").num_outputs,
    )
    configs: dict[str, ConfigurationPlan] = {}
    if fp.image_dim == 3:
        full = _plan_3d(fp, "3d_fullres", spacing, in_ch, num_outputs, budget, peak_fn)
        if full is not None:
            configs["3d_fullres"] = full
            coverage = math.prod(min(p / m, 1.0) for p, m in zip(full.patch_size, full.median_shape_zyx))
            if coverage < LOWRES_THRESHOLD:
                low = lowres_spacing(spacing, full.median_shape_zyx, math.prod(full.patch_size))
                lowres = _plan_3d(fp, "3d_lowres", low, in_ch, num_outputs, budget, peak_fn)
                configs["3d_lowres"] = lowres.with_(
                    notes=lowres.notes
                    + (
                        f"planned because 3d_fullres's patch covers {coverage:.0%} of the median image; alone, and "
                        f"as the first stage of {CASCADE}",
                    )
                )
                extra = len(LabelScheme.from_labels(fp.labels, fp.regions_class_order).predicted_values)
                space = _space_3d(fp, spacing, in_ch + extra, num_outputs)
                configs[CASCADE] = cascade_configuration(full, space, budget, peak_fn)
    # 2d: in-plane spacing of 3d_fullres, slices kept as they are (z spacing is each case's own)
    spacing_2d = (float(np.median(fp.spacings[:, 0])), spacing[1], spacing[2])
    resampled = fp.cropped_shapes * fp.spacings / np.array(spacing_2d)
    shape_2d = tuple(int(round(v)) for v in np.median(resampled, axis=0))
    space = SearchSpace(spacing_2d[1:], shape_2d[1:], in_ch, num_outputs, float(np.sum(np.prod(resampled, axis=1))))
    configs["2d"] = configuration("2d", spacing_2d, shape_2d, space, budget, peak_fn)
    normalization = tuple(scheme_for_channel(c) for c in fp.channel_names)
    use_mask = tuple(n == "zscore" and fp.median_relative_crop_volume < 0.75 for n in normalization)
    processes, host = host_workers(fp, configs, budget)
    # the inference tile from the memory model; a plan with a stand-in peak_fn predicts with the training patch
    configs = {
        name: cfg.with_(
            **loader_workers(cfg, cfg.network.in_channels, budget),
            inference_patch_size=(plan_inference_tile(cfg, budget.memory_bytes) if peak_fn is None else cfg.patch_size),
        )
        for name, cfg in configs.items()
    }
    return Plans(
        dataset_name=fp.dataset_name,
        channel_names=fp.channel_names,
        labels=dict(fp.labels),
        regions_class_order=fp.regions_class_order,
        file_ending=fp.file_ending,
        normalization=normalization,
        use_nonzero_mask=use_mask,
        intensity_properties=fp.foreground_intensity,
        configurations=configs,
        gpu_memory_bytes=int(budget.gpu_memory_bytes),
        host_ram_bytes=int(budget.host_ram_bytes),
        preprocessing_processes=processes,
        host_memory=host,
        cpu_flops_per_second=budget.cpu_flops_per_second if budget.device == "cpu" else None,
        cpu_elements_per_second=budget.cpu_elements_per_second if budget.device == "cpu" else None,
        cpu_mapped_bytes_per_second=budget.cpu_mapped_bytes_per_second if budget.device == "cpu" else None,
    )


def _space_3d(fp: Fingerprint, spacing: tuple[float, float, float], in_ch: int, num_outputs: int) -> SearchSpace:
    resampled = fp.cropped_shapes * fp.spacings / np.array(spacing)
    median = tuple(int(round(v)) for v in np.median(resampled, axis=0))
    return SearchSpace(tuple(spacing), median, in_ch, num_outputs, float(np.sum(np.prod(resampled, axis=1))))


def _plan_3d(
    fp: Fingerprint,
    name: str,
    spacing: tuple[float, float, float],
    in_ch: int,
    num_outputs: int,
    budget: Budget,
    peak_fn: PeakFn | None,
) -> ConfigurationPlan | None:
    space = _space_3d(fp, spacing, in_ch, num_outputs)
    if space.median_shape[0] <= 1:
        return None
    return configuration(name, spacing, space.median_shape, space, budget, peak_fn)


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
    memory = _memory_terms(*step, budget.device) if peak_fn is None else {"predicted_peak_bytes": float(peak_fn(*step))}
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
        rates = _limits(budget, full.precision)[0].rates
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


def lowres_spacing(
    spacing_mm: tuple[float, float, float], median_shape_zyx: tuple[int, ...], patch_voxels: float
) -> tuple[float, float, float]:
    """Coarser spacing (LOWRES_STEP at a time; axes finer than half the coarsest first, as nnU-Net) until a
    patch of ``patch_voxels`` covers LOWRES_TARGET of the median image at that spacing."""
    spacing = np.array(spacing_mm, dtype=np.float64)
    physical = np.array(median_shape_zyx) * spacing
    for _ in range(1000):
        if patch_voxels / float(np.prod(physical / spacing)) >= LOWRES_TARGET:
            break
        grow = spacing * 2 < spacing.max()
        spacing[grow if grow.any() else slice(None)] *= LOWRES_STEP
    return tuple(float(s) for s in spacing)  # type: ignore[return-value]


def _settings(budget: Budget, dim: int) -> list[Setting]:
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


def _limits(budget: Budget, precision: str) -> tuple[Limits, str]:
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
    dim = len(space.median_shape)
    minimum = min(MIN_PATCH_VOXELS[budget.device][dim], math.prod(space.median_shape))
    settings = _settings(budget, dim)
    limits, source = _limits(budget, settings[0].precision)
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
    memory = (
        _memory_terms(
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
    notes += _limit_notes(chosen, limited_by, budget, limits, source)
    return ConfigurationPlan(
        name=name,
        spacing_mm=spacing_mm,
        median_shape_zyx=tuple(median_shape_zyx),
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
        limited_by=limited_by,
        notes=notes,
    )


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


def _memory_terms(
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


def scheme_for_channel(channel_name: str) -> str:
    """Default normalization (a name in ``autoseg.preprocess.normalization.NORMALIZERS``) for a channel named in
    dataset.json: "CT" -> "ct", "noNorm" -> "none", "rescale_to_0_1" -> "rescale", anything else -> "zscore"
    (names compared case-insensitively)."""
    name = channel_name.strip().lower()
    return {"ct": "ct", "nonorm": "none", "rescale_to_0_1": "rescale"}.get(name, "zscore")
