from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from autoseg.dataset.imageio import Geometry, write_image
from autoseg.evaluate.metrics import evaluate_folder
from autoseg.evaluate.surface import (
    case_surface_metrics,
    surface_distances,
    surface_metrics,
    surface_metrics_bytes,
)

SPACING_ZYX = (0.5, 1.0, 2.0)  # anisotropic; the smallest along z


def _cube(shape: tuple[int, ...], start: tuple[int, ...], side: int) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(s, s + side) for s in start)] = True
    return mask


def _shifted(mask: np.ndarray, axis: int, k: int) -> np.ndarray:
    return np.roll(mask, k, axis=axis)  # the masks stay clear of the array's end: a translation


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2])
def test_shifted_cube_hd95_is_the_shift_in_mm_on_that_axis(axis: int, k: int) -> None:
    """A translation moves every surface voxel by k * spacing, so no distance exceeds it, and the face moved
    out of the other cube (36 of its 152 surface voxels, over 5%) is exactly that far: HD95 = k * spacing."""
    ref = _cube((14, 14, 14), (4, 4, 4), 6)
    metrics = surface_metrics(_shifted(ref, axis, k), ref, SPACING_ZYX, tolerance_mm=k * SPACING_ZYX[axis])
    assert metrics.hd95_mm == pytest.approx(k * SPACING_ZYX[axis])
    assert metrics.nsd == 1.0  # every distance is within the shift


def test_shifted_cube_nsd_below_the_shift_is_a_known_fraction() -> None:
    """Cube side n = 6 shifted by 2 voxels along z (0.5 mm each): per direction 152 surface voxels; 1.0 mm
    away: the face out of the other cube (36) and the inner face's 16 voxels not on the walls (their walls
    are >= 1 mm away in plane); 0.5 mm away: one ring of the walls beyond the other cube (20); 0 mm: the rest."""
    ref = _cube((14, 14, 14), (4, 4, 4), 6)
    pred = _shifted(ref, 0, 2)
    assert surface_metrics(pred, ref, SPACING_ZYX, 1.0).nsd == 1.0
    assert surface_metrics(pred, ref, SPACING_ZYX, 0.99).nsd == pytest.approx((152 - 52) / 152)
    assert surface_metrics(pred, ref, SPACING_ZYX, 0.5).nsd == pytest.approx((152 - 52) / 152)
    assert surface_metrics(pred, ref, SPACING_ZYX, 0.49).nsd == pytest.approx((152 - 52 - 20) / 152)


def test_hd95_is_the_larger_directed_percentile_and_symmetric() -> None:
    """Reference one voxel, prediction that voxel and one 3 voxels away along z (2.5 mm each): prediction ->
    reference distances [0, 7.5] (P95 7.125), reference -> prediction [0] (P95 0). HD95 = max = 7.125 mm,
    whichever is called the prediction (the pooled P95 of [0, 0, 7.5], medpy's hd95, would be 6.75)."""
    ref = np.zeros((6, 3, 3), dtype=bool)
    ref[1, 1, 1] = True
    pred = ref.copy()
    pred[4, 1, 1] = True
    spacing = (2.5, 1.0, 1.0)
    to_ref, to_pred = surface_distances(pred, ref, spacing)
    assert sorted(to_ref.tolist()) == [0.0, 7.5] and to_pred.tolist() == [0.0]
    for a, b in ((pred, ref), (ref, pred)):
        metrics = surface_metrics(a, b, spacing, tolerance_mm=1.0)
        assert metrics.hd95_mm == pytest.approx(0.95 * 7.5)
        assert metrics.nsd == pytest.approx(2 / 3)  # 1 of 2 and 1 of 1 surface voxels within 1 mm


def test_2d_square_shifted() -> None:
    """2D square n = 6 shifted by 2 voxels along x (0.5 mm): 20 surface voxels per direction; 1.0 mm away:
    the edge out of the other square (6) and the inner edge's 4 voxels off the walls; 0.5 mm away: 2."""
    ref = _cube((12, 14), (3, 3), 6)
    pred = _shifted(ref, 1, 2)
    spacing = (1.0, 0.5)
    assert surface_metrics(pred, ref, spacing, 1.0).hd95_mm == pytest.approx(1.0)
    assert surface_metrics(pred, ref, spacing, 0.99).nsd == pytest.approx(10 / 20)
    assert surface_metrics(pred, ref, spacing, 0.49).nsd == pytest.approx(8 / 20)


def test_empty_masks_follow_the_dice_convention() -> None:
    empty, cube = np.zeros((4, 5, 6), dtype=bool), _cube((4, 5, 6), (1, 1, 1), 2)
    both_empty = surface_metrics(empty, empty, SPACING_ZYX, 2.0)
    assert math.isnan(both_empty.hd95_mm) and math.isnan(both_empty.nsd)
    diagonal = math.sqrt((4 * 0.5) ** 2 + (5 * 1.0) ** 2 + (6 * 2.0) ** 2)
    for pred, ref in ((empty, cube), (cube, empty)):
        one_sided = surface_metrics(pred, ref, SPACING_ZYX, 2.0)
        assert one_sided.hd95_mm == pytest.approx(diagonal) and one_sided.nsd == 0.0


def _brute_force(
    pred: np.ndarray, ref: np.ndarray, spacing: tuple[float, ...], tolerance: float
) -> tuple[float, float]:
    """The definitions written out: surface = a voxel with a face neighbour outside the mask (the array padded
    with background); distances between every pair of surface voxels."""

    def surface(mask: np.ndarray) -> np.ndarray:
        padded = np.pad(mask, 1)
        inner = np.ones_like(mask)
        for axis in range(mask.ndim):
            for step in (-1, 1):
                inner &= np.roll(padded, step, axis=axis)[tuple(slice(1, -1) for _ in mask.shape)]
        return mask & ~inner

    a, b = np.argwhere(surface(pred)) * spacing, np.argwhere(surface(ref)) * spacing
    pairwise = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    to_ref, to_pred = pairwise.min(1), pairwise.min(0)
    hd95 = max(np.percentile(to_ref, 95), np.percentile(to_pred, 95))
    return hd95, (np.sum(to_ref <= tolerance) + np.sum(to_pred <= tolerance)) / (len(a) + len(b))


@pytest.mark.parametrize("shape", [(7, 9, 8), (11, 13)])
def test_random_masks_touching_the_border_match_the_brute_force_definition(shape: tuple[int, ...]) -> None:
    """The bounding-box crop changes nothing, also for masks that touch the image border."""
    rng = np.random.default_rng(3)
    spacing = SPACING_ZYX[-len(shape) :]
    for _ in range(5):
        pred, ref = rng.random(shape) < 0.3, rng.random(shape) < 0.3
        pred[(0,) * len(shape)] = True  # on the border
        got = surface_metrics(pred, ref, spacing, tolerance_mm=1.0)
        assert (got.hd95_mm, got.nsd) == pytest.approx(_brute_force(pred, ref, spacing, 1.0))


def test_case_metrics_regions_and_ignore() -> None:
    """Regions score the union of their values; prediction voxels on reference ignore voxels are removed."""
    ref = np.array([[[0, 1, 1, 2, 2, 0, 0, 0]]], dtype=np.int16)
    pred = np.array([[[0, 2, 1, 1, 2, 0, 0, 0]]], dtype=np.int16)
    got = case_surface_metrics(pred, ref, {"whole": (1, 2), "one": 1}, (3.0, 2.0, 1.0), tolerance_mm=0.5)
    assert (got["whole"].hd95_mm, got["whole"].nsd) == (0.0, 1.0)  # same union
    # one: reference x = 1, 2, prediction x = 2, 3 (1 mm apart): distances [0, 1] each way
    assert got["one"].hd95_mm == pytest.approx(0.95 * 1.0) and got["one"].nsd == pytest.approx(2 / 4)
    ref_ignore = np.array([[[0, 1, 1, 9, 9, 0, 0, 0]]], dtype=np.int16)
    pred_over = np.array([[[0, 1, 1, 1, 1, 0, 0, 0]]], dtype=np.int16)
    kept = case_surface_metrics(pred_over, ref_ignore, {"one": 1}, (3.0, 2.0, 1.0), 0.5, ignore=9)["one"]
    assert (kept.hd95_mm, kept.nsd) == (0.0, 1.0)
    counted = case_surface_metrics(pred_over, ref_ignore, {"one": 1}, (3.0, 2.0, 1.0), 0.5)["one"]
    assert counted.hd95_mm > 0 and counted.nsd < 1


def _geometry(shape_zyx: tuple[int, ...], spacing_xyz: tuple[float, ...]) -> Geometry:
    ndim = len(spacing_xyz)
    size = tuple(reversed(shape_zyx))[:ndim]
    return Geometry(ndim, size, spacing_xyz, (0.0,) * ndim, tuple(np.eye(ndim).ravel().tolist()))


def test_evaluate_folder_uses_the_image_spacing_in_3d_and_2d(tmp_path: Path) -> None:
    """Through the files: 3D spacing (x, y, z) = (2, 1, 0.5) as the cube test; a 2D image is scored on its
    own two axes (its arrays are (1, Y, X), which as a 3D slab would make every voxel a surface voxel)."""
    ref3 = _cube((14, 14, 14), (4, 4, 4), 6).astype(np.uint8)
    ref2 = _cube((1, 12, 14), (0, 3, 3), 6)[0].astype(np.uint8)[None]
    for name, ref, pred, spacing_xyz in (
        ("c3", ref3, _shifted(ref3, 0, 2), (2.0, 1.0, 0.5)),
        ("c2", ref2, _shifted(ref2, 2, 2), (0.5, 1.0)),
    ):
        write_image(tmp_path / name / "gt" / "a.nii.gz", ref, _geometry(ref.shape, spacing_xyz))
        write_image(tmp_path / name / "pred" / "a.nii.gz", pred, _geometry(ref.shape, spacing_xyz))
    for name in ("c3", "c2"):
        folder = tmp_path / name
        summary = evaluate_folder(
            folder / "pred",
            folder / "gt",
            labels={"background": 0, "cube": 1},
            nsd_tolerance_mm=0.99,
            output_json=folder / "summary.json",
        )
        cube = summary.cases[0].classes["cube"]
        assert cube.hd95_mm == pytest.approx(1.0)
        assert cube.nsd == pytest.approx(100 / 152 if name == "c3" else 10 / 20)
        assert summary.mean["cube"].hd95_mm == pytest.approx(1.0) and summary.nsd_tolerance_mm == 0.99
        saved = json.loads((folder / "summary.json").read_text())
        assert saved["mean"]["cube"]["nsd"] == pytest.approx(cube.nsd)


def test_surface_metrics_can_be_skipped(tmp_path: Path) -> None:
    ref = _cube((6, 6, 6), (1, 1, 1), 3).astype(np.uint8)
    for folder in ("gt", "pred"):
        write_image(tmp_path / folder / "a.nii.gz", ref, _geometry(ref.shape, (1.0, 1.0, 1.0)))
    summary = evaluate_folder(tmp_path / "pred", tmp_path / "gt", nsd_tolerance_mm=None)
    assert summary.nsd_tolerance_mm is None and summary.mean["1"].dice == 1.0
    assert math.isnan(summary.cases[0].classes["1"].hd95_mm) and math.isnan(summary.mean["1"].nsd)


@pytest.mark.parametrize("kind", ["blob", "speckle", "speckle2d"])
def test_bytes_estimate_bounds_the_measured_peak(kind: str) -> None:
    """surface_metrics_bytes against tracemalloc (which sees numpy's buffers, not the k-d tree's nodes)."""
    rng = np.random.default_rng(0)
    if kind == "blob":  # the box dominates
        z, y, x = np.ogrid[:60, :100, :100]
        ref = ((z - 30) / 25) ** 2 + ((y - 50) / 40) ** 2 + ((x - 50) / 45) ** 2 < 1
        pred = np.roll(ref, 3, axis=2)
    else:  # every voxel a surface voxel: the coordinates and the tree dominate
        shape = (30, 100, 100) if kind == "speckle" else (600, 600)
        ref, pred = rng.random(shape) < 0.1, rng.random(shape) < 0.1
    to_ref, to_pred = surface_distances(pred, ref, SPACING_ZYX[-ref.ndim :])
    box_voxels = int(np.prod([s.stop - s.start for s in ndimage.find_objects((pred | ref).view(np.uint8))[0]]))
    estimate = surface_metrics_bytes(box_voxels, len(to_ref) + len(to_pred), ref.ndim)
    labels_pred, labels_ref = pred.astype(np.int16), ref.astype(np.int16)
    tracemalloc.start()
    case_surface_metrics(labels_pred, labels_ref, {"a": 1}, SPACING_ZYX[-ref.ndim :], 1.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= estimate <= 1.5 * peak
