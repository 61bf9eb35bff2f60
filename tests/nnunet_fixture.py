"""tests/fixtures/nnunet_model (tiny nnU-Net v2 models made by benchmarks/_nnunet_fixture.py, with nnU-Net's own
predictions of two test cases): where each model folder lies, writable copies, and how two label maps agree."""

from __future__ import annotations

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
