"""The pictures: where they cut (the largest 26-connected component), what their pixels show at a known structure,
the image read as regions of its file, and the memory of drawing one against ``picture_bytes``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from autoseg.dataset.imageio import Geometry, read_geometry
from autoseg.review.drawing import FILL_ALPHA, colour
from autoseg.review.pictures import (
    error_picture,
    largest_component_point,
    orthogonal_slices,
    preview_picture,
    read_image_slices,
)

GEOMETRY = Geometry(3, (20, 20, 8), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))


def _slices_of(volume: np.ndarray):
    return lambda point: orthogonal_slices(volume, point)


def test_the_cut_is_in_the_largest_26_connected_component() -> None:
    mask = np.zeros((6, 10, 10), dtype=bool)
    mask[0, 0, 0] = mask[1, 1, 1] = mask[2, 2, 2] = True  # 3 voxels touching at corners: one 26-connected component
    mask[4:6, 7:9, 7] = True  # 4 voxels, face-connected: larger
    assert largest_component_point(mask) in {(z, y, 7) for z in (4, 5) for y in (7, 8)}
    mask[3, 3, 3] = True  # the diagonal chain grows to 4 + 1: now the largest
    assert largest_component_point(mask) in {(i, i, i) for i in range(4)}
    assert largest_component_point(np.zeros((2, 2, 2), dtype=bool)) is None


def test_a_curved_component_is_cut_through_one_of_its_own_voxels() -> None:
    mask = np.zeros((3, 20, 20), dtype=bool)
    mask[1, 2:18, 2] = mask[1, 2, 2:18] = mask[1, 17, 2:18] = True  # a C open to the right: its centroid is outside
    z, y, x = largest_component_point(mask)
    assert mask[z, y, x]


def _cube_case() -> tuple[np.ndarray, np.ndarray]:
    ref = np.zeros((8, 20, 20), dtype=np.int16)
    ref[2:6, 5:15, 5:15] = 1  # class 1: a 4 x 10 x 10 box
    pred = np.zeros_like(ref)
    pred[2:6, 5:15, 8:18] = 1  # shifted 3 voxels along x
    return pred, ref


def test_the_error_picture_outlines_the_reference_solid_and_the_prediction_dashed() -> None:
    pred, ref = _cube_case()
    image = np.zeros((8, 20, 20), dtype=np.float32)  # a constant image is drawn mid grey
    picture, (z, y, x) = error_picture(lambda: (pred, ref), _slices_of(image), GEOMETRY, [(1,), (2,)], [1, 2])
    assert 2 <= z < 6 and pred[z, y, x] != ref[z, y, x]  # through the error
    red, grey = colour(0), np.array([128, 128, 128])
    axial = picture[:20, :20]  # the first panel: the axial slice at 1 mm pixels
    assert np.array_equal(axial[5, 5], red) and np.array_equal(axial[10, 5], red)  # the reference's outline
    assert np.array_equal(axial[10, 10], grey)  # inside both
    assert np.array_equal(axial[7, 17], red) and np.array_equal(axial[10, 17], grey)  # the prediction's: dashed
    assert np.array_equal(axial[2, 2], grey)  # outside both
    assert picture.shape[0] > 20 and picture.shape[1] == 20 + 4 + 20 + 4 + 20  # 3 panels, then the legend below
    assert not (picture == colour(1)).all(axis=2).any()  # class 2 appears nowhere, in the legend neither


def test_the_preview_fills_the_structure_over_the_image() -> None:
    labels = _cube_case()[1].astype(np.uint8)
    image = np.zeros((8, 20, 20), dtype=np.float32)
    picture = preview_picture(labels, _slices_of(image), GEOMETRY, [(1,)], [1])
    filled = (128 * (1 - FILL_ALPHA) + colour(0) * FILL_ALPHA).astype(np.uint8)
    assert np.array_equal(picture[10, 10], filled) and np.array_equal(picture[5, 5], colour(0))
    assert np.array_equal(picture[2, 2], [128, 128, 128])


def test_an_anisotropic_image_is_drawn_with_square_pixels() -> None:
    geometry = Geometry(3, (20, 20, 8), (1.0, 1.0, 3.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))
    pred, ref = _cube_case()
    picture, _ = error_picture(lambda: (pred, ref), _slices_of(np.zeros(ref.shape, np.float32)), geometry, [(1,)], [1])
    assert picture.shape[1] == 20 + 4 + 20 + 4 + 20  # coronal and sagittal: 8 slices of 3 mm are 24 rows
    assert (picture[:24, 24:44] != 0).any(axis=2).all()  # the coronal panel: 24 rows
    assert not picture[20:24, :20].any()  # the axial panel: 20 rows, black below it down to the legend


def test_the_image_is_read_as_regions_equal_to_its_slices(tmp_path: Path) -> None:
    volume = np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7)  # every voxel its own value
    image = sitk.GetImageFromArray(volume)
    image.SetSpacing((0.5, 1.0, 2.0))
    path = tmp_path / "case_0000.nii.gz"
    sitk.WriteImage(image, str(path))
    regions = read_image_slices(path, (1, 2, 3), read_geometry(path))
    expected = orthogonal_slices(volume, (1, 2, 3))
    assert len(regions) == 3 and all(np.array_equal(r, e) for r, e in zip(regions, expected))


MEASURE = """
import sys
from pathlib import Path
import numpy as np
import SimpleITK as sitk
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.dataset.imageio import read_geometry
from autoseg.evaluate.pictures import read_pair
from autoseg.review.pictures import error_picture, read_image_slices

folder = Path(sys.argv[1])
paths = {name: folder / f"{name}.nii.gz" for name in ("pred", "ref", "image")}
geometry = read_geometry(paths["ref"])
reset_peak_rss()
before = process_rss_bytes()
error_picture(
    lambda: read_pair(paths["pred"], paths["ref"]),
    lambda point: read_image_slices(paths["image"], point, geometry),
    geometry,
    [(1,), (2,)],
    [1, 2],
)
print(peak_rss_bytes() - before)
"""


def test_drawing_holds_what_picture_bytes_says_and_under_twice_the_image_and_label_map(tmp_path: Path) -> None:
    """A 128 x 256 x 256 case whose error fills most of it (the largest component's box is about the image): the
    peak of ``error_picture`` reading its label maps as ``autoseg evaluate --images`` does (``read_pair``: uint8),
    measured in a fresh process whose allocations of 128 KiB and more are mapped (``MALLOC_MMAP_THRESHOLD_``: freed
    pages leave the RSS, as large arrays' do by default), is ``picture_bytes`` within 10%, and that is under twice
    the decoded image (float32) plus label map (uint8)."""
    import os
    import subprocess
    import sys

    from autoseg.review.pictures import picture_bytes

    shape = (128, 256, 256)
    ref = np.zeros(shape, dtype=np.uint8)
    ref[10:40, 20:60, 20:60] = 2
    pred = ref.copy()
    pred[2:126, 4:252, 4:252] = 1
    for name, array in (("pred", pred), ("ref", ref), ("image", np.ones(shape, dtype=np.float32))):
        sitk.WriteImage(sitk.GetImageFromArray(array), str(tmp_path / f"{name}.nii.gz"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    measured, predicted = int(run.stdout.split()[-1]), picture_bytes(shape, 1, 2)
    assert 0.9 * predicted <= measured <= 1.1 * predicted, (measured / 2**20, predicted / 2**20)
    assert predicted < 2 * np.prod(shape) * (4 + 1)


def test_a_2d_image_is_one_panel(tmp_path: Path) -> None:
    image = sitk.GetImageFromArray(np.arange(12 * 16, dtype=np.float32).reshape(12, 16))
    image.SetSpacing((1.0, 1.0))
    sitk.WriteImage(image, str(tmp_path / "c_0000.nii.gz"))
    geometry = read_geometry(tmp_path / "c_0000.nii.gz")
    ref = np.zeros((1, 12, 16), dtype=np.int16)
    ref[0, 3:8, 4:10] = 1
    picture, point = error_picture(
        lambda: (np.zeros_like(ref), ref),
        lambda point: read_image_slices(tmp_path / "c_0000.nii.gz", point, geometry),
        geometry,
        [(1,)],
        [1],
    )
    assert picture.shape[1] == 16 and point[0] == 0 and ref[point]
    assert np.array_equal(picture[3, 4], colour(0))  # the missed structure's outline
