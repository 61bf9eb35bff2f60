"""A dataset of 2D images (and one of two channels) runs through plan, preprocess, train and predict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk

from autoseg.cli import main


def _to_2d(src: Path, dst: Path, channels: int = 1) -> Path:
    """The middle slice of every case of a 3D dataset, written as 2D images (``channels`` copies, scaled)."""
    meta = json.loads((src / "dataset.json").read_text())
    for folder in ("imagesTr", "labelsTr", "imagesTs"):
        (dst / folder).mkdir(parents=True)
        for f in sorted((src / folder).glob("*.nii.gz")):
            image = sitk.ReadImage(str(f))
            sl = image[:, :, image.GetSize()[2] // 2]
            if folder == "labelsTr":
                sitk.WriteImage(sl, str(dst / folder / f.name))
                continue
            case = f.name[: -len("_0000.nii.gz")]
            for c in range(channels):
                sitk.WriteImage(sl * float(c + 1), str(dst / folder / f"{case}_{c:04d}.nii.gz"))
    meta["channel_names"] = {str(c): f"MRI{c}" for c in range(channels)}
    (dst / "dataset.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("channels", [1, 2])
def test_2d_dataset_end_to_end(tiny_dataset: Path, tmp_path: Path, channels: int) -> None:
    raw = _to_2d(tiny_dataset, tmp_path / "Dataset002_Flat", channels)
    ws = tmp_path / "ws"
    assert main(["-q", "plan_and_preprocess", str(raw), "-w", str(ws), "--device", "cpu"]) == 0
    plans = json.loads((ws / "plans.json").read_text())
    assert list(plans["configurations"]) == ["2d"]
    data = np.load(next((ws / "preprocessed" / "2d").glob("*_data.npy")))
    assert data.shape[0] == channels and data.shape[1] == 1  # (C, Z=1, Y, X)
    assert main(["-q", "train", "fold", "0", "-w", str(ws), "--epochs", "1", "--iterations-per-epoch", "2",
                 "--val-iterations", "1", "--no-validation"]) == 0
    out = tmp_path / "pred"
    assert main(["-q", "predict", "-w", str(ws), "-i", str(raw / "imagesTs"), "-o", str(out)]) == 0
    for f in sorted((raw / "imagesTs").glob("*_0000.nii.gz")):
        src = sitk.ReadImage(str(f))
        pred = sitk.ReadImage(str(out / f.name.replace("_0000", "")))
        assert pred.GetDimension() == 2
        assert pred.GetSize() == src.GetSize() and pred.GetSpacing() == src.GetSpacing()
        assert pred.GetOrigin() == src.GetOrigin() and pred.GetDirection() == src.GetDirection()
