from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoseg.dataset.imageio import read_image
from autoseg.dataset.raw import load_dataset
from autoseg.plan.fingerprint import Fingerprint, fingerprint


@pytest.fixture(scope="module")
def dataset(tiny_dataset: Path):
    return load_dataset(tiny_dataset)


@pytest.fixture(scope="module")
def fp(dataset) -> Fingerprint:
    return fingerprint(dataset, seed=0, progress=False)


def test_dataset_metadata_is_copied(fp: Fingerprint, dataset) -> None:
    assert fp.dataset_name == "Dataset001_Tiny"
    assert fp.channel_names == ("MRI",)
    assert fp.labels == {"background": 0, "organ": 1, "lesion": 2}
    assert fp.file_ending == ".nii.gz"
    assert fp.image_dim == 3
    assert [c.case_id for c in fp.cases] == [c.case_id for c in dataset.cases]
    assert len(fp.cases) == 5


def test_spacing_and_shape_per_case_match_the_files(fp: Fingerprint, dataset) -> None:
    for case_fp, case in zip(fp.cases, dataset.cases):
        image, geometry = read_image(case.image_paths[0])
        assert case_fp.shape_zyx == image.shape
        # spacing in array order (z, y, x): SimpleITK's (x, y, z) reversed
        assert case_fp.spacing_mm == pytest.approx(tuple(reversed(geometry.spacing_xyz)))
        assert 2.5 < case_fp.spacing_mm[0] < 3.0 and case_fp.spacing_mm[1] < 1.0  # thick slices in z
    assert fp.spacings.shape == (5, 3) and fp.cropped_shapes.shape == (5, 3)


def test_cropped_shape_is_the_body_bounding_box(fp: Fingerprint, dataset) -> None:
    for case_fp, case in zip(fp.cases, dataset.cases):
        image, _ = read_image(case.image_paths[0])
        nonzero = np.argwhere(image != 0)
        bbox_size = tuple(int(v) for v in nonzero.max(0) - nonzero.min(0) + 1)
        assert case_fp.cropped_shape_zyx == bbox_size
        # the demo body leaves zeros on every face, so every axis shrinks
        assert all(c < s for c, s in zip(case_fp.cropped_shape_zyx, case_fp.shape_zyx))
    rel = [np.prod(c.cropped_shape_zyx) / np.prod(c.shape_zyx) for c in fp.cases]
    assert fp.median_relative_crop_volume == pytest.approx(float(np.median(rel)))
    assert 0 < fp.median_relative_crop_volume < 1


def test_class_voxels_cover_the_cropped_volume(fp: Fingerprint, dataset) -> None:
    for case_fp, case in zip(fp.cases, dataset.cases):
        assert len(case_fp.class_voxels) == 3
        assert sum(case_fp.class_voxels) == int(np.prod(case_fp.cropped_shape_zyx))
        label, _ = read_image(case.label_path, dtype=np.int16)
        # foreground lies inside the body, so cropping keeps every foreground voxel
        assert case_fp.class_voxels[1:] == tuple(int(np.sum(label == k)) for k in (1, 2))
        assert case_fp.class_voxels[1] > 0 and case_fp.class_voxels[2] > 0


def test_foreground_intensity_statistics(fp: Fingerprint, dataset) -> None:
    (props,) = fp.foreground_intensity
    assert props.percentile_00_5 < props.mean < props.percentile_99_5
    assert props.std > 0
    # all foreground voxels of the tiny dataset (fewer than SAMPLES_PER_CASE per case) are sampled
    values = []
    for case in dataset.cases:
        image, _ = read_image(case.image_paths[0])
        label, _ = read_image(case.label_path, dtype=np.int16)
        values.append(image[label > 0])
    values = np.concatenate(values).astype(np.float64)
    assert props.mean == pytest.approx(values.mean(), rel=1e-6)
    assert props.std == pytest.approx(values.std(), rel=1e-6)
    assert props.percentile_99_5 == pytest.approx(np.percentile(values, 99.5), rel=1e-6)


def test_json_round_trip(fp: Fingerprint, tmp_path: Path) -> None:
    path = tmp_path / "fingerprint.json"
    fp.to_json(path)
    loaded = Fingerprint.from_json(path)
    assert loaded == fp
    np.testing.assert_array_equal(loaded.spacings, fp.spacings)


@pytest.mark.slow
def test_fingerprint_in_processes_equals_one_process(tiny_dataset):
    """Each case samples from its own seeded generator, so worker processes change nothing."""
    dataset = load_dataset(tiny_dataset)
    assert fingerprint(dataset, progress=False, processes=2) == fingerprint(dataset, progress=False, processes=1)


def test_regions_and_ignore_are_recorded_and_ignored_voxels_are_not_foreground(dataset_copy) -> None:
    import json

    from autoseg.dataset.imageio import write_image

    meta = json.loads((dataset_copy / "dataset.json").read_text())
    meta.update(labels={"background": 0, "organ": [1, 2], "lesion": 2, "ignore": 3}, regions_class_order=[1, 2])
    (dataset_copy / "dataset.json").write_text(json.dumps(meta))
    ds = load_dataset(dataset_copy)
    values = []
    for case in ds.cases:
        label, geometry = read_image(case.label_path, dtype=np.int16)
        label[label == 2] = 3  # the lesions are unlabelled now
        write_image(case.label_path, label.astype(np.uint8), geometry)
        image, _ = read_image(case.image_paths[0])
        values.append(image[label == 1])
    fp = fingerprint(ds, seed=0, progress=False)
    assert fp.labels["organ"] == (1, 2) and fp.regions_class_order == (1, 2)
    assert all(len(c.class_voxels) == 4 and c.class_voxels[2] == 0 and c.class_voxels[3] > 0 for c in fp.cases)
    # intensities come from labelled foreground only: the organ, not the ignored lesions
    assert fp.foreground_intensity[0].mean == pytest.approx(np.concatenate(values).astype(np.float64).mean(), rel=1e-6)
