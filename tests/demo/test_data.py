from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autoseg.dataset.imageio import read_image
from autoseg.dataset.raw import check_integrity, load_dataset
from autoseg.demo.data import make_demo_dataset, synthesize_case

TINY_ZYX = (12, 24, 24)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_dataset(
        tmp_path_factory.mktemp("demo") / "Dataset", num_train=2, num_test=1, shape_zyx=TINY_ZYX, seed=3
    )


def test_writes_nnunet_layout_and_dataset_json(demo_root: Path) -> None:
    meta = json.loads((demo_root / "dataset.json").read_text())
    assert meta["channel_names"] == {"0": "MRI"}
    assert meta["labels"] == {"background": 0, "organ": 1, "lesion": 2}
    assert meta["numTraining"] == 2
    assert meta["file_ending"] == ".nii.gz"
    names = {sub: sorted(p.name for p in (demo_root / sub).iterdir()) for sub in ("imagesTr", "labelsTr")}
    assert names["imagesTr"] == ["demo_000_0000.nii.gz", "demo_001_0000.nii.gz"]
    assert names["labelsTr"] == ["demo_000.nii.gz", "demo_001.nii.gz"]
    assert [p.name for p in (demo_root / "imagesTs").iterdir()] == ["demo_002_0000.nii.gz"]
    assert [p.name for p in (demo_root / "labelsTs").iterdir()] == ["demo_002.nii.gz"]
    dataset = load_dataset(demo_root)
    assert [c.case_id for c in dataset.cases] == ["demo_000", "demo_001"]
    check_integrity(dataset)  # geometry of image and label agree, label values declared, no NaN


def test_written_files_hold_the_synthesized_case(demo_root: Path) -> None:
    image, geometry = read_image(demo_root / "imagesTs" / "demo_002_0000.nii.gz")
    label, _ = read_image(demo_root / "labelsTs" / "demo_002.nii.gz", dtype=np.uint8)
    case = synthesize_case(3, 2, TINY_ZYX)
    assert image.dtype == np.float32 and case.image_zyx.dtype == np.float32
    assert case.label_zyx.dtype == np.uint8
    np.testing.assert_array_equal(image, case.image_zyx)
    np.testing.assert_array_equal(label, case.label_zyx)
    assert geometry.matches(case.geometry) is None
    assert geometry.direction == (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


def test_cases_are_reproducible_and_depend_on_seed() -> None:
    a, b = synthesize_case(7, 1, TINY_ZYX), synthesize_case(7, 1, TINY_ZYX)
    np.testing.assert_array_equal(a.image_zyx, b.image_zyx)
    np.testing.assert_array_equal(a.label_zyx, b.label_zyx)
    assert a.geometry == b.geometry
    other_seed, other_case = synthesize_case(8, 1, TINY_ZYX), synthesize_case(7, 2, TINY_ZYX)
    for other in (other_seed, other_case):
        assert other.geometry != a.geometry
        assert other.image_zyx.shape != a.image_zyx.shape or not np.array_equal(other.image_zyx, a.image_zyx)


@pytest.mark.parametrize("case_index", range(4))
def test_case_content(case_index: int) -> None:
    case = synthesize_case(0, case_index, TINY_ZYX)
    image, label, body = case.image_zyx, case.label_zyx, case.body_zyx
    assert set(np.unique(label).tolist()) == {0, 1, 2}
    assert np.all(image[~body] == 0) and np.all(image[body] >= 1)  # exact zeros outside the body only
    for face in (image[0], image[-1], image[:, 0], image[:, -1], image[:, :, 0], image[:, :, -1]):
        assert np.all(face == 0)  # crop-to-nonzero crops on every side
    assert np.all(body[label > 0])  # organ and lesion lie inside the body
    # learnable by intensity: lesion brighter than organ, organ brighter than body tissue
    body_only = body & (label == 0)
    assert image[label == 2].mean() > 1.2 * image[label == 1].mean() > 1.3 * image[body_only].mean()


def test_geometry_is_anisotropic_and_jittered() -> None:
    cases = [synthesize_case(0, i) for i in range(3)]  # default 32 x 80 x 80
    for case in cases:
        z_mm, y_mm, x_mm = case.geometry.spacing_zyx
        assert 2.5 <= z_mm <= 3.0 and 0.8 <= y_mm <= 1.0 and y_mm == x_mm
        shape = np.array(case.geometry.shape_zyx)
        assert np.all(np.abs(shape / np.array((32, 80, 80)) - 1) <= 0.1 + 1e-9)
        assert case.image_zyx.shape == case.geometry.shape_zyx
    assert len({c.geometry.spacing_zyx for c in cases}) == 3
    assert len({c.geometry.origin_xyz for c in cases}) == 3


def test_two_classes_draws_no_lesion() -> None:
    case = synthesize_case(0, 0, TINY_ZYX, num_label_values=2)
    assert set(np.unique(case.label_zyx).tolist()) == {0, 1}


def test_refuses_a_folder_that_is_not_a_demo_dataset(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an autoseg demo dataset"):
        make_demo_dataset(tmp_path, num_train=1, num_test=0, shape_zyx=(8, 8, 8))
    assert not (tmp_path / "dataset.json").exists()


def test_rewriting_a_demo_dataset_removes_stale_cases(tmp_path: Path) -> None:
    make_demo_dataset(tmp_path, num_train=2, num_test=0, shape_zyx=(8, 8, 8))
    make_demo_dataset(tmp_path, num_train=1, num_test=0, shape_zyx=(8, 8, 8))
    assert [p.name for p in (tmp_path / "labelsTr").iterdir()] == ["demo_000.nii.gz"]
    assert len(load_dataset(tmp_path).cases) == 1


def test_bad_arguments_say_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_label_values must be 2"):
        make_demo_dataset(tmp_path, num_label_values=4)
    with pytest.raises(ValueError, match="at least 8 voxels"):
        make_demo_dataset(tmp_path, shape_zyx=(4, 32, 32))
