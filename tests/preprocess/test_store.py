"""The preprocessed case format (autoseg.preprocess.store): names, round trip, completeness, errors."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from factories import case_properties

from autoseg.core.artifacts import ArtifactError
from autoseg.core.errors import InputError
from autoseg.preprocess.precompute import SpatialParams
from autoseg.preprocess.store import (
    AugmentedCopy,
    CaseProperties,
    CaseWriter,
    case_files,
    is_complete,
    list_complete_cases,
    open_case,
    precomputed_copies,
    properties_path,
    read_properties,
    write_case,
)

SHAPE_ZYX = (3, 4, 5)


def _arrays(seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, list[tuple[int, int, int]]]]:
    """data float32 (2, Z, Y, X), seg int8 (1, Z, Y, X) with values -1..2, and its class 1 and 2 voxels."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((2, *SHAPE_ZYX)).astype(np.float32)
    seg = rng.integers(-1, 3, (1, *SHAPE_ZYX)).astype(np.int8)
    return data, seg, {str(c): [tuple(v) for v in np.argwhere(seg[0] == c).tolist()] for c in (2, 1)}


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _write_with_copies(folder: Path, case_id: str, num_copies: int) -> tuple[list, CaseProperties]:
    """The case (copy -1) and ``num_copies`` copies of random arrays, then their properties."""
    params = SpatialParams(seed=1, in_plane_only=True, rotation_rad_zyx=(0.5, 0.0, 0.0), scale=1.1, elastic=False)
    arrays = [_arrays(seed) for seed in range(num_copies + 1)]
    writer = CaseWriter(folder, case_id)
    for copy, (data, seg, locations) in enumerate(arrays, start=-1):
        writer.write_arrays(data, seg, locations, copy=copy)
    copies = tuple(AugmentedCopy(k, params, (1, 2, 3)) for k in range(num_copies))
    props = dataclasses.replace(case_properties(case_id, SHAPE_ZYX), class_voxels=(7, 8, 9), augmentations=copies)
    writer.commit(props)
    return arrays, props


def test_files_have_the_documented_names_and_npy_bytes(tmp_path: Path) -> None:
    arrays, _ = _write_with_copies(tmp_path, "c1", num_copies=1)
    data, seg, locations = arrays[0]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "c1.json",
        "c1_aug0_data.npy",
        "c1_aug0_locations.npy",
        "c1_aug0_seg.npy",
        "c1_data.npy",
        "c1_locations.npy",
        "c1_seg.npy",
    ]
    assert (tmp_path / "c1_data.npy").read_bytes() == _npy_bytes(data)
    assert (tmp_path / "c1_seg.npy").read_bytes() == _npy_bytes(seg)
    rows = [(c, *v) for c in (1, 2) for v in locations[str(c)]]  # by class, then in the order given
    assert (tmp_path / "c1_locations.npy").read_bytes() == _npy_bytes(np.array(rows, dtype=np.int32))
    stored = json.loads((tmp_path / "c1.json").read_text())
    assert stored["schema_version"] == 2 and stored["case_id"] == "c1"


def test_round_trip_through_open_case(tmp_path: Path) -> None:
    arrays, props = _write_with_copies(tmp_path, "c1", num_copies=2)
    case = open_case(tmp_path, "c1")
    assert case.properties == props == read_properties(tmp_path, "c1")
    assert case.copies == (0, 1)
    for copy, (data, seg, locations) in enumerate(arrays, start=-1):
        mapped_data, mapped_seg = case.arrays(copy)
        assert not mapped_data.flags.writeable and mapped_seg.dtype == np.int8
        np.testing.assert_array_equal(mapped_data, data)
        np.testing.assert_array_equal(mapped_seg, seg)
        decoded = case.class_locations(copy)
        assert sorted(decoded) == ["1", "2"]
        for c in ("1", "2"):
            np.testing.assert_array_equal(decoded[c], np.array(locations[c], dtype=np.int32).reshape(-1, 3))
    assert precomputed_copies(tmp_path, ["c1"]) == 2


def test_a_case_without_its_json_is_incomplete(tmp_path: Path) -> None:
    data, seg, locations = _arrays(0)
    write_case(tmp_path, case_properties("done", SHAPE_ZYX), data, seg, locations)
    writer = CaseWriter(tmp_path, "killed")  # died after the arrays, before commit
    writer.write_arrays(data, seg, locations)
    _write_with_copies(tmp_path, "copied", num_copies=1)
    assert list_complete_cases(tmp_path) == ["copied", "done"]
    assert not is_complete(tmp_path, "killed") and is_complete(tmp_path, "done")
    assert is_complete(tmp_path, "copied", num_copies=1) and not is_complete(tmp_path, "done", num_copies=1)
    with pytest.raises(InputError, match=r"'killed'.*killed\.json.*run preprocessing"):
        open_case(tmp_path, "killed")
    case_files(tmp_path, "done").locations.unlink()  # an array lost: incomplete too
    assert list_complete_cases(tmp_path) == ["copied"]


def test_commit_refuses_before_every_listed_copy_is_written(tmp_path: Path) -> None:
    data, seg, locations = _arrays(0)
    writer = CaseWriter(tmp_path, "c1")
    writer.write_arrays(data, seg, locations)
    params = SpatialParams(seed=1, in_plane_only=False, rotation_rad_zyx=(0.0, 0.0, 0.0), scale=1.0, elastic=False)
    props = dataclasses.replace(case_properties("c1", SHAPE_ZYX), augmentations=(AugmentedCopy(0, params, ()),))
    with pytest.raises(ValueError, match=r"copies \[0\], but arrays written for \[-1\]"):
        writer.commit(props)
    assert not properties_path(tmp_path, "c1").exists()
    with pytest.raises(ValueError, match="properties of 'other'"):
        writer.commit(case_properties("other", SHAPE_ZYX))


def test_write_rejects_arrays_off_the_format(tmp_path: Path) -> None:
    data, seg, locations = _arrays(0)
    writer = CaseWriter(tmp_path, "c1")
    with pytest.raises(ValueError, match=r"expected data \(C, Z, Y, X\) and seg \(1, Z, Y, X\)"):
        writer.write_arrays(data, seg[:, :2], locations)
    with pytest.raises(ValueError, match="float32 data and a signed integer seg, got float64"):
        writer.write_arrays(data.astype(np.float64), seg, locations)
    assert list(tmp_path.iterdir()) == []


def test_properties_of_another_schema_fail_naming_the_file(tmp_path: Path) -> None:
    _write_with_copies(tmp_path, "c1", num_copies=0)
    path = properties_path(tmp_path, "c1")
    where = re.escape(str(path))
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 1}))
    with pytest.raises(ArtifactError, match=rf"{where}: case properties schema_version 1 is not the supported 2"):
        read_properties(tmp_path, "c1")
    with pytest.raises(ArtifactError, match=where):
        precomputed_copies(tmp_path, ["c1"])
    path.write_text(json.dumps({"case_id": "c1", "schema_version": 2}))  # the old hand-written stub
    case = open_case(tmp_path, "c1")
    with pytest.raises(ArtifactError, match=rf"{where}: missing key 'geometry'"):
        assert case.copies is None
    path.write_text("{")
    with pytest.raises(ArtifactError, match=rf"{where}: not valid JSON"):
        read_properties(tmp_path, "c1")
    path.unlink()
    with pytest.raises(ArtifactError, match=rf"{where}: file not found; .*run plan_and_preprocess"):
        precomputed_copies(tmp_path, ["c1"])


def test_a_bad_locations_file_names_itself(tmp_path: Path) -> None:
    _write_with_copies(tmp_path, "c1", num_copies=0)
    path = case_files(tmp_path, "c1").locations
    np.save(path, np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: expected \(N, 4\) rows"):
        open_case(tmp_path, "c1").class_locations()
