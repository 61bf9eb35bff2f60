"""Models written by earlier versions keep working: an archive exported before the prediction seam changed
(tests/fixtures/archive_before_issue25, made by its make.py at commit 9557625) predicts as it did then."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk

from autoseg.cli.main import main

FIXTURE = Path(__file__).parent / "fixtures" / "archive_before_issue25"


@pytest.mark.slow
def test_an_archive_from_before_predicts_the_same_labels_and_probabilities(tmp_path: Path) -> None:
    images = Path(shutil.copytree(FIXTURE / "images", tmp_path / "images"))
    out = tmp_path / "out"
    command = ["-q", "predict", "-m", str(FIXTURE / "model.zip"), "-i", str(images), "-o", str(out)]
    assert main([*command, "--save-probabilities", "--device", "cpu", "--runtime", "torch"]) == 0  # as then
    expected = sorted(p.name for p in (FIXTURE / "expected").iterdir())
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == expected
    for name in expected:
        if name.endswith(".nii.gz"):
            want, got = (sitk.ReadImage(str(folder / name)) for folder in (FIXTURE / "expected", out))
            assert np.array_equal(sitk.GetArrayFromImage(got), sitk.GetArrayFromImage(want)), name
            assert (got.GetSpacing(), got.GetOrigin()) == (want.GetSpacing(), want.GetOrigin()), name
        else:
            want, got = (np.load(folder / name) for folder in (FIXTURE / "expected", out))
            assert np.array_equal(got["probabilities"], want["probabilities"]), name
            assert list(got["names"]) == list(want["names"]) and got["activation"] == want["activation"]
