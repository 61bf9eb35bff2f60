"""What ``predict -i`` names that cannot pass silently: one case in two formats, a header no stage can use."""

from __future__ import annotations

from pathlib import Path

import SimpleITK as sitk
from image_headers import as_mha, set_mha_header

from autoseg.dataset.inputs import PredictionInputs, list_prediction_inputs
from autoseg.dataset.raw import Case


def test_one_case_in_two_formats_is_refused_naming_both_files(inputs, tmp_path):
    folder = inputs
    sitk.WriteImage(sitk.ReadImage(str(folder / "demo_005_0000.nii.gz")), str(folder / "demo_005_0000.nrrd"))
    found = list_prediction_inputs(folder, num_channels=1)
    assert [c.case_id for c in found.cases] == ["demo_005", "demo_006"]
    assert list(found.problems) == ["demo_005"]  # the other case is predicted
    assert f"{folder / 'demo_005_0000.nii.gz'} and {folder / 'demo_005_0000.nrrd'}" in found.problems["demo_005"]


def _mha_with(path: Path, key: str, value: str) -> Path:
    mha = as_mha(path)
    set_mha_header(mha, key, value)
    return mha


def test_an_input_without_voxels_or_with_a_negative_spacing_is_a_problem_naming_it(inputs, tmp_path):
    folder = inputs
    negative = _mha_with(folder / "demo_005_0000.nii.gz", "ElementSpacing", "-0.8 0.8 2.8")
    empty = _mha_with(folder / "demo_006_0000.nii.gz", "DimSize", "0 27 11")
    problems = list_prediction_inputs(folder, num_channels=1).problems
    assert problems["demo_005"].startswith(
        f"{negative}: spacing (x,y,z) (-0.8, 0.8, 2.8) mm is not finite and positive"
    )
    assert problems["demo_006"].startswith(f"{empty}: size (x,y,z) (0, 27, 11) has an axis without voxels")


def test_an_input_far_off_the_training_spacing_is_a_problem_naming_it(inputs, tmp_path):
    folder = inputs
    path = folder / "demo_005_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    trained_zyx = tuple(reversed(image.GetSpacing()))
    image.SetSpacing(tuple(s / 1000 for s in image.GetSpacing()))  # written in metres
    sitk.WriteImage(image, str(path))
    problems = list_prediction_inputs(folder, num_channels=1, spacing_mm=trained_zyx).problems
    assert list(problems) == ["demo_005"]
    assert (
        problems["demo_005"].startswith(f"{path}: spacing ")
        and "0.001x the median of the images" in problems["demo_005"]
    )
    assert list_prediction_inputs(folder, num_channels=1).problems == {}  # no training spacing: not compared


def test_parts_are_consecutive_case_ids_that_cover_every_case_once() -> None:
    """7 cases (one with a problem) in 3 parts: 2, 2 and 3 consecutive ids in sorted order, whatever order they were
    listed in; each problem goes with its case's part."""
    ids = [f"c{i}" for i in (6, 0, 3, 1, 5, 2)]
    found = PredictionInputs(
        cases=tuple(Case(i, (Path(f"{i}_0000.nii.gz"),), None) for i in ids), problems={"c4": "c4: truncated"}
    )
    parts = [found.part(i, 3) for i in (1, 2, 3)]
    assert [sorted([c.case_id for c in p.cases] + list(p.problems)) for p in parts] == [
        ["c0", "c1"],
        ["c2", "c3"],
        ["c4", "c5", "c6"],
    ]
    assert parts[2].problems == {"c4": "c4: truncated"} and not parts[0].problems
    assert found.part(1, 1) == found and found.part(1, 9) == PredictionInputs((), {})
