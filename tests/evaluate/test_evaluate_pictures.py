"""`autoseg evaluate --images`: a picture per case and index.html listing the cases worst first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli
from png_reader import read_png

from autoseg.review.drawing import colour


def _write(path: Path, array: np.ndarray) -> None:
    image = sitk.GetImageFromArray(array)
    image.SetSpacing((1.0, 1.0, 2.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path))


def _folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Three cases of a 2-class dataset: 'good' predicted exactly, 'bad' with class 1 missed, 'fair' shifted."""
    pred, ref, images = tmp_path / "pred", tmp_path / "ref", tmp_path / "images"
    base = np.zeros((6, 16, 16), dtype=np.uint8)
    base[1:5, 3:9, 3:9], base[2:4, 10:14, 10:14] = 1, 2
    shifted = np.zeros_like(base)
    shifted[1:5, 3:9, 5:11], shifted[2:4, 10:14, 10:14] = 1, 2
    missed = np.where(base == 1, 0, base).astype(np.uint8)
    for case, predicted in (("good", base), ("bad", missed), ("fair", shifted)):
        _write(ref / f"{case}.nii.gz", base)
        _write(pred / f"{case}.nii.gz", predicted)
        _write(images / f"{case}_0000.nii.gz", np.random.default_rng(0).normal(size=base.shape).astype(np.float32))
    (ref / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "liver": 1, "tumour": 2}}))
    return pred, ref, images


def test_evaluate_with_images_draws_each_case_and_lists_them_worst_first(capsys, tmp_path: Path) -> None:
    pred, ref, images = _folders(tmp_path)
    result = run_cli(capsys, "evaluate", pred, ref, "--images", images, "--no-surface")
    assert result.status == 0, result.err
    pictures = pred / "pictures"
    assert sorted(p.name for p in pictures.iterdir()) == ["bad.png", "fair.png", "good.png", "index.html"]
    page = (pictures / "index.html").read_text()
    assert re.findall(r'href="(\w+)\.png"', page) == ["bad", "fair", "good"]  # worst first
    assert "liver" in page and "tumour" in page and "<td>0.0000</td>" in page  # bad's liver Dice
    bad = read_png(pictures / "bad.png")
    assert (bad == colour(0)).all(axis=2).any()  # the missed liver, outlined in its colour
    assert str(pictures / "index.html") in result.out


def test_evaluate_refuses_images_missing_for_a_case_before_drawing(capsys, tmp_path: Path) -> None:
    pred, ref, images = _folders(tmp_path)
    (images / "fair_0000.nii.gz").unlink()
    result = run_cli(capsys, "evaluate", pred, ref, "--images", images, "--no-surface")
    assert_refused(result, 2, str(images), "fair", "{case}_0000")
    assert not (pred / "pictures").exists()
