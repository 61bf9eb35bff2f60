"""tests/fixtures/nnunet_model (tiny nnU-Net v2 models made by benchmarks/_nnunet_fixture.py, with nnU-Net's own
predictions of two test cases): where each model folder lies, writable copies, and how two label maps agree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "nnunet_model"
CASES = ("demo_005", "demo_006")
# the fixture folder of each model -> (nnU-Net's plans name, configuration)
MODELS = {
    "3d_fullres": ("nnUNetPlans", "3d_fullres"),
    "2d": ("nnUNetPlans", "2d"),
    "resenc_3d_fullres": ("nnUNetResEncUNetMPlans", "3d_fullres"),
    "3d_lowres": ("nnUNetPlans", "3d_lowres"),
    "3d_cascade_fullres": ("nnUNetPlans", "3d_cascade_fullres"),
}


def model_folder(name: str) -> Path:
    """The nnU-Net model folder (``<Trainer>__<Plans>__<configuration>``) the fixture keeps under ``name``."""
    plans, config = MODELS[name]
    return FIXTURE / name / f"nnUNetTrainer__{plans}__{config}"


def copied(name: str, tmp_path: Path) -> Path:
    """A writable copy of ``name``'s model folder, named as nnU-Net names it."""
    return Path(shutil.copytree(model_folder(name), tmp_path / model_folder(name).name))


def agreement(ours: np.ndarray, theirs: np.ndarray, labels: range) -> tuple[float, list[float]]:
    """The share of the union of both foregrounds where the label maps agree, and the Dice of each label."""
    union = (ours > 0) | (theirs > 0)
    agree = float((ours == theirs)[union].mean()) if union.any() else 1.0
    dice = []
    for k in labels:
        total = (ours == k).sum() + (theirs == k).sum()
        dice.append(1.0 if total == 0 else float(2 * ((ours == k) & (theirs == k)).sum() / total))
    return agree, dice


def edit_plans(folder: Path, edit) -> None:
    """Apply ``edit`` to the plans.json configuration that the model folder ``folder`` names."""
    plans = json.loads((folder / "plans.json").read_text())
    edit(plans["configurations"][folder.name.rsplit("__", 1)[-1]])
    (folder / "plans.json").write_text(json.dumps(plans))


def older_layout(class_name: str, encoder_key: str):
    """An ``edit_plans`` edit writing a configuration in the plans layout before nnU-Net 2.4: the class in
    ``UNet_class_name``, the sizes as keys of their own, ``n_conv_per_stage_encoder`` taken from ``encoder_key``."""

    def older(config: dict) -> None:
        kwargs = config.pop("architecture")["arch_kwargs"]
        config |= {
            "UNet_class_name": class_name,
            "UNet_base_num_features": kwargs["features_per_stage"][0],
            "unet_max_num_features": kwargs["features_per_stage"][-1],
            "conv_kernel_sizes": kwargs["kernel_sizes"],
            "pool_op_kernel_sizes": kwargs["strides"],
            "n_conv_per_stage_encoder": kwargs[encoder_key],
            "n_conv_per_stage_decoder": kwargs["n_conv_per_stage_decoder"],
        }

    return older
