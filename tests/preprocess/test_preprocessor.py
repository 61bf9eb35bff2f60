from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from autoseg.core.spacing import compute_new_shape
from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import read_geometry
from autoseg.dataset.raw import load_dataset
from autoseg.plan.budget import Budget
from autoseg.plan.plans import Plans
from autoseg.plan.run import plan_dataset
from autoseg.preprocess.parallel import PreprocessOptions, preprocess
from autoseg.preprocess.store import case_files, open_case, properties_path, read_properties


@pytest.fixture(scope="module")
def planned(tiny_dataset: Path, tmp_path_factory) -> tuple[Workspace, Plans]:
    root = tmp_path_factory.mktemp("preprocess")
    raw = root / tiny_dataset.name
    shutil.copytree(tiny_dataset, raw)
    workspace = Workspace.at(root / "workspace")
    plans = plan_dataset(raw, workspace, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    return workspace, plans


@pytest.fixture(scope="module")
def preprocessed_3d(planned) -> Path:
    workspace, plans = planned
    dataset = load_dataset(workspace.dataset_root())
    return preprocess(
        dataset, plans, "3d_fullres", workspace.preprocessed("3d_fullres"), PreprocessOptions(progress=False)
    )


def _case_ids(planned) -> list[str]:
    workspace, _ = planned
    return [c.case_id for c in load_dataset(workspace.dataset_root()).cases]


def test_each_case_has_data_seg_locations_and_properties(planned, preprocessed_3d: Path) -> None:
    ids = _case_ids(planned)
    names = sorted(p.name for p in preprocessed_3d.iterdir())
    assert names == sorted(f"{c}{s}" for c in ids for s in ("_data.npy", "_seg.npy", "_locations.npy", ".json"))
    for case_id in ids:
        case = open_case(preprocessed_3d, case_id)
        (data, seg), props = case.arrays(), case.properties
        assert data.dtype == np.float32 and data.ndim == 4 and data.shape[0] == 1
        assert seg.dtype == np.int8 and seg.shape == (1, *data.shape[1:])
        assert data.shape[1:] == props.shape_after_resample
        assert set(np.unique(seg).tolist()) == {-1, 0, 1, 2}  # -1 outside the body, all classes present
        assert np.isfinite(data).all()


def test_case_properties_describe_the_transform(planned, preprocessed_3d: Path) -> None:
    workspace, plans = planned
    config = plans.configuration("3d_fullres")
    for case in load_dataset(workspace.dataset_root()).cases:
        props = read_properties(preprocessed_3d, case.case_id)
        geometry = read_geometry(case.image_paths[0])
        assert props.geometry == geometry
        assert props.spacing_mm == geometry.spacing_zyx
        assert props.shape_before_crop == geometry.shape_zyx
        assert props.target_spacing_mm == pytest.approx(config.spacing_mm)
        assert tuple(b - a for a, b in props.crop_bbox) == props.shape_after_crop
        assert all(c < s for c, s in zip(props.shape_after_crop, props.shape_before_crop))
        assert props.shape_after_resample == compute_new_shape(
            props.shape_after_crop, props.spacing_mm, props.target_spacing_mm
        )


def test_class_counts_and_locations_match_the_segmentation(planned, preprocessed_3d: Path) -> None:
    for case_id in _case_ids(planned):
        files = case_files(preprocessed_3d, case_id)
        seg = np.load(files.seg)[0]
        props = read_properties(preprocessed_3d, case_id)
        # -1 (outside the body) counts as background
        assert props.class_voxels == (int(np.sum(seg <= 0)), int(np.sum(seg == 1)), int(np.sum(seg == 2)))
        rows = np.load(files.locations)  # int32 (class, z, y, x)
        assert rows.dtype == np.int32 and set(rows[:, 0].tolist()) == {1, 2}
        for label in (1, 2):
            coords = rows[rows[:, 0] == label, 1:]
            assert coords.shape == (props.class_voxels[label], 3)  # fewer than 10,000: all of them
            assert np.all(seg[tuple(coords.T)] == label)


def test_data_is_zscore_normalized_inside_the_body(planned, preprocessed_3d: Path) -> None:
    _, plans = planned
    assert plans.normalization == ("zscore",) and plans.use_nonzero_mask == (True,)
    for case_id in _case_ids(planned):
        files = case_files(preprocessed_3d, case_id)
        data, seg = np.load(files.data)[0], np.load(files.seg)[0]
        body = data[seg >= 0]
        assert abs(float(body.mean())) < 0.3 and 0.7 < float(body.std()) < 1.3
        assert np.median(np.abs(data[seg < 0])) < 1e-3  # outside the mask set to 0 before resampling


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_rerun_skips_complete_cases_and_redoes_incomplete_ones(planned, preprocessed_3d: Path, tmp_path: Path) -> None:
    workspace, plans = planned
    dataset = load_dataset(workspace.dataset_root())
    out = tmp_path / "3d_fullres"
    shutil.copytree(preprocessed_3d, out)
    before = _mtimes(out)
    preprocess(dataset, plans, "3d_fullres", out, PreprocessOptions(progress=False))
    assert _mtimes(out) == before

    victim = dataset.cases[1].case_id
    reference_props = read_properties(out, victim)
    reference = [np.load(p) for p in case_files(out, victim)]
    properties_path(out, victim).unlink()  # as if the run died before the case's JSON was written
    preprocess(dataset, plans, "3d_fullres", out, PreprocessOptions(progress=False))
    after = _mtimes(out)
    changed = sorted(name for name in before if after[name] != before[name])
    assert changed == [f"{victim}.json", f"{victim}_data.npy", f"{victim}_locations.npy", f"{victim}_seg.npy"]
    for path, array in zip(case_files(out, victim), reference, strict=True):
        np.testing.assert_array_equal(np.load(path), array)
    assert read_properties(out, victim) == reference_props


def test_2d_configuration_keeps_the_slices(planned, tmp_path: Path) -> None:
    workspace, plans = planned
    dataset = load_dataset(workspace.dataset_root())
    dataset = dataclasses.replace(dataset, cases=dataset.cases[:2])
    out = preprocess(dataset, plans, "2d", tmp_path / "2d", PreprocessOptions(progress=False))
    in_plane = plans.configuration("2d").spacing_mm[1:]
    for case in dataset.cases:
        stored = open_case(out, case.case_id)
        props, (data, _) = stored.properties, stored.arrays()
        assert data.shape[1] == props.shape_after_crop[0]  # z never resampled for 2d
        assert props.target_spacing_mm[0] == props.spacing_mm[0]
        assert props.target_spacing_mm[1:] == pytest.approx(in_plane)


@pytest.mark.slow  # ~3 s: each spawned worker imports numpy, scipy and SimpleITK afresh
def test_two_processes_write_the_same_files_as_one(planned, tmp_path: Path) -> None:
    workspace, plans = planned
    dataset = load_dataset(workspace.dataset_root())
    dataset = dataclasses.replace(dataset, cases=dataset.cases[:2])
    one = preprocess(dataset, plans, "3d_fullres", tmp_path / "one", PreprocessOptions(processes=1, progress=False))
    two = preprocess(dataset, plans, "3d_fullres", tmp_path / "two", PreprocessOptions(processes=2, progress=False))
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for path in one.iterdir():
        if path.suffix == ".npy":
            np.testing.assert_array_equal(np.load(path), np.load(two / path.name))
        else:
            assert path.read_text() == (two / path.name).read_text()


def test_class_locations_per_region_never_at_ignore_voxels() -> None:
    from autoseg.dataset.labels import LabelScheme
    from autoseg.preprocess.preprocessor import class_locations, class_voxels_per_slice

    scheme = LabelScheme.from_labels({"background": 0, "organ": [1, 2], "lesion": 2, "ignore": 3}, [1, 2])
    seg = np.array([[[[0, 1, 2], [3, 3, 1]], [[2, -1, 3], [0, 0, 0]]]], dtype=np.int8)  # (1, 2, 2, 3)
    locations = class_locations(seg, class_voxels_per_slice(seg, 4), np.random.default_rng(0), scheme)
    assert set(locations) == {"0", "1"}  # keyed by region index (the output channel)
    assert sorted(locations["0"]) == [(0, 0, 1), (0, 0, 2), (0, 1, 2), (1, 0, 0)]  # values 1 or 2
    assert sorted(locations["1"]) == [(0, 0, 2), (1, 0, 0)]
    plain = LabelScheme.from_labels({"background": 0, "organ": 1, "lesion": 2, "ignore": 3})
    by_class = class_locations(seg, class_voxels_per_slice(seg, 4), np.random.default_rng(0), plain)
    assert set(by_class) == {"1", "2"} and sorted(by_class["2"]) == [(0, 0, 2), (1, 0, 0)]  # no key "3"
