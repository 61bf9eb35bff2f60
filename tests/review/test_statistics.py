"""Statistics per case and structure against values computed by hand; the cohort files assembled from rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from autoseg.dataset.imageio import Geometry
from autoseg.review import statistics
from autoseg.review.statistics import (
    assemble_statistics,
    case_statistics,
    cohort_csv,
    write_case_row,
)

IDENTITY = (1, 0, 0, 0, 1, 0, 0, 0, 1)


def _case() -> tuple[np.ndarray, np.ndarray, Geometry]:
    """4 x 4 x 4 voxels of 2 x 1 x 0.5 mm (z, y, x): 1 mm^3 each. Class 1: (0,0,0) and (1,1,1), touching at a
    corner (one 26-connected component), and (3,3,3) apart; class 2 absent. Image channels: 1, 2, 6 at class 1's
    voxels (channel 0) and 10 x that (channel 1)."""
    labels = np.zeros((4, 4, 4), dtype=np.uint8)
    image = np.zeros((2, 4, 4, 4), dtype=np.float32)
    for value, voxel in zip((1.0, 2.0, 6.0), ((0, 0, 0), (1, 1, 1), (3, 3, 3))):
        labels[voxel] = 1
        image[(0, *voxel)] = value
        image[(1, *voxel)] = 10 * value
    return labels, image, Geometry(3, (4, 4, 4), (0.5, 1.0, 2.0), (0.0, 0.0, 0.0), IDENTITY)


def test_a_structure_is_measured_as_computed_by_hand() -> None:
    labels, image, geometry = _case()
    stats = case_statistics("c", labels, geometry, {"organ": (1,), "lesion": (2,)}, image, ("CT", "PET"))
    organ, lesion = stats.structures
    assert (organ.voxels, organ.components) == (3, 2)
    assert organ.volume_ml == pytest.approx(3 / 1000) and organ.area_mm2 is None
    ct = organ.channels["CT"]
    assert ct.mean == pytest.approx(3.0) and ct.std == pytest.approx(math.sqrt((4 + 1 + 9) / 3))
    assert ct.p5 == pytest.approx(1.1) and ct.p95 == pytest.approx(5.6)  # [1, 2, 6] at ranks 0.1 and 1.9
    assert organ.channels["PET"].p95 == pytest.approx(56.0)
    assert (lesion.voxels, lesion.volume_ml, lesion.components, lesion.channels) == (
        0,
        0.0,
        0,
        {"CT": None, "PET": None},
    )
    assert stats.spacing_mm == (2.0, 1.0, 0.5)


def test_a_region_is_the_union_of_its_values() -> None:
    labels, image, geometry = _case()
    labels[3, 3, 2] = 2  # face-connected to (3, 3, 3)
    stats = case_statistics("c", labels, geometry, {"whole": (1, 2), "core": (2,)}, image[:1], ("CT",))
    whole, core = stats.structures
    assert (whole.voxels, whole.components, whole.values) == (4, 2, (1, 2))
    assert whole.channels["CT"].mean == pytest.approx(9 / 4) and (core.voxels, core.components) == (1, 1)


def test_a_2d_image_has_8_connected_components_and_an_area() -> None:
    labels = np.zeros((1, 3, 3), dtype=np.uint8)
    labels[0, 0, 0] = labels[0, 1, 1] = labels[0, 2, 0] = 1  # diagonal neighbours: one 8-connected component
    geometry = Geometry(2, (3, 3), (0.5, 2.0), (0.0, 0.0), (1, 0, 0, 1))  # x 0.5 mm, y 2 mm
    (organ,) = case_statistics("c", labels, geometry, {"organ": (1,)}).structures
    assert (organ.components, organ.area_mm2, organ.volume_ml, organ.channels) == (1, 3.0, None, {})


def test_rows_of_several_writers_assemble_into_one_run_s_files(tmp_path: Path) -> None:
    labels, image, geometry = _case()
    cases = [case_statistics(c, labels, geometry, {"organ": (1,)}, image, ("CT", "PET")) for c in ("b", "a", "c")]
    one, parts = tmp_path / "one", tmp_path / "parts"
    for case in cases:
        write_case_row(one, case)
    assemble_statistics(one)
    for case in cases:  # each part assembles after its own row: the last one sees them all
        write_case_row(parts, case)
        assemble_statistics(parts)
    for name in ("statistics.csv", "statistics.json"):
        assert (one / name).read_bytes() == (parts / name).read_bytes()
    assert [c["case_id"] for c in json.loads((one / "statistics.json").read_text())["cases"]] == ["a", "b", "c"]
    lines = (one / "statistics.csv").read_text().splitlines()
    assert lines[0].startswith("case,structure,label_values,voxels,volume_ml,area_mm2,components,CT_mean,CT_std,")
    assert lines[1] == "a,organ,1,3,0.003,,2,3.0," + ",".join(
        repr(v) for v in (math.sqrt(14 / 3), 1.1, 5.6, 30.0, math.sqrt(1400 / 3), 11.0, 56.0)
    )


def test_a_row_written_while_another_part_assembles_is_in_the_files(tmp_path: Path, monkeypatch) -> None:
    """Part A lists the rows, part B writes its row and assembles, then A writes what it listed: A lists again, sees
    B's row and assembles again, so whichever writes last, the files hold every row."""
    labels, image, geometry = _case()
    first, late = (case_statistics(c, labels, geometry, {"organ": (1,)}) for c in ("a", "b"))
    write_case_row(tmp_path, first)
    listing, calls = statistics._listing, []

    def listing_then_a_row_arrives(folder: Path):
        calls.append(folder)
        found = listing(folder)
        if len(calls) == 1:
            write_case_row(tmp_path, late)  # another part's row, after A's first listing
        return found

    monkeypatch.setattr(statistics, "_listing", listing_then_a_row_arrives)
    assert assemble_statistics(tmp_path) == 2
    assert [c["case_id"] for c in json.loads((tmp_path / "statistics.json").read_text())["cases"]] == ["a", "b"]


def test_channels_missing_from_a_case_leave_its_cells_empty() -> None:
    labels, image, geometry = _case()
    with_images = case_statistics("a", labels, geometry, {"organ": (1,)}, image[:1], ("CT",))
    without = case_statistics("b", labels, geometry, {"organ": (1,)})
    rows = cohort_csv([with_images, without]).splitlines()
    assert rows[2] == "b,organ,1,3,0.003,,2,,,,"


def test_mean_and_std_summed_in_chunks_are_numpy_s(monkeypatch) -> None:
    monkeypatch.setattr(statistics, "SUM_CHUNK", 7)  # 100 values: 15 chunks, the last one short
    values = np.random.default_rng(1).normal(50, 10, 100).astype(np.float32)
    expected = (values.mean(dtype=np.float64), values.std(dtype=np.float64), *np.percentile(values, (5, 95)))
    got = statistics._channel_statistics(values.copy())
    assert (got.mean, got.std, got.p5, got.p95) == pytest.approx(expected, rel=1e-12)
