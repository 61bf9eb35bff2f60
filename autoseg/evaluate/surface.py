"""Surface metrics of a class in a case: the 95th-percentile Hausdorff distance (HD95, mm) and the normalized
surface Dice (NSD) at a tolerance in mm, both in the image's physical spacing (anisotropic spacing included).

Definitions (those of MONAI's ``compute_hausdorff_distance(percentile=95)`` and ``compute_surface_dice`` without
subvoxels, and of Metrics Reloaded; DeepMind's surface-distance places surface elements between voxels and
weights them by area, so its values differ slightly):

- the surface S(M) of a mask M is its boundary voxels: voxels of M with at least one face neighbour (6 in 3D,
  4 in 2D) outside M, the outside of the image counting as outside: ``M & ~binary_erosion(M)`` with scipy's
  default structure and ``border_value=0`` (computed here with shifted slices: the same voxels, faster);
- d(x, S) is the Euclidean distance in mm between the centre of voxel x and the nearest voxel centre of S, each
  axis scaled by its spacing (0 when x is itself in S);
- HD95 = max(P95{d(p, S_ref) : p in S_pred}, P95{d(r, S_pred) : r in S_ref}): the larger of the two directed
  95th percentiles (``np.percentile``, linear interpolation). It is symmetric. (medpy's ``hd95`` takes instead
  the 95th percentile of the two sets of distances pooled, which can be smaller.)
- NSD(tau) = (#{p in S_pred : d(p, S_ref) <= tau} + #{r in S_ref : d(r, S_pred) <= tau}) / (|S_pred| + |S_ref|),
  surface voxels counted (not areas): the share of both surfaces within ``tau`` mm of the other.

Empty masks, as the Dice in ``metrics`` treats them: a class absent from both masks has NaN for both metrics;
a class present in only one of them has NSD 0 and HD95 equal to the image diagonal (the length of the field of
view's diagonal, sqrt(sum((size_i * spacing_i)^2)), larger than any distance two voxels of the image can be
apart): the worst finite value, as BraTS scores a missed or spurious region (373.13 mm, the diagonal of its
240x240x155 mm images), so that means over cases stay finite and a miss weighs on them instead of being left out.

Cost: the surfaces are found in the bounding box of the two masks (a box from ``scipy.ndimage.find_objects``
per label value, one pass over each image for all classes). No margin is needed: outside the box both masks
are empty, which is what the erosion assumes at the box's faces, so the surfaces are those of the whole image.
The distances come from a k-d tree (``scipy.spatial.cKDTree``) over the physical coordinates of the surface
voxels: the exact Euclidean nearest neighbour, as a Euclidean distance transform gives, but with memory and time
per surface voxel rather than per box voxel: far less than ``distance_transform_edt(sampling=spacing)`` for a
body-sized class, with the same distances (docs/evaluation.md, "Cost"; ``benchmarks/evaluate.py --compare-edt``).
``surface_metrics_bytes`` estimates the peak; a small organ's box is a few MiB.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from scipy.spatial import cKDTree

from autoseg.dataset.labels import LabelValue

# Normalized surface Dice tolerance when none is given. The metric's authors (Nikolov et al., head-and-neck
# organs at risk) set one per organ from the variation between expert contours, a few mm; 2 mm is the
# tolerance of e.g. the ABCs challenge, and two to three in-plane voxels of a typical CT (0.7-1 mm). A boundary
# one slice off on 5 mm slices is outside it. Set it per task with `autoseg evaluate --nsd-tolerance MM`.
DEFAULT_NSD_TOLERANCE_MM = 2.0

# surface_metrics_bytes: bool bytes per box voxel (the two masks, their two surfaces, a comparison with the
# ignore label; tracemalloc sees a little more with the first surface voxels' coordinates), and per surface
# voxel a float64 coordinate per axis plus the k-d tree's index (8), the query's distances and indices (16), the
# distances kept (8) and the tree's nodes (~10 at leafsize 16; tracemalloc does not see them)
_BOX_BYTES_PER_VOXEL = 5
_SURFACE_BYTES_PER_VOXEL_PER_AXIS = 8
_SURFACE_BYTES_PER_VOXEL = 8 + 16 + 8 + 10


@dataclass(frozen=True)
class SurfaceMetrics:
    hd95_mm: float  # NaN when both masks are empty; the image diagonal when only one is
    nsd: float  # NaN when both masks are empty; 0 when only one is


NOT_COMPUTED = SurfaceMetrics(math.nan, math.nan)


def case_surface_metrics(
    pred: np.ndarray,
    ref: np.ndarray,
    classes: dict[str, LabelValue],
    spacing_mm: tuple[float, ...],
    tolerance_mm: float,
    ignore: int | None = None,
) -> dict[str, SurfaceMetrics]:
    """HD95 and NSD of each class or region (name -> value, a tuple for a region: the union of its values).

    ``pred`` and ``ref``: non-negative integer label maps of one shape, (Z, Y, X) or (Y, X), with
    ``spacing_mm`` in the same axis order. Reference voxels holding ``ignore`` are removed from the
    prediction's masks, so both masks are the voxels the Dice counts (and both end at the ignored region).
    """
    if pred.shape != ref.shape or len(spacing_mm) != pred.ndim:
        raise ValueError(f"prediction {pred.shape}, reference {ref.shape} and spacing {spacing_mm} disagree")
    pred_boxes, ref_boxes = ndimage.find_objects(pred), ndimage.find_objects(ref)  # one pass over each image
    diagonal_mm = _diagonal_mm(pred.shape, spacing_mm)
    result = {}
    for name, value in classes.items():
        values = (value,) if isinstance(value, int) else tuple(value)
        box = union_box([b[v - 1] for b in (pred_boxes, ref_boxes) for v in values if 0 < v <= len(b)])
        if box is None:
            result[name] = NOT_COMPUTED  # absent from both
            continue
        pred_mask, ref_mask = class_mask(pred[box], values), class_mask(ref[box], values)
        if ignore is not None:
            pred_mask &= ref[box] != ignore
        result[name] = _metrics(pred_mask, ref_mask, spacing_mm, tolerance_mm, diagonal_mm)  # masks of the box
    return result


def surface_metrics(
    pred_mask: np.ndarray, ref_mask: np.ndarray, spacing_mm: tuple[float, ...], tolerance_mm: float
) -> SurfaceMetrics:
    """HD95 and NSD of two boolean masks of one shape, (Z, Y, X) or (Y, X), ``spacing_mm`` in that order."""
    if pred_mask.shape != ref_mask.shape or len(spacing_mm) != pred_mask.ndim:
        raise ValueError(f"masks {pred_mask.shape} and {ref_mask.shape} and spacing {spacing_mm} disagree")
    pred_mask, ref_mask = pred_mask.astype(bool, copy=False), ref_mask.astype(bool, copy=False)
    box = union_box([ndimage.find_objects(m.view(np.uint8))[0] for m in (pred_mask, ref_mask) if m.any()])
    diagonal_mm = _diagonal_mm(pred_mask.shape, spacing_mm)
    if box is None:
        return NOT_COMPUTED
    return _metrics(pred_mask[box], ref_mask[box], spacing_mm, tolerance_mm, diagonal_mm)


def surface_distances(
    pred_mask: np.ndarray, ref_mask: np.ndarray, spacing_mm: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """float64 distances in mm: (from each pred surface voxel to the ref surface, from each ref surface voxel
    to the pred surface). Both boolean masks must hold a voxel. The arrays' faces count as the image's outside:
    pass whole-image masks, or a box that holds both masks (as ``case_surface_metrics`` does)."""
    if not (pred_mask.any() and ref_mask.any()):
        raise ValueError("surface distances need a voxel in each mask")
    pred_surface, ref_surface = _surface(pred_mask), _surface(ref_mask)
    spacing = np.asarray(spacing_mm, dtype=np.float64)
    pred_points = np.argwhere(pred_surface) * spacing  # (N, D) float64 mm; the box's origin cancels out
    ref_points = np.argwhere(ref_surface) * spacing
    del pred_surface, ref_surface
    return _nearest(pred_points, ref_points), _nearest(ref_points, pred_points)


def surface_metrics_bytes(box_voxels: int, surface_voxels: int, ndim: int = 3) -> int:
    """Peak bytes held by the surface metrics of one class: bool masks over the bounding box of the two masks
    (``box_voxels``), then coordinates and a k-d tree per surface voxel (``surface_voxels``, both masks). An
    upper bound: the two phases are added, though the second frees most of the first (held against tracemalloc in
    tests/evaluate/test_surface.py)."""
    per_surface = _SURFACE_BYTES_PER_VOXEL_PER_AXIS * ndim + _SURFACE_BYTES_PER_VOXEL
    return _BOX_BYTES_PER_VOXEL * box_voxels + per_surface * surface_voxels


def _metrics(
    pred_mask: np.ndarray, ref_mask: np.ndarray, spacing_mm: tuple[float, ...], tolerance_mm: float, diagonal_mm: float
) -> SurfaceMetrics:
    has_pred, has_ref = bool(pred_mask.any()), bool(ref_mask.any())
    if not (has_pred or has_ref):
        return NOT_COMPUTED
    if not (has_pred and has_ref):
        return SurfaceMetrics(diagonal_mm, 0.0)
    to_ref, to_pred = surface_distances(pred_mask, ref_mask, spacing_mm)
    hd95 = max(float(np.percentile(to_ref, 95)), float(np.percentile(to_pred, 95)))
    within = int(np.count_nonzero(to_ref <= tolerance_mm)) + int(np.count_nonzero(to_pred <= tolerance_mm))
    return SurfaceMetrics(hd95, within / (len(to_ref) + len(to_pred)))


def _surface(mask: np.ndarray) -> np.ndarray:
    """Boundary voxels: in the mask, with a face neighbour outside it or outside the array. The same voxels as
    ``mask & ~binary_erosion(mask)`` (face neighbours, ``border_value=0``), in less time; holds one more bool array
    of the mask's shape."""
    interior = mask.copy()
    for axis in range(mask.ndim):
        head = (slice(None),) * axis + (slice(1, None),)
        tail = (slice(None),) * axis + (slice(None, -1),)
        interior[head] &= mask[tail]  # the neighbour before is in the mask
        interior[tail] &= mask[head]  # and the one after
        interior[(slice(None),) * axis + (0,)] = False  # the array's faces border the outside
        interior[(slice(None),) * axis + (-1,)] = False
    return np.logical_xor(mask, interior, out=interior)  # interior is inside mask: xor = mask & ~interior


def _nearest(points: np.ndarray, targets: np.ndarray) -> np.ndarray:
    distances, _ = cKDTree(targets).query(points, workers=1)  # one thread: evaluation runs beside training
    return distances


def class_mask(labels: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    """Boolean mask of the union of ``values`` (``==`` per value: np.isin is much slower here)."""
    return functools.reduce(np.logical_or, (labels == v for v in values))


def union_box(boxes: list[tuple[slice, ...] | None]) -> tuple[slice, ...] | None:
    boxes = [b for b in boxes if b is not None]
    if not boxes:
        return None
    return tuple(
        slice(min(b[axis].start for b in boxes), max(b[axis].stop for b in boxes)) for axis in range(len(boxes[0]))
    )


def _diagonal_mm(shape: tuple[int, ...], spacing_mm: tuple[float, ...]) -> float:
    return float(math.sqrt(sum((n * s) ** 2 for n, s in zip(shape, spacing_mm, strict=True))))
