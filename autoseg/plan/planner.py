"""The planner: from a fingerprint and a budget (device memory, host RAM, device kind) to Plans.

Per configuration it derives the target spacing, then plans the configuration (``autoseg.plan.configuration``):
network depth and pooling per axis (from the patch and the spacing), width, patch size, micro-batch, gradient
accumulation, precision and activation checkpointing (``autoseg.plan.patch_search``) so that the predicted
device peak of one training step (``autoseg.memory``: simulated, with the device's own overheads) stays under
the budget minus the safety margin, and on CPU an iteration stays within a time target. Configurations:
``3d_fullres`` (3D data), ``3d_lowres`` (when the fullres patch covers less than a quarter of the median image)
and with it ``3d_cascade_fullres`` (``cascade_configuration``: 3d_fullres's spacing, patch and data, its network
taking the one-hot of 3d_lowres's predicted label map as extra input channels; docs/find_best.md), ``2d``.

The network's architecture is the budget's (``Budget.architecture``: ``plain_unet`` or ``residual_encoder_unet``,
``autoseg plan --architecture unet|resenc``); every architecture is sized by simulating its own training step.

Host RAM: preprocessing processes, and each configuration's loader workers, are as many as
``HOST_RAM_FRACTION`` of the host RAM budget holds (``autoseg.plan.sizing``, with the bytes of
``autoseg.memory.host``), capped by the CPU count; no loader workers when training on CPU
(they would take the cores the training step uses).

``plan(..., like=PlanTemplate)`` (``autoseg plan --like MODEL``) plans instead each of a trained model's
configurations with its network, target spacing and patch (``autoseg.plan.like``), only batch, accumulation and
checkpointing sized to the budget.

Each configuration's inference tile (``inference_patch_size``) is planned last, from its patch, network and
median image (``autoseg.plan.inference_tile``).
"""

from __future__ import annotations

import math

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.spacing import ANISOTROPY_THRESHOLD
from autoseg.dataset.labels import LabelScheme
from autoseg.plan.budget import Budget
from autoseg.plan.configuration import CASCADE, cascade_configuration, configuration
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.inference_tile import plan_inference_tile
from autoseg.plan.like import PlanTemplate, like_configuration
from autoseg.plan.patch_search import SearchSpace
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.sizing import host_workers, loader_workers
from autoseg.plan.step_cost import PeakFn

LOWRES_THRESHOLD = 0.25  # plan 3d_lowres when the fullres patch covers less of the median image
LOWRES_TARGET = 0.5  # ... with a spacing at which a patch of that size covers this much
LOWRES_STEP = 1.03


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


def plan(fp: Fingerprint, budget: Budget, peak_fn: PeakFn | None = None, like: PlanTemplate | None = None) -> Plans:
    """Plans for every configuration that suits the dataset. ``peak_fn`` replaces the simulated memory
    model (e.g. ``rough_training_peak_bytes`` for a fast, approximate plan). ``like``: the configurations of a
    trained model, planned with its network (``autoseg.plan.like``; ``autoseg plan --like``)."""
    # network outputs: classes with background, or regions (ignore is never one)
    in_ch, num_outputs = (
        len(fp.channel_names),
        LabelScheme.from_labels(fp.labels, fp.regions_class_order, where="fingerprint.json labels").num_outputs,
    )
    if like is not None:
        configs = _plan_like(fp, like, in_ch, num_outputs, budget, peak_fn)
    else:
        spacing = target_spacing(fp.spacings, fp.cropped_shapes)
        configs = _plan_3d_configurations(fp, spacing, in_ch, num_outputs, budget, peak_fn) if fp.image_dim == 3 else {}
        configs["2d"] = _plan_2d(fp, spacing, in_ch, num_outputs, budget, peak_fn)
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
        **_cpu_time_fields(budget),
    )


def _cpu_time_fields(budget: Budget) -> dict:
    """The Plans fields that record what a CPU plan's steps were priced and sized by: the CPU rates and where they came
    from, and ``Budget.iteration`` (none for a CUDA plan: sized by memory, at the GPU table's throughput)."""
    if budget.device != "cpu":
        return {}
    target = budget.iteration
    return dict(
        cpu_flops_per_second=budget.cpu_flops_per_second,
        cpu_elements_per_second=budget.cpu_elements_per_second,
        cpu_mapped_bytes_per_second=budget.cpu_mapped_bytes_per_second,
        cpu_rates_source=budget.cpu_rates_source,
        cpu_seconds_per_iteration=target.seconds,
        time_budget_seconds=target.time_budget_seconds,
        iteration_reason=target.reason,
    )


def _plan_3d_configurations(
    fp: Fingerprint,
    spacing: tuple[float, float, float],
    in_ch: int,
    num_outputs: int,
    budget: Budget,
    peak_fn: PeakFn | None,
) -> dict[str, ConfigurationPlan]:
    """``3d_fullres``; where its patch covers less than ``LOWRES_THRESHOLD`` of the median image, ``3d_lowres``
    and the cascade on top of it. None of them for data whose median image is one slice thick."""
    configs: dict[str, ConfigurationPlan] = {}
    full = _plan_3d(fp, "3d_fullres", spacing, in_ch, num_outputs, budget, peak_fn)
    if full is None:
        return configs
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
        configs[CASCADE] = _cascade(fp, full, in_ch, num_outputs, budget, peak_fn)
    return configs


def _cascade(
    fp: Fingerprint, full: ConfigurationPlan, in_ch: int, num_outputs: int, budget: Budget, peak_fn: PeakFn | None
) -> ConfigurationPlan:
    """``3d_cascade_fullres`` over 3d_fullres (``full``): its input widened by the one-hot of 3d_lowres's prediction."""
    extra = len(LabelScheme.from_labels(fp.labels, fp.regions_class_order).predicted_values)
    space = _space_3d(fp, full.spacing_mm, in_ch + extra, num_outputs)
    return cascade_configuration(full, space, budget, peak_fn)


def _plan_like(
    fp: Fingerprint, like: PlanTemplate, in_ch: int, num_outputs: int, budget: Budget, peak_fn: PeakFn | None
) -> dict[str, ConfigurationPlan]:
    """The model's configurations that suit the dataset (3D ones need 3D data; a cascade stage follows its stages),
    each with the model's network, target spacing and patch (``like_configuration``)."""
    configs: dict[str, ConfigurationPlan] = {}
    for name, model in like.configurations.items():
        if model.previous_stage or (model.dim == 3 and fp.image_dim != 3):
            continue
        if model.dim == 3:
            spacing, space = model.spacing_mm, _space_3d(fp, model.spacing_mm, in_ch, num_outputs)
            median = space.median_shape
        else:
            spacing, median, space = _space_2d(fp, model.spacing_mm, in_ch, num_outputs)
        if model.dim == 3 and median[0] <= 1:
            continue
        configs[name] = like_configuration(name, spacing, median, space, model, like.source, budget, peak_fn)
    if CASCADE in like.configurations and {"3d_fullres", "3d_lowres"} <= configs.keys():
        configs[CASCADE] = _cascade(fp, configs["3d_fullres"], in_ch, num_outputs, budget, peak_fn)
    if not configs:
        raise InputError(
            f"plan --like {like.source}: none of its configurations ({', '.join(like.configurations)}) suits this "
            f"{fp.image_dim}D dataset (a 3D network needs 3D images); give a model with a 2d configuration, or plan "
            "without --like"
        )
    return configs


def _plan_2d(
    fp: Fingerprint,
    spacing: tuple[float, float, float],
    in_ch: int,
    num_outputs: int,
    budget: Budget,
    peak_fn: PeakFn | None,
) -> ConfigurationPlan:
    """``2d``: the in-plane spacing of 3d_fullres, slices kept as they are (z spacing is each case's own)."""
    spacing_2d, shape_2d, space = _space_2d(fp, spacing, in_ch, num_outputs)
    return configuration("2d", spacing_2d, shape_2d, space, budget, peak_fn)


def _space_2d(
    fp: Fingerprint, spacing: tuple[float, float, float], in_ch: int, num_outputs: int
) -> tuple[tuple[float, float, float], tuple[int, ...], SearchSpace]:
    """A 2D configuration's spacing (z: the median slice spacing, in-plane: ``spacing``'s), its median (Z, Y, X)
    shape and its search space over (Y, X)."""
    spacing_2d = (float(np.median(fp.spacings[:, 0])), spacing[1], spacing[2])
    resampled = fp.cropped_shapes * fp.spacings / np.array(spacing_2d)
    shape_2d = tuple(int(round(v)) for v in np.median(resampled, axis=0))
    space = SearchSpace(spacing_2d[1:], shape_2d[1:], in_ch, num_outputs, float(np.sum(np.prod(resampled, axis=1))))
    return spacing_2d, shape_2d, space


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


def scheme_for_channel(channel_name: str) -> str:
    """Default normalization (a name in ``autoseg.preprocess.normalization.NORMALIZERS``) for a channel named in
    dataset.json: "CT" -> "ct", "noNorm" -> "none", "rescale_to_0_1" -> "rescale", anything else -> "zscore"
    (names compared case-insensitively)."""
    name = channel_name.strip().lower()
    return {"ct": "ct", "nonorm": "none", "rescale_to_0_1": "rescale"}.get(name, "zscore")
