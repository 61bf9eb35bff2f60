"""An nnU-Net v2 trained-model folder (``<Trainer>__<Plans>__<configuration>/``: plans.json, dataset.json,
dataset_fingerprint.json, fold_N/) read as an autoseg plan of one configuration and a fingerprint.

What is imported is decided by the network plans.json names (``architecture.network_class_name`` and its
``arch_kwargs``, or the older layout's ``UNet_class_name`` and sizes), never by the trainer's name: a PlainConvUNet or
a ResidualEncoderUNet of convolutions with bias, affine InstanceNorm (eps 1e-5) and LeakyReLU (slope 0.01), as
autoseg's ``plain_unet`` and ``residual_encoder_unet`` are (``autoseg.nnunet.network``); a cascade stage together with
its previous stage's folder (``autoseg.nnunet.cascade``). nnU-Net's preprocessing is what autoseg's does when its
plan says so: CTNormalization (the fingerprint's foreground intensity properties), ZScoreNormalization (with
``use_mask_for_norm`` as the nonzero mask), NoNormalization; the target spacing; image resampling with a cubic spline
and nearest across the thick axis, probabilities linear and nearest across it (``resampling_fn_*_kwargs`` with
orders 3/0 and 1/0, ``force_separate_z`` null). Anything else is refused naming the file and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoseg.core.errors import InputError
from autoseg.dataset.labels import LabelScheme
from autoseg.nnunet import cascade
from autoseg.nnunet.axes import in_autoseg_order, network_axes
from autoseg.nnunet.network import topology_of
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.plans import ConfigurationPlan, IntensityProperties, Plans

SUPPORTED_CONFIGURATIONS = ("3d_fullres", "2d", "3d_lowres", "3d_cascade_fullres")
NORMALIZATIONS = {"CTNormalization": "ct", "ZScoreNormalization": "zscore", "NoNormalization": "none"}
# resampling_fn_*_kwargs: the orders autoseg's preprocessing (image) and export (probabilities) use
RESAMPLING = {
    "resampling_fn_data_kwargs": {"order": 3, "order_z": 0, "force_separate_z": None},
    "resampling_fn_probabilities_kwargs": {"order": 1, "order_z": 0, "force_separate_z": None},
}
RESAMPLING_FUNCTION = "resample_data_or_seg_to_shape"
REQUIRED_KEYS = ("patch_size", "spacing", "normalization_schemes")  # a configuration's lists read here
NNUNET_2D_SPACING_Z = 999.0  # what nnU-Net's 2D image readers give a 2D image's third axis


@dataclass(frozen=True)
class NnunetModel:
    """A model folder read: its configuration's name, the autoseg plan and fingerprint that stand for it, and the
    folds it holds (``fold_<k>`` folders with ``checkpoint_final.pth``)."""

    folder: Path
    config_name: str
    plans: Plans
    fingerprint: Fingerprint
    folds: tuple[int | str, ...]
    network_axes: tuple[int, ...]  # autoseg's spatial axis j is nnU-Net's network axis network_axes[j] (axes.py)
    previous: NnunetModel | None = None  # a cascade stage's previous stage (its folder; ``plans`` is this one's)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise InputError(
            f"{path}: missing; an nnU-Net v2 trained-model folder holds plans.json, dataset.json and "
            "dataset_fingerprint.json beside its fold_N folders (give the folder nnUNetv2_train wrote)"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}: holds a {type(data).__name__}, not a JSON object")
    return data


# How nnU-Net's own prediction runs where autoseg's plan names a choice (``Plans`` fields), for an imported model
NNUNET_PREDICTION = {
    "image_resampling": "skimage",  # nnU-Net's resample_data_or_seg_to_shape resizes with skimage
    "export_space": "logits",  # nnU-Net resamples the averaged logits, then applies softmax / sigmoid and argmax
    "gaussian_centre": "floor",  # nnU-Net's importance map: a delta at size // 2, Gaussian-filtered
}


def read_model_folder(folder: Path, previous_stage: Path | None = None) -> NnunetModel:
    """The model folder ``folder`` as an autoseg plan of its configuration (the folder name's last ``__`` part); a
    cascade stage (``previous_stage`` in plans.json) with its previous stage's model folder ``previous_stage`` as a
    plan of both (``autoseg.nnunet.cascade``)."""
    plans_json = read_json(folder / "plans.json")
    dataset_json = read_json(folder / "dataset.json")
    fingerprint_json = read_json(folder / "dataset_fingerprint.json")
    config_name = folder.name.rsplit("__", 1)[-1]
    configs = plans_json.get("configurations", {})
    if config_name not in configs:
        raise InputError(
            f"{folder}: the folder's name ends in configuration {config_name!r}, which plans.json does not hold "
            f"({sorted(configs)}); give the folder as nnUNetv2_train named it (<Trainer>__<Plans>__<configuration>)"
        )
    if config_name not in SUPPORTED_CONFIGURATIONS:
        raise InputError(
            f"{folder}: configuration {config_name!r} is not supported (only {', '.join(SUPPORTED_CONFIGURATIONS)})"
        )
    config = resolved_configuration(configs, config_name, folder / "plans.json")
    stage = cascade.previous_stage_name(config, folder, previous_stage)
    where = f"{folder / 'plans.json'}: configuration {config_name!r}"
    missing = [k for k in REQUIRED_KEYS if not isinstance(config.get(k), list)]
    if missing:
        raise InputError(f"{where}: no {', '.join(missing)} list; this is not an nnU-Net v2 plans.json")
    axes = network_axes(plans_json.get("transpose_forward", [0, 1, 2]), len(config["patch_size"]), where)
    channels = _channel_names(dataset_json, folder / "dataset.json")
    labels = dataset_json.get("labels")
    if not isinstance(labels, dict):
        raise InputError(f"{folder / 'dataset.json'}: no 'labels' object")
    regions = tuple(int(v) for v in dataset_json.get("regions_class_order") or ())
    scheme = LabelScheme.from_labels(labels, regions, where=f"{folder / 'dataset.json'} labels")
    inputs = len(channels) + (len(cascade.one_hot_values(scheme, labels, folder)) if stage else 0)
    properties = plans_json.get("foreground_intensity_properties_per_channel") or fingerprint_json.get(
        "foreground_intensity_properties_per_channel", {}
    )
    plans = Plans(
        dataset_name=str(plans_json.get("dataset_name", folder.parent.name)),
        channel_names=channels,
        labels=labels,
        file_ending=str(dataset_json.get("file_ending", ".nii.gz")),
        normalization=_normalization(config, len(channels), where),
        use_nonzero_mask=tuple(bool(v) for v in config.get("use_mask_for_norm", [False] * len(channels))),
        intensity_properties=_intensity_properties(properties, len(channels), folder),
        configurations={
            config_name: replace(
                _configuration(plans_json, config, config_name, (inputs, scheme.num_outputs, axes), where),
                previous_stage=stage,
            )
        },
        gpu_memory_bytes=0,
        host_ram_bytes=0,
        regions_class_order=regions,
        **NNUNET_PREDICTION,
    )
    model = NnunetModel(folder, config_name, plans, _fingerprint(fingerprint_json, plans, folder), _folds(folder), axes)
    if stage:
        model = _with_previous_stage(model, read_model_folder(previous_stage), where)
    model.plans.check(where)
    return model


def _with_previous_stage(model: NnunetModel, previous: NnunetModel, where: str) -> NnunetModel:
    """The cascade stage ``model`` with its previous stage (read on its own), both carrying the plan of both."""
    if previous.network_axes != model.network_axes:
        raise InputError(
            f"{previous.folder} and {model.folder}: their transpose_forward differ; a cascade's two stages are "
            "trained with one plans file (give the folders nnUNetv2_train wrote for both)"
        )
    plans = cascade.joined_plans(
        model.plans, previous.plans, previous.config_name, (model.folder, previous.folder), where
    )
    return replace(model, plans=plans, previous=replace(previous, plans=plans))


def resolved_configuration(configs: dict, name: str, path: Path) -> dict[str, Any]:
    """``configs[name]`` with what it ``inherits_from`` filled in (nnU-Net's configuration inheritance)."""
    seen, chain = set(), []
    while name is not None:
        if name in seen or name not in configs:
            raise InputError(f"{path}: configuration {name!r} inherits from a missing or circular configuration")
        seen.add(name)
        chain.append(configs[name])
        name = configs[name].get("inherits_from")
    merged: dict[str, Any] = {}
    for config in reversed(chain):
        merged |= config
    return merged


def _channel_names(dataset_json: dict, path: Path) -> tuple[str, ...]:
    names = dataset_json.get("channel_names") or dataset_json.get("modality")
    if not isinstance(names, dict) or not names:
        raise InputError(f"{path}: no 'channel_names' object")
    return tuple(str(names[k]) for k in sorted(names, key=int))


def _normalization(config: dict, channels: int, where: str) -> tuple[str, ...]:
    schemes = list(config.get("normalization_schemes", []))
    unknown = [s for s in schemes if s not in NORMALIZATIONS]
    if len(schemes) != channels or unknown:
        raise InputError(
            f"{where}: normalization_schemes {schemes}: "
            + (f"{unknown[0]} is not supported" if unknown else f"expected one per channel ({channels})")
            + f" (supported: {sorted(NORMALIZATIONS)})"
        )
    return tuple(NORMALIZATIONS[s] for s in schemes)


def _intensity_properties(properties: dict, channels: int, folder: Path) -> tuple[IntensityProperties, ...]:
    """Per channel, from foreground_intensity_properties_per_channel (plans.json, else the fingerprint)."""
    out = []
    for c in range(channels):
        p = properties.get(str(c))
        if not isinstance(p, dict) or any(k not in p for k in ("mean", "std", "percentile_00_5", "percentile_99_5")):
            raise InputError(
                f"{folder / 'dataset_fingerprint.json'}: foreground_intensity_properties_per_channel has no mean, "
                f"std and percentiles for channel {c}"
            )
        out.append(IntensityProperties(p["mean"], p["std"], p["percentile_00_5"], p["percentile_99_5"]))
    return tuple(out)


def _configuration(
    plans_json: dict, config: dict, name: str, shape: tuple[int, int, tuple[int, ...]], where: str
) -> ConfigurationPlan:
    """The autoseg configuration standing for nnU-Net's ``config``: its spacing, patch, batch and network in autoseg's
    axis order (``shape``: the network's input channels, outputs and ``network_axes``)."""
    channels, outputs, axes = shape
    for key, expected in RESAMPLING.items():
        kwargs = {k: config.get(key, {}).get(k) for k in expected}
        function = config.get(key.replace("_kwargs", ""), RESAMPLING_FUNCTION)
        if kwargs != expected or function != RESAMPLING_FUNCTION:
            raise InputError(
                f"{where}: {key} {kwargs} with {function}: not supported (autoseg resamples as "
                f"{RESAMPLING_FUNCTION} with {expected})"
            )
    patch = in_autoseg_order([int(p) for p in config["patch_size"]], axes)
    spacing = list(in_autoseg_order([float(s) for s in config["spacing"]], axes))
    if len(patch) == 2:  # 2D: slices keep their spacing; the plan's z is the dataset's
        spacing = [float(plans_json.get("original_median_spacing_after_transp", [1.0])[0]), *spacing]
    median = in_autoseg_order([round(float(v)) for v in config.get("median_image_size_in_voxels", patch)], axes)
    network = topology_of(config, len(patch), channels, outputs, where)
    return ConfigurationPlan(
        name=name,
        spacing_mm=tuple(spacing),
        median_shape_zyx=(1,) * (3 - len(median)) + median,
        patch_size=patch,
        batch_size=int(config.get("batch_size", 2)),
        accumulation_steps=1,
        network=replace(
            network,
            kernel_sizes=tuple(in_autoseg_order(k, axes) for k in network.kernel_sizes),
            strides=tuple(in_autoseg_order(st, axes) for st in network.strides),
        ),
        device="cuda",  # nnU-Net plans for a GPU
        notes=(f"imported from nnU-Net v2 ({plans_json.get('plans_name', 'nnUNetPlans')}, {name})",),
    )


def _fingerprint(data: dict, plans: Plans, folder: Path) -> Fingerprint:
    """The fingerprint ``predict`` reads (the image dimension, the spacings trained on), from nnU-Net's."""
    spacings = [tuple(float(s) for s in sp) for sp in data.get("spacings", [])]
    shapes = [tuple(int(n) for n in sh) for sh in data.get("shapes_after_crop", [])]
    if not spacings or len(spacings) != len(shapes) or any(len(s) != 3 for s in spacings):
        raise InputError(
            f"{folder / 'dataset_fingerprint.json'}: 'spacings' and 'shapes_after_crop' must list one "
            "(z, y, x) entry per training case"
        )
    image_dim = 2 if all(s[0] == NNUNET_2D_SPACING_Z for s in spacings) else 3
    cases = tuple(
        CaseFingerprint(f"case_{i:04d}", spacing, shape, shape, ())
        for i, (spacing, shape) in enumerate(zip(spacings, shapes))
    )
    return Fingerprint(
        dataset_name=plans.dataset_name,
        channel_names=plans.channel_names,
        labels=plans.labels,
        file_ending=plans.file_ending,
        image_dim=image_dim,
        cases=cases,
        foreground_intensity=plans.intensity_properties,
        median_relative_crop_volume=float(data.get("median_relative_size_after_cropping", 1.0)),
        regions_class_order=plans.regions_class_order,
    )


def _folds(folder: Path) -> tuple[int | str, ...]:
    """The folds with a checkpoint_final.pth, numbered ones first."""
    names = [p.parent.name.removeprefix("fold_") for p in folder.glob("fold_*/checkpoint_final.pth")]
    return tuple(sorted(int(n) for n in names if n.isdigit())) + tuple(sorted(n for n in names if not n.isdigit()))
