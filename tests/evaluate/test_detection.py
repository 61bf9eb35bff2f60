from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from autoseg.dataset.imageio import Geometry, write_image
from autoseg.evaluate.detection import Detection, case_detection, components_found, detection_bytes
from autoseg.evaluate.metrics import EvaluationSummary, evaluate_folder, format_table


def _three_lesions() -> tuple[np.ndarray, np.ndarray]:
    """Reference (1, 6, 12): lesions at x 0-1, 4-7 and 10-11 (label 2) in an organ row (label 1).
    Prediction: the first lesion touched by one voxel, the second split in two pieces, the third missed."""
    ref = np.zeros((1, 6, 12), np.uint8)
    ref[0, 5, :] = 1
    ref[0, 1:3, 0:2] = ref[0, 1:3, 4:8] = ref[0, 1:3, 10:12] = 2
    pred = np.zeros_like(ref)
    pred[0, 2, 1] = 2  # touches lesion 1 with one voxel
    pred[0, 1, 4] = pred[0, 2, 7] = 2  # two pieces in lesion 2
    pred[0, 4, 10] = 2  # beside lesion 3, not in it
    return pred, ref


def test_touched_split_and_missed_lesions() -> None:
    pred, ref = _three_lesions()
    result = case_detection(pred, ref, {"organ": 1, "lesion": 2})
    assert result["lesion"] == Detection(components=3, found=2)  # the split lesion counts once, the missed one not
    assert result["organ"] == Detection(components=1, found=0)


def test_diagonal_neighbours_are_one_component() -> None:
    """26-connectivity: voxels that share only a corner are one lesion."""
    ref = np.zeros((3, 3, 3), bool)
    ref[0, 0, 0] = ref[1, 1, 1] = ref[2, 2, 2] = True
    pred = np.zeros_like(ref)
    pred[2, 2, 2] = True
    assert components_found(pred, ref) == Detection(1, 1)


def test_a_region_counts_the_union_of_its_values() -> None:
    ref = np.array([[[1, 2, 0, 2, 0, 0]]], np.uint8)  # region {1, 2}: voxels 0-1 one component, voxel 3 another
    pred = np.array([[[0, 1, 0, 0, 0, 0]]], np.uint8)
    assert case_detection(pred, ref, {"whole": (1, 2), "core": 2}) == {
        "whole": Detection(2, 1),
        "core": Detection(2, 0),  # value 2 alone: voxels 1 and 3 are two components, neither predicted as 2
    }


def test_a_class_absent_from_the_reference_has_no_components() -> None:
    pred = np.array([[[0, 3, 3]]], np.uint8)
    assert case_detection(pred, np.zeros_like(pred), {"lesion": 3}) == {"lesion": Detection(0, 0)}


def _geometry(shape_zyx: tuple[int, ...]) -> Geometry:
    return Geometry(3, tuple(reversed(shape_zyx)), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))


def test_evaluate_folder_sums_components_over_cases(tmp_path: Path) -> None:
    pred, ref = _three_lesions()
    for case, (p, r) in {"a": (pred, ref), "b": (ref, ref)}.items():
        write_image(tmp_path / "gt" / f"{case}.nii.gz", r, _geometry(r.shape))
        write_image(tmp_path / "pred" / f"{case}.nii.gz", p, _geometry(p.shape))
    out = tmp_path / "summary.json"
    summary = evaluate_folder(tmp_path / "pred", tmp_path / "gt", labels={"organ": 1, "lesion": 2}, output_json=out)
    a = summary.cases[0].classes["lesion"]
    assert (a.components, a.components_found) == (3, 2)
    assert (summary.mean["lesion"].components, summary.mean["lesion"].components_found) == (6, 5)
    assert format_table(summary).splitlines()[2].split()[-2:] == ["5/6", "2"]
    assert EvaluationSummary.from_json(out).mean["lesion"].components_found == 5


def test_version_2_summary_reads_as_detection_not_computed(tmp_path: Path) -> None:
    pred, ref = _three_lesions()
    write_image(tmp_path / "gt" / "a.nii.gz", ref, _geometry(ref.shape))
    write_image(tmp_path / "pred" / "a.nii.gz", pred, _geometry(pred.shape))
    out = tmp_path / "summary.json"
    evaluate_folder(tmp_path / "pred", tmp_path / "gt", labels={"organ": 1, "lesion": 2}, output_json=out)
    raw = json.loads(out.read_text())
    raw["schema_version"] = 2  # as written before the detection counts
    for entry in [*(c for case in raw["cases"] for c in case["classes"].values()), *raw["mean"].values()]:
        del entry["components"], entry["components_found"]
    out.write_text(json.dumps(raw))
    loaded = EvaluationSummary.from_json(out)
    assert loaded.mean["lesion"].components == -1 and loaded.cases[0].classes["lesion"].components_found == -1
    assert "found" not in format_table(loaded).splitlines()[0]


@pytest.mark.parametrize("kind", ["blob", "speckle"])
def test_bytes_estimate_bounds_the_measured_peak(kind: str) -> None:
    """detection_bytes against tracemalloc: one box-filling lesion, and thousands of one-voxel ones."""
    rng = np.random.default_rng(0)
    if kind == "blob":
        z, y, x = np.ogrid[:60, :100, :100]
        ref = ((z - 30) / 25) ** 2 + ((y - 50) / 40) ** 2 + ((x - 50) / 45) ** 2 < 1
        pred = np.roll(ref, 3, axis=2)
    else:
        ref, pred = rng.random((30, 100, 100)) < 0.1, rng.random((30, 100, 100)) < 0.3
    box = ndimage.find_objects(ref.view(np.uint8))[0]
    box_voxels = int(np.prod([s.stop - s.start for s in box]))
    labels_pred, labels_ref = pred.astype(np.uint8), ref.astype(np.uint8)
    tracemalloc.start()
    (found,) = case_detection(labels_pred, labels_ref, {"a": 1}).values()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    estimate = detection_bytes(box_voxels, found.components)
    assert peak <= estimate <= 1.5 * peak
