"""A dataset of 2D images (and one of two channels) runs through plan, preprocess, train and predict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from factories import box_case, box_network

from autoseg.cli.main import main
from autoseg.dataset.imageio import Geometry, write_image
from autoseg.predict import networks
from autoseg.predict.networks import load_trained_network
from autoseg.preprocess.store import list_complete_cases, open_case


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
def test_2d_dataset_end_to_end(
    tiny_dataset: Path, tmp_path: Path, channels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _to_2d(tiny_dataset, tmp_path / "Dataset002_Flat", channels)
    ws = tmp_path / "ws"
    assert main(["-q", "plan_and_preprocess", str(raw), "-w", str(ws), "--device", "cpu"]) == 0
    plans = json.loads((ws / "plans.json").read_text())
    assert list(plans["configurations"]) == ["2d"]
    folder = ws / "preprocessed" / "2d"
    data, _ = open_case(folder, list_complete_cases(folder)[0]).arrays()
    assert data.shape[0] == channels and data.shape[1] == 1  # (C, Z=1, Y, X)
    assert (
        main(
            [
                "-q",
                "train",
                "fold",
                "0",
                "-w",
                str(ws),
                "--epochs",
                "1",
                "--iterations-per-epoch",
                "2",
                "--val-iterations",
                "1",
                "--no-validation",
            ]
        )
        == 0
    )
    out = tmp_path / "pred"
    assert main(["-q", "predict", "-w", str(ws), "-i", str(raw / "imagesTs"), "-o", str(out)]) == 0
    for f in sorted((raw / "imagesTs").glob("*_0000.nii.gz")):
        _assert_same_2d_header(out / f.name.replace("_0000", ""), f)
    _predict_known_boxes(ws, tmp_path, channels, monkeypatch)


def _assert_same_2d_header(output: Path, source: Path) -> None:
    src, pred = sitk.ReadImage(str(source)), sitk.ReadImage(str(output))
    assert pred.GetDimension() == 2
    assert pred.GetSize() == src.GetSize() and pred.GetSpacing() == src.GetSpacing()
    assert pred.GetOrigin() == src.GetOrigin() and pred.GetDirection() == src.GetDirection()


def _predict_known_boxes(ws: Path, tmp_path: Path, channels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2D image with known boxes at twice the plan's pixel spacing, a zero border (cropped) and a rotated
    frame, predicted by the CLI with the trained checkpoint loaded and then replaced by ``box_network``: every
    pixel of the written prediction has its known label."""
    image, expected = box_case(two_d=True)
    trained = []

    def load_then_replace(path, plans, config, device):  # the trained checkpoint must still load
        trained.append(load_trained_network(path, plans, config, device))
        return box_network(image)

    monkeypatch.setattr(networks, "load_trained_network", load_then_replace)
    spacing_yx = [2 * s for s in json.loads((ws / "plans.json").read_text())["configurations"]["2d"]["spacing_mm"][1:]]
    geometry = Geometry(
        ndim=2,
        size_xyz=(16, 14),
        spacing_xyz=tuple(spacing_yx[::-1]),
        origin_xyz=(-7.5, 30.25),
        direction=(0.6, -0.8, 0.8, 0.6),
    )
    inputs = tmp_path / "boxes"
    inputs.mkdir()
    for c in range(channels):
        write_image(inputs / f"boxes_{c:04d}.nii.gz", image * (c + 1), geometry)
    out = tmp_path / "pred_boxes"
    assert main(["-q", "predict", "-w", str(ws), "-i", str(inputs), "-o", str(out)]) == 0
    assert len(trained) == 1
    _assert_same_2d_header(out / "boxes.nii.gz", inputs / "boxes_0000.nii.gz")
    np.testing.assert_array_equal(sitk.GetArrayFromImage(sitk.ReadImage(str(out / "boxes.nii.gz"))), expected[0])
