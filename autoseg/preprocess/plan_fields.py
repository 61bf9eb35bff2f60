"""Which fields of plans.json a configuration's data and network depend on, as JSON values: what preprocessing
reads (``preprocessing_fields``, recorded in ``preprocessed/<config>_source.json``) and, beyond it, what a trained
network's input and outputs depend on (``model_input_fields``, recorded in each checkpoint); a later plans.json is
compared with the record field by field (``field_changes``)."""

from __future__ import annotations

import json
from typing import Any

from autoseg.core.artifacts import to_dict
from autoseg.plan.plans import Plans

MODEL_INPUT_KEY = "model_input"  # the checkpoint's key of model_input_fields, as JSON text


def preprocessing_fields(plans: Plans, config_name: str) -> dict[str, Any]:
    """The plan's fields that preprocessing a case for ``config_name`` reads (``preprocess_case``,
    ``run_case``), as JSON values: the target spacing and dimensionality, normalization (with the intensity
    properties of the channels normalized as CT, the only scheme that reads them), the labels, and the image
    resampling where it is not the default."""
    config = plans.configuration(config_name)
    fields = {
        "spacing_mm": config.spacing_mm,
        "dim": config.dim,
        "normalization": plans.normalization,
        "use_nonzero_mask": plans.use_nonzero_mask,
        "intensity_properties": [
            p if n == "ct" else None for n, p in zip(plans.normalization, plans.intensity_properties)
        ],
        "labels": plans.labels,
        "regions_class_order": plans.regions_class_order,
    }
    if plans.image_resampling != "sitk":  # records written before the field existed hold none: they resampled so
        fields["image_resampling"] = plans.image_resampling
    return json.loads(json.dumps(to_dict(fields)))


def model_input_fields(plans: Plans, config_name: str) -> dict[str, Any]:
    """What ``config_name``'s trained network takes as input and gives as output, as JSON values: the fields
    preprocessing reads for its data (spacing, dimensionality, normalization with its CT intensity properties, the
    nonzero mask, labels), the channels, and the network (its topology: input channels, strides and so the patch
    divisibility, kernels, features, outputs) with the previous stage whose prediction a cascade takes. A fold predicts
    what it was trained for only while these are unchanged."""
    config = plans.configuration(config_name)
    fields = {
        **preprocessing_fields(plans, config.data_configuration),
        "channel_names": plans.channel_names,
        "network": config.network,
        "previous_stage": config.previous_stage,
    }
    return json.loads(json.dumps(to_dict(fields)))


def field_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One ``"key: old -> new"`` per key whose value differs, in key order; a dict value (the network) per sub-key,
    as ``network.strides``."""
    changes = []
    for k in sorted(before.keys() | now.keys()):
        old, new = before.get(k), now.get(k)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += [f"{k}.{change}" for change in field_changes(old, new)]
        elif old != new:
            changes.append(f"{k}: {old!r} -> {new!r}")
    return changes
