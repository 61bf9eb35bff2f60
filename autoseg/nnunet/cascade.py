"""nnU-Net's cascade (``3d_lowres`` -> ``3d_cascade_fullres``) as autoseg's: the cascade stage's model folder and its
previous stage's (``import-nnunet FOLDER --previous-stage LOWRES_FOLDER``) read as one plan of both configurations,
the cascade's ``previous_stage`` naming the other, so that ``predict -m`` runs autoseg's own cascade
(``autoseg.predict.cascade``).

How nnU-Net feeds the cascade stage at inference (``nnUNetv2_predict -prev_stage_predictions``), against autoseg:

- 3d_lowres predicts the case; its label map is exported to the image's grid (logits resampled, then argmax).
  autoseg: the same (the imported plan's ``export_space`` ``logits``).
- The cascade's preprocessor reads that map as the case's segmentation: cropped to the image's nonzero box and
  resampled to the preprocessed shape as labels are (``resample_data_or_seg_to_shape`` with ``is_seg``: each
  label's indicator linearly, nearest across a separate z axis, the largest wins). autoseg: ``labels_on_grid``,
  the same box, ``resample_segmentation`` with order 1 and order_z 0 (the largest wins).
- One-hot over the label manager's ``foreground_labels`` after the image's channels
  (``convert_labelmap_to_one_hot``). autoseg: one-hot over ``LabelScheme.predicted_values`` after them.

The one difference: where two labels' interpolated indicators tie exactly, batchgenerators gives the voxel the
nearest input voxel's label, autoseg the smaller label. nnU-Net's training input differs further (the lowres
prediction resampled from the lowres preprocessed grid straight to the fullres one); only inference is imported.

Refused: a cascade stage without ``--previous-stage``, a previous stage of another configuration than plans.json's
``previous_stage`` or whose dataset, channels, normalization or transposes differ, region-based labels (nnU-Net's
one-hot channels then follow its label manager, not the painted region values).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from autoseg.core.errors import InputError
from autoseg.dataset.labels import IGNORE, LabelScheme
from autoseg.plan.plans import Plans

# how the previous stage's label map is put on the cascade's grid: what ``labels_on_grid`` does
SEG_RESAMPLING = {"order": 1, "order_z": 0, "force_separate_z": None}
PLAN_FIELDS = (  # what the two stages' plans must agree on: autoseg's plan holds them once
    "channel_names",
    "labels",
    "file_ending",
    "normalization",
    "use_nonzero_mask",
    "intensity_properties",
    "regions_class_order",
)


def previous_stage_name(config: dict[str, Any], folder: Path, previous_stage: Path | None) -> str:
    """The configuration whose prediction nnU-Net's ``config`` (of the model folder ``folder``) takes as input, ""
    for no cascade stage; refused when it is one and ``previous_stage`` (its model folder) is not given, or the
    reverse, or when it resamples label maps otherwise than ``SEG_RESAMPLING``."""
    name = str(config.get("previous_stage") or "")
    if name and previous_stage is None:
        raise InputError(
            f"{folder}: configuration {folder.name.rsplit('__', 1)[-1]!r} is a cascade stage: it takes {name}'s "
            f"predicted label map as input; give {name}'s model folder with --previous-stage "
            f"(<Trainer>__<Plans>__{name}, trained with the same folds)"
        )
    seg = {k: (config.get("resampling_fn_seg_kwargs") or {}).get(k) for k in SEG_RESAMPLING}
    if name and seg != SEG_RESAMPLING:
        raise InputError(
            f"{folder / 'plans.json'}: resampling_fn_seg_kwargs {seg}: not supported for a cascade stage (autoseg "
            f"puts the previous stage's label map on its grid with {SEG_RESAMPLING})"
        )
    if not name and previous_stage is not None:
        raise InputError(
            f"{folder}: --previous-stage {previous_stage} given, but plans.json names no previous_stage for "
            f"configuration {folder.name.rsplit('__', 1)[-1]!r}: it is no cascade stage; leave --previous-stage out"
        )
    return name


def one_hot_values(scheme: LabelScheme, labels: dict[str, Any], folder: Path) -> tuple[int, ...]:
    """The label values one-hot encoded into the cascade stage's extra input channels, in nnU-Net's order (its
    label manager's foreground labels: every value but background and ignore, ascending), which are autoseg's
    ``predicted_values`` for plain labels."""
    if scheme.has_regions:
        raise InputError(
            f"{folder / 'dataset.json'}: region-based labels in a cascade are not supported (nnU-Net's one-hot "
            "channels follow its label manager, not the painted region values)"
        )
    nnunet = tuple(sorted(int(v) for k, v in labels.items() if k != IGNORE and int(v) != 0))
    if nnunet != tuple(scheme.predicted_values):
        raise InputError(
            f"{folder / 'dataset.json'}: labels {labels}: nnU-Net's one-hot channels {list(nnunet)} are not "
            f"autoseg's {list(scheme.predicted_values)}; not supported"
        )
    return nnunet


def joined_plans(plans: Plans, previous: Plans, previous_name: str, folders: tuple[Path, Path], where: str) -> Plans:
    """The plan of a cascade stage (``plans``, of the model folder ``folders[0]``) and its previous stage
    (``previous``, configuration ``previous_name``, read on its own from ``folders[1]``): both configurations in one
    plan. Refused, naming the folders: another configuration than plans.json's ``previous_stage``, plan fields that
    differ."""
    (config,) = plans.configurations.values()
    if previous_name != config.previous_stage:
        raise InputError(
            f"{folders[1]}: --previous-stage holds configuration {previous_name!r}, but {where} takes "
            f"{config.previous_stage!r}'s prediction; give the {config.previous_stage} model folder"
        )
    differ = [f for f in PLAN_FIELDS if getattr(plans, f) != getattr(previous, f)]
    if differ:
        raise InputError(
            f"{folders[1]} and {folders[0]}: their {', '.join(differ)} differ; a cascade's two stages are trained "
            "on one dataset with one plans file (give the folders nnUNetv2_train wrote for both)"
        )
    return replace(plans, configurations={previous_name: previous.configuration(previous_name), **plans.configurations})
