"""Evaluation in every format autoseg writes: the references' ending is read from the folder (or given with
--file-ending), and a prediction in another format than its reference is refused naming both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_checks import assert_refused, run_cli

from autoseg.dataset.imageio import Geometry, write_image
from autoseg.evaluate.files import EvaluationError
from autoseg.evaluate.metrics import evaluate_folder

REFERENCE = np.array([[[1, 1, 1, 1], [0, 0, 0, 0]]], dtype=np.uint8)  # (1, 2, 4): 4 voxels of class 1
PREDICTION = np.array([[[1, 1, 0, 0], [1, 0, 0, 0]]], dtype=np.uint8)  # 3 voxels, 2 shared: Dice 4/7


def _write(path: Path, array: np.ndarray) -> None:
    write_image(path, array, Geometry(3, (4, 2, 1), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1)))


def _case(tmp_path: Path, pred_ending: str, ref_ending: str) -> tuple[Path, Path]:
    pred, gt = tmp_path / "pred", tmp_path / "gt"
    _write(gt / f"a{ref_ending}", REFERENCE)
    _write(pred / f"a{pred_ending}", PREDICTION)
    return pred, gt


@pytest.mark.parametrize("ending", [".nrrd", ".mha", ".nii"])
def test_the_references_format_is_read_from_the_folder(tmp_path: Path, ending: str) -> None:
    summary = evaluate_folder(*_case(tmp_path, ending, ending), nsd_tolerance_mm=None)
    (case,) = summary.cases
    assert case.case_id == "a" and case.classes["1"].dice == pytest.approx(4 / 7)


def test_a_prediction_in_another_format_than_its_reference_is_refused_naming_both(tmp_path: Path) -> None:
    pred, gt = _case(tmp_path, ".nrrd", ".nii.gz")
    with pytest.raises(EvaluationError) as info:
        evaluate_folder(pred, gt)
    assert str(pred / "a.nrrd") in str(info.value) and str(gt / "a.nii.gz") in str(info.value)


def test_references_in_two_formats_need_file_ending(tmp_path: Path, capsys) -> None:
    pred, gt = _case(tmp_path, ".nrrd", ".nrrd")
    _write(gt / "b.nii.gz", REFERENCE)
    assert_refused(run_cli(capsys, "evaluate", pred, gt), 2, gt, ".nii.gz", ".nrrd", "--file-ending")
    result = run_cli(capsys, "evaluate", pred, gt, "--file-ending", ".nrrd", "--no-surface")
    assert result.status == 0, result.err
    assert (pred / "summary.json").is_file()


def test_an_unknown_file_ending_is_refused_naming_the_flag(tmp_path: Path, capsys) -> None:
    pred, gt = _case(tmp_path, ".nrrd", ".nrrd")
    assert_refused(run_cli(capsys, "evaluate", pred, gt, "--file-ending", ".png"), 2, "--file-ending", ".png")
    assert not (pred / "summary.json").exists()


def test_a_predicted_value_the_labels_do_not_declare_is_refused_naming_case_and_value(tmp_path: Path) -> None:
    """dataset.json declares 0 and 1; a prediction holding 3 is an error naming its file and the value, not voxels
    scored as background; nothing is written."""
    pred, gt = _case(tmp_path, ".nii.gz", ".nii.gz")
    (tmp_path / "dataset.json").write_text('{"labels": {"background": 0, "organ": 1}}')
    _write(pred / "a.nii.gz", np.array([[[1, 1, 3, 0], [1, 0, 0, 0]]], dtype=np.uint8))
    with pytest.raises(EvaluationError, match=r"a\.nii\.gz: holds label value\(s\) \[3\], which the labels do not"):
        evaluate_folder(pred, gt, output_json=pred / "summary.json")
    assert not (pred / "summary.json").exists()
