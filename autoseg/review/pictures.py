"""The pictures of one case: three orthogonal slices (axial, coronal, sagittal; one slice for a 2D image) through a
chosen point, the label maps drawn over the image (``drawing.compose``).

- ``error_picture`` (``autoseg evaluate --images``): through the largest error, the largest 26-connected component
  of the voxels where prediction and reference differ; prediction dashed and reference solid, outlined.
- ``preview_picture`` (``autoseg predict --preview``): through the largest 26-connected component of the predicted
  foreground; the prediction filled and outlined.

The point is a voxel of that component: on the axial slice holding most of it, its voxel nearest that slice's
centroid of it (a centroid alone may fall outside a curved component). Memory: the label maps are the largest
arrays held; the image is never read whole: SimpleITK reads the three slices as regions (``read_image_slices``;
formats it cannot read by region are read whole and sliced). ``picture_bytes`` is the peak, held against a
measurement by the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import SimpleITK as sitk
from scipy import ndimage

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry
from autoseg.review.drawing import Layer, compose

Point = tuple[int, int, int]  # (z, y, x)
COUNT_SLAB = 16  # z-slices whose component sizes are counted at a time (bincount's int64 copy stays small)


def largest_component_point(mask: np.ndarray) -> Point | None:
    """A voxel of the largest 26-connected component of ``mask`` (Z, Y, X) bool (see the module's docstring);
    None when ``mask`` is empty. Temporary: the components, int32 (4 bytes a voxel)."""
    components, count = ndimage.label(mask, structure=np.ones((3, 3, 3), dtype=bool))
    if count == 0:
        return None
    sizes = np.zeros(count + 1, dtype=np.int64)
    for z in range(0, components.shape[0], COUNT_SLAB):
        sizes += np.bincount(components[z : z + COUNT_SLAB].ravel(), minlength=count + 1)
    largest = int(np.argmax(sizes[1:])) + 1
    box = ndimage.find_objects(components, max_label=largest)[largest - 1]
    inside = components[box] == largest
    del components
    z = int(np.argmax(inside.sum(axis=(1, 2))))
    ys, xs = np.nonzero(inside[z])
    nearest = int(np.argmin((ys - ys.mean()) ** 2 + (xs - xs.mean()) ** 2))
    return (box[0].start + z, box[1].start + int(ys[nearest]), box[2].start + int(xs[nearest]))


def centre(shape_zyx: Sequence[int]) -> Point:
    return tuple(n // 2 for n in shape_zyx)  # type: ignore[return-value]


def orthogonal_slices(volume: np.ndarray, point: Point) -> tuple[np.ndarray, ...]:
    """Copies of the slices of ``volume`` (Z, Y, X) through ``point``: axial (Y, X), coronal (Z, X) and sagittal
    (Z, Y), z upward (rows reversed); a 2D image (Z = 1): its one slice."""
    z, y, x = point
    if volume.shape[0] == 1:
        return (volume[0].copy(),)
    return (volume[z].copy(), volume[::-1, y, :].copy(), volume[::-1, :, x].copy())


def panel_spacings(geometry: Geometry) -> list[tuple[float, float]]:
    """The (row, column) spacing in mm of each panel of ``orthogonal_slices``."""
    sz, sy, sx = geometry.spacing_zyx
    return [(sy, sx)] if geometry.ndim == 2 else [(sy, sx), (sz, sx), (sz, sy)]


def read_image_slices(path: Path, point: Point, geometry: Geometry) -> tuple[np.ndarray, ...]:
    """The ``orthogonal_slices`` of the image file ``path`` (one channel) through ``point``, each read as a region
    of the file (the whole image is never held where SimpleITK's reader of the format streams)."""
    if geometry.ndim == 2:
        image = sitk.GetArrayFromImage(_read(path, None))
        return (image.reshape(geometry.shape_zyx[1:]).astype(np.float32),)
    z, y, x = point
    size = list(geometry.size_xyz)
    regions = [
        ((0, 0, z), (size[0], size[1], 1)),
        ((0, y, 0), (size[0], 1, size[2])),
        ((x, 0, 0), (1, size[1], size[2])),
    ]
    axial, coronal, sagittal = (sitk.GetArrayFromImage(_read(path, region)).astype(np.float32) for region in regions)
    # the regions' arrays are (1, Y, X), (Z, 1, X) and (Z, Y, 1)
    axial, coronal, sagittal = axial[0], coronal[:, 0, :], sagittal[:, :, 0]
    return (axial, coronal[::-1].copy(), sagittal[::-1].copy())


def _read(path: Path, region: tuple[Sequence[int], Sequence[int]] | None) -> sitk.Image:
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    if region is not None:
        reader.SetExtractIndex([int(v) for v in region[0]])
        reader.SetExtractSize([int(v) for v in region[1]])
    try:
        return reader.Execute()
    except RuntimeError as e:
        raise InputError(f"{path}: SimpleITK cannot read this image for its picture ({str(e).strip()[:200]})") from e


def error_picture(
    read_labels: Callable[[], tuple[np.ndarray, np.ndarray]],
    read_image: Callable[[Point], tuple[np.ndarray, ...]],
    geometry: Geometry,
    structures: Sequence[tuple[int, ...]],
    numbers: Sequence[int],
    ignore: int | None = None,
) -> tuple[np.ndarray, Point]:
    """The picture of a prediction against its reference, and its point: ``read_labels()`` -> (prediction,
    reference) (Z, Y, X) label maps, read here so that they are freed before the image's slices are read
    (``read_image(point)``: ``read_image_slices``). The point is on the largest error (reference voxels of
    ``ignore`` left out), else on the reference's largest structure, else the centre."""
    pred, ref = read_labels()
    wrong = pred != ref
    if ignore is not None:
        wrong &= ref != ignore
    point = largest_component_point(wrong)
    del wrong
    if point is None:
        point = largest_component_point(ref > 0) or centre(ref.shape)
    layers = [Layer(orthogonal_slices(pred, point), "dashed"), Layer(orthogonal_slices(ref, point), "solid")]
    del pred, ref
    return compose(read_image(point), layers, panel_spacings(geometry), structures, numbers), point


def preview_picture(
    labels: np.ndarray,
    read_image: Callable[[Point], tuple[np.ndarray, ...]],
    geometry: Geometry,
    structures: Sequence[tuple[int, ...]],
    numbers: Sequence[int],
) -> np.ndarray:
    """The preview of a label map (Z, Y, X): through its largest foreground component (else the centre), filled."""
    point = largest_component_point(labels > 0) or centre(labels.shape)
    layer = Layer(orthogonal_slices(labels, point), "filled")
    return compose(read_image(point), [layer], panel_spacings(geometry), structures, numbers)


def picture_bytes(shape_zyx: Sequence[int], label_itemsize: int, maps: int) -> int:
    """Peak bytes of drawing one picture beyond what the caller holds: ``maps`` label maps of ``label_itemsize``
    bytes a voxel read here (2 uint8 maps for ``error_picture`` as ``autoseg evaluate`` reads them; none for
    ``preview_picture``, whose caller holds its label map), the bool mask, the int32 components and, beside them,
    the bool of the largest component's bounding box (at most the image: ``largest_component_point``). The slices,
    the picture and the image's regions are small beside them."""
    voxels = math.prod(shape_zyx)
    return voxels * (maps * label_itemsize + 1 + 4 + 1)
