from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from autoseg.core.artifacts import to_dict
from autoseg.dataset.imageio import Geometry, write_image
from autoseg.evaluate.files import EvaluationError
from autoseg.evaluate.metrics import EvaluationSummary, evaluate_folder, format_table

SPACING_XYZ = (1.0, 2.0, 3.0)  # one voxel is 6 mm^3


def _geometry(shape_zyx: tuple[int, int, int], spacing_xyz: tuple[float, ...] = SPACING_XYZ) -> Geometry:
    return Geometry(3, tuple(reversed(shape_zyx)), spacing_xyz, (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))


def _write(path: Path, array: np.ndarray, spacing_xyz: tuple[float, ...] = SPACING_XYZ) -> None:
    write_image(path, array.astype(np.uint8), _geometry(array.shape, spacing_xyz))


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """Two hand-made cases of shape (1, 2, 4) with known overlaps.

    case a: class 1 reference 4 voxels, prediction 3 voxels, 2 shared -> Dice 4/7, IoU 2/5;
            class 2 absent from both -> undefined.
    case b: class 1 one voxel in both -> Dice 1; class 2 reference 2 voxels, prediction none -> Dice 0.
    """
    gt, pred = tmp_path / "labelsTs", tmp_path / "pred"
    _write(gt / "a.nii.gz", np.array([[[1, 1, 1, 1], [0, 0, 0, 0]]]))
    _write(pred / "a.nii.gz", np.array([[[1, 1, 0, 0], [1, 0, 0, 0]]]))
    _write(gt / "b.nii.gz", np.array([[[1, 0, 2, 2], [0, 0, 0, 0]]]))
    _write(pred / "b.nii.gz", np.array([[[1, 0, 0, 0], [0, 0, 0, 0]]]))
    (tmp_path / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "organ": 1, "lesion": 2}}))
    return pred, gt


def test_known_overlaps_give_exact_values(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    summary = evaluate_folder(pred, gt)  # labels from gt's parent dataset.json
    assert summary.labels == {"organ": 1, "lesion": 2}
    a, b = summary.cases
    assert (a.case_id, b.case_id) == ("a", "b")
    organ_a = a.classes["organ"]
    assert (organ_a.tp, organ_a.fp, organ_a.fn) == (2, 1, 2)
    assert organ_a.dice == pytest.approx(4 / 7) and organ_a.iou == pytest.approx(2 / 5)
    assert organ_a.volume_pred_mm3 == pytest.approx(3 * 6.0)
    assert organ_a.volume_ref_mm3 == pytest.approx(4 * 6.0)
    assert math.isnan(a.classes["lesion"].dice) and math.isnan(a.classes["lesion"].iou)
    # surfaces (every voxel: one slice thick), spacing (z, y, x) = (3, 2, 1) mm: prediction -> reference
    # [0, 0, 2] mm (P95 1.8), reference -> prediction [0, 0, 1, 2] mm (P95 1.85); all within the 2 mm tolerance
    assert organ_a.hd95_mm == pytest.approx(1.85) and organ_a.nsd == 1.0
    assert math.isnan(a.classes["lesion"].hd95_mm) and math.isnan(a.classes["lesion"].nsd)
    assert b.classes["organ"].hd95_mm == 0.0 and b.classes["organ"].nsd == 1.0
    # lesion only in b's reference: NSD 0, HD95 the diagonal of the 4 x 2 x 1 voxel image
    assert b.classes["lesion"].hd95_mm == pytest.approx(math.sqrt(4**2 + 4**2 + 3**2)) and b.classes["lesion"].nsd == 0
    assert summary.mean["organ"].hd95_mm == pytest.approx(1.85 / 2) and summary.mean["organ"].nsd == 1.0
    assert b.classes["organ"].dice == 1.0
    lesion_b = b.classes["lesion"]
    assert (lesion_b.dice, lesion_b.iou, lesion_b.tp, lesion_b.fp, lesion_b.fn) == (0.0, 0.0, 0, 0, 2)
    # means skip the undefined (empty vs empty) entry
    assert summary.mean["organ"].dice == pytest.approx((4 / 7 + 1) / 2)
    assert summary.mean["organ"].iou == pytest.approx((2 / 5 + 1) / 2)
    assert (summary.mean["organ"].num_cases, summary.mean["lesion"].num_cases) == (2, 1)
    assert summary.mean["lesion"].dice == 0.0
    assert summary.mean_foreground_dice == pytest.approx(((4 / 7 + 1) / 2 + 0.0) / 2)


def test_perfect_prediction_scores_one(tmp_path: Path) -> None:
    label = np.zeros((3, 4, 5), dtype=np.uint8)
    label[1, 1:3, 1:4] = 1
    label[2, 0, 0] = 2
    _write(tmp_path / "gt" / "c.nii.gz", label)
    _write(tmp_path / "pred" / "c.nii.gz", label)
    summary = evaluate_folder(tmp_path / "pred", tmp_path / "gt", labels={"background": 0, "x": 1, "y": 2})
    assert summary.labels == {"x": 1, "y": 2}  # background is not evaluated
    assert {m.dice for m in summary.mean.values()} == {1.0}
    assert {m.iou for m in summary.mean.values()} == {1.0}
    assert summary.mean_foreground_dice == 1.0


def test_labels_inferred_from_values_without_dataset_json(tmp_path: Path) -> None:
    _write(tmp_path / "gt" / "c.nii.gz", np.array([[[0, 3, 3]]]))
    _write(tmp_path / "pred" / "c.nii.gz", np.array([[[1, 3, 0]]]))
    summary = evaluate_folder(tmp_path / "pred", tmp_path / "gt")
    assert summary.labels == {"1": 1, "3": 3}
    assert summary.cases[0].classes["1"].dice == 0.0  # predicted only
    assert summary.cases[0].classes["3"].dice == pytest.approx(2 / 3)


def test_missing_prediction_is_named(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    (pred / "b.nii.gz").unlink()
    with pytest.raises(EvaluationError, match=r"no prediction for 1 of 2 reference file\(s\).*b\.nii\.gz"):
        evaluate_folder(pred, gt)


def test_geometry_mismatch_names_both_files(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    _write(pred / "b.nii.gz", np.array([[[1, 0, 0, 0], [0, 0, 0, 0]]]), spacing_xyz=(1.0, 2.0, 5.0))
    with pytest.raises(EvaluationError) as info:
        evaluate_folder(pred, gt)
    message = str(info.value)
    assert str(pred / "b.nii.gz") in message and str(gt / "b.nii.gz") in message
    assert "spacing" in message and "a.nii.gz" not in message


def test_summary_json_round_trip(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    out = pred / "summary.json"
    summary = evaluate_folder(pred, gt, output_json=out)
    text = out.read_text()
    assert "NaN" not in text  # undefined Dice is written as null: standard JSON
    raw = json.loads(text)
    assert raw["schema_version"] == 3
    assert raw["cases"][0]["classes"]["lesion"]["dice"] is None
    assert raw["cases"][0]["classes"]["lesion"]["hd95_mm"] is None and raw["nsd_tolerance_mm"] == 2.0
    loaded = EvaluationSummary.from_json(out)
    assert math.isnan(loaded.cases[0].classes["lesion"].dice)
    assert json.dumps(to_dict(loaded)) == json.dumps(to_dict(summary))
    # a second evaluation ignores summary.json, which does not end in .nii.gz
    assert evaluate_folder(pred, gt).mean_foreground_dice == summary.mean_foreground_dice


def test_format_table(folders: tuple[Path, Path]) -> None:
    table = format_table(evaluate_folder(*folders))
    lines = table.splitlines()
    assert lines[0].split() == [
        "class",
        "value",
        "mean",
        "Dice",
        "mean",
        "IoU",
        "mean",
        "HD95",
        "mm",
        "mean",
        "NSD@2mm",
        "found",
        "cases",
    ]
    organ = lines[1].split()
    assert organ[:4] == ["organ", "1", f"{(4 / 7 + 1) / 2:.4f}", f"{(2 / 5 + 1) / 2:.4f}"]
    assert float(organ[4]) == pytest.approx(1.85 / 2, abs=0.006) and organ[5:] == ["1.0000", "2/2", "2"]  # 2 decimals
    # lesion: only in the reference of case b -> NSD 0, HD95 the image diagonal (4 x 2 x 1 voxels of 1x2x3 mm)
    diagonal = math.sqrt(4**2 + 4**2 + 3**2)
    assert lines[2].split() == ["lesion", "2", "0.0000", "0.0000", f"{diagonal:.2f}", "0.0000", "0/1", "1"]
    assert lines[3].startswith(f"mean foreground Dice: {((4 / 7 + 1) / 2) / 2:.4f}")
    assert lines[4].startswith("HD95: 1 (case, class) pair(s) with the class in only one")
    assert [ln.split() for ln in format_table(evaluate_folder(*folders, nsd_tolerance_mm=None)).splitlines()[:2]] == [
        ["class", "value", "mean", "Dice", "mean", "IoU", "found", "cases"],
        ["organ", "1", f"{(4 / 7 + 1) / 2:.4f}", f"{(2 / 5 + 1) / 2:.4f}", "2/2", "2"],
    ]


def test_empty_reference_folder_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "gt").mkdir()
    (tmp_path / "pred").mkdir()
    with pytest.raises(EvaluationError, match="no reference segmentations"):
        evaluate_folder(tmp_path / "pred", tmp_path / "gt")


def test_regions_and_ignore_from_dataset_json(tmp_path: Path) -> None:
    """Regions score the union of their values in both images; reference ignore voxels count nowhere.

    reference  0 1 2 2 3 3 1 0   (3 = ignore)
    prediction 0 1 1 2 2 0 2 2
    whole = {1, 2}: counted voxels 0,1,2,3,6,7 -> ref 1,2,3,6; pred 1,2,3,6,7 -> tp 4, fp 1, fn 0
    core = {2}: ref 2,3; pred 3,6,7 -> tp 1, fp 2, fn 1
    """
    gt, pred = tmp_path / "labelsTr", tmp_path / "pred"
    _write(gt / "a.nii.gz", np.array([[[0, 1, 2, 2, 3, 3, 1, 0]]]))
    _write(pred / "a.nii.gz", np.array([[[0, 1, 1, 2, 2, 0, 2, 2]]]))
    meta = {"labels": {"background": 0, "whole": [1, 2], "core": 2, "ignore": 3}, "regions_class_order": [1, 2]}
    (tmp_path / "dataset.json").write_text(json.dumps(meta))
    summary = evaluate_folder(pred, gt, output_json=pred / "summary.json")
    assert summary.labels == {"whole": (1, 2), "core": 2} and summary.ignore_value == 3
    whole, core = summary.cases[0].classes["whole"], summary.cases[0].classes["core"]
    assert (whole.tp, whole.fp, whole.fn) == (4, 1, 0) and whole.dice == pytest.approx(8 / 9)
    assert (core.tp, core.fp, core.fn) == (1, 2, 1) and core.dice == pytest.approx(2 / 5)
    assert whole.volume_ref_mm3 == pytest.approx(4 * 6.0)
    loaded = EvaluationSummary.from_json(pred / "summary.json")
    assert loaded.labels == summary.labels and loaded.ignore_value == 3
    lines = format_table(summary).splitlines()
    assert lines[0].split()[:2] == ["region", "value"] and lines[1].split()[:2] == ["whole", "1,2"]
    assert "(2 regions, 1 cases; ignore label 3 not counted)" in lines[-1]


def test_ignore_with_plain_classes_excludes_reference_voxels(tmp_path: Path) -> None:
    _write(tmp_path / "gt" / "c.nii.gz", np.array([[[1, 1, 2, 2, 2]]]))
    _write(tmp_path / "pred" / "c.nii.gz", np.array([[[1, 0, 1, 1, 0]]]))
    labels = {"background": 0, "organ": 1, "ignore": 2}
    summary = evaluate_folder(tmp_path / "pred", tmp_path / "gt", labels=labels)
    organ = summary.cases[0].classes["organ"]
    assert summary.labels == {"organ": 1}  # ignore is not a class
    assert (organ.tp, organ.fp, organ.fn) == (1, 0, 1)  # predictions on ignored voxels are not false positives


def test_prediction_without_reference_is_named_and_nothing_written(folders: tuple[Path, Path]) -> None:
    """As nnU-Net's evaluation (which fails on it): a score over a subset of the predictions would pass for
    the folder's score, so an unmatched prediction is refused."""
    pred, gt = folders
    (gt / "b.nii.gz").unlink()
    with pytest.raises(EvaluationError, match=r"gt|labelsTs") as info:
        evaluate_folder(pred, gt, output_json=pred / "summary.json")
    assert f"no reference for 1 prediction(s) in {pred}: b.nii.gz" in str(info.value)
    assert not (pred / "summary.json").exists()


@pytest.mark.parametrize("which", ["pred", "gt"])
def test_float_map_with_fractions_is_refused_naming_it(folders: tuple[Path, Path], which: str) -> None:
    pred, gt = folders
    path = (pred if which == "pred" else gt) / "a.nii.gz"
    values = np.array([[[1, 1, 0, 0], [1, 0, 0, 0]]], dtype=np.float32)
    write_image(path, values, _geometry(values.shape))
    assert evaluate_folder(pred, gt).cases  # integer-valued floats are label values
    values[0, 0, 1] = 0.3
    write_image(path, values, _geometry(values.shape))
    with pytest.raises(
        EvaluationError,
        match=rf"{path}: {'prediction' if which == 'pred' else 'reference'} holds 1 "
        r"non-integer voxel\(s\) \(e.g. 0.3\)",
    ):
        evaluate_folder(pred, gt, output_json=pred / "summary.json")
    assert not (pred / "summary.json").exists()


def test_truncated_prediction_is_refused(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    path = pred / "a.nii.gz"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match=rf"{path}: damaged or truncated"):
        evaluate_folder(pred, gt)


@pytest.mark.parametrize("content", [b"null", b"[1]", b"\xff\xfe{", b"{"])
def test_unusable_dataset_json_beside_references_is_named(folders: tuple[Path, Path], content: bytes) -> None:
    pred, gt = folders
    (gt.parent / "dataset.json").write_bytes(content)
    with pytest.raises(EvaluationError, match=r"dataset.json: .*pass labels explicitly"):
        evaluate_folder(pred, gt)


def test_version_1_summary_reads_as_surface_metrics_not_computed(folders: tuple[Path, Path]) -> None:
    pred, gt = folders
    out = pred / "summary.json"
    evaluate_folder(pred, gt, output_json=out)
    raw = json.loads(out.read_text())
    raw["schema_version"] = 1  # as written before the surface metrics: no hd95_mm, nsd, nsd_tolerance_mm
    del raw["nsd_tolerance_mm"]
    for entry in [*(c for case in raw["cases"] for c in case["classes"].values()), *raw["mean"].values()]:
        del entry["hd95_mm"], entry["nsd"]
    out.write_text(json.dumps(raw))
    loaded = EvaluationSummary.from_json(out)
    assert loaded.nsd_tolerance_mm is None and math.isnan(loaded.mean["organ"].hd95_mm)
    assert loaded.cases[0].classes["organ"].dice == pytest.approx(4 / 7)
    assert "HD95" not in format_table(loaded)
