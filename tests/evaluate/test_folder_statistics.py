"""`autoseg statistics SEG_DIR [--images IMAGES_DIR]`: statistics.csv and statistics.json of a folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli


def _write(path: Path, array: np.ndarray) -> None:
    image = sitk.GetImageFromArray(array)
    image.SetSpacing((0.5, 1.0, 2.0))  # x, y, z: 1 mm^3 voxels
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path))


def test_statistics_of_a_folder_name_structures_from_dataset_json(capsys, tmp_path: Path) -> None:
    seg, images = tmp_path / "seg", tmp_path / "imagesTs"
    labels = np.zeros((3, 4, 4), dtype=np.uint8)
    labels[0, 0, 0:2] = 1  # 2 voxels, one component
    labels[2, 3, 3] = 2
    image = np.arange(48, dtype=np.float32).reshape(3, 4, 4)
    _write(seg / "case_a.nii.gz", labels)
    _write(images / "case_a_0000.nii.gz", image)
    (tmp_path / "dataset.json").write_text(
        json.dumps({"labels": {"background": 0, "liver": 1, "spleen": 2}, "channel_names": {"0": "CT"}})
    )
    result = run_cli(capsys, "statistics", seg, "--images", images)
    assert result.status == 0, result.err
    rows = list(csv.DictReader((seg / "statistics.csv").open()))
    assert [(r["structure"], r["voxels"], r["components"]) for r in rows] == [("liver", "2", "1"), ("spleen", "1", "1")]
    assert float(rows[0]["volume_ml"]) == pytest.approx(0.002) and float(rows[0]["CT_mean"]) == pytest.approx(0.5)
    assert float(rows[1]["CT_p95"]) == pytest.approx(47.0)
    assert json.loads((seg / "statistics.json").read_text())["cases"][0]["case_id"] == "case_a"


def test_statistics_without_labels_name_each_value_found_and_refuse_a_missing_image(capsys, tmp_path: Path) -> None:
    seg = tmp_path / "seg"
    labels = np.zeros((2, 3, 3), dtype=np.uint8)
    labels[1, 1, 1] = 3
    _write(seg / "x.nii.gz", labels)
    assert run_cli(capsys, "statistics", seg, "-o", tmp_path / "out").status == 0
    rows = list(csv.DictReader((tmp_path / "out" / "statistics.csv").open()))
    assert [(r["structure"], r["label_values"], r["voxels"]) for r in rows] == [("3", "3", "1")]
    (tmp_path / "images").mkdir()
    result = run_cli(capsys, "statistics", seg, "--images", tmp_path / "images")
    assert_refused(result, 2, "x_0000", str(tmp_path / "images"))
