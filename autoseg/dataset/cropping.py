"""Cropping a case to its nonzero region, and pasting a cropped array back.

The nonzero mask is where any channel is nonzero, with enclosed holes filled (in 3D), so dark tissue
inside the body stays inside. Label maps are cropped with the image; in the cropped label map,
background voxels outside the nonzero mask are marked ``-1`` (treated as background by the loss, and
never sampled as foreground), which is why label maps are made signed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.ndimage import binary_fill_holes

BBox = tuple[tuple[int, int], ...]  # (start, stop) per axis, stop exclusive

_SIGNED_LABEL_DTYPES = (np.int8, np.int16, np.int32, np.int64)


@dataclass(frozen=True)
class CropResult:
    """``data`` float ``(C, Z', Y', X')`` and ``seg`` signed int ``(1, Z', Y', X')`` (or None), both
    copies cropped to ``bbox`` (in the uncropped ``(Z, Y, X)`` array); ``mask`` is the nonzero mask
    bool ``(Z', Y', X')`` inside the crop."""

    data: np.ndarray
    seg: np.ndarray | None
    bbox: BBox
    mask: np.ndarray


def nonzero_mask(data: np.ndarray) -> np.ndarray:
    """Bool ``(Z, Y, X)``: voxels where any channel of ``data`` ``(C, Z, Y, X)`` is nonzero, holes filled."""
    if data.ndim != 4:
        raise ValueError(f"nonzero_mask expects (C, Z, Y, X); got an array of shape {data.shape}")
    mask = np.zeros(data.shape[1:], dtype=bool)
    for c in range(data.shape[0]):
        mask |= data[c] != 0
    if mask.all():  # typical for CT and most MRI: nothing to fill
        return mask
    # Holes lie inside the mask's bounding box, and background touching the box's faces reaches the array
    # border outside it, so filling inside the box alone gives the same mask, over fewer voxels.
    box = _slices(bounding_box(mask))
    mask[box] = binary_fill_holes(mask[box])
    return mask


# acvl-utils' bounding_boxes (get_bbox_from_mask, crop_and_pad_nd, insert_crop_into_image) is not used here (the
# same memory peaks either way):
# - get_bbox_from_mask scans slices inward from each face in a Python loop: faster only where the box touches the
#   faces (CT), slower where a body lies inside the image (MRI) or the foreground is small.
# - crop_and_pad_nd (a view: + .copy()) and insert_crop_into_image are the same slicing; their padding/clipping of
#   boxes beyond the border is never needed (uncrop raises instead).
# - importing that module loads torch and blosc2: each spawned preprocessing worker would start slower and hold
#   more memory.
def bounding_box(mask: np.ndarray) -> BBox:
    """``(start, stop)`` per axis of the True voxels of ``mask``; the whole array if none is True."""
    bbox = []
    for axis in range(mask.ndim):
        other_axes = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(np.any(mask, axis=other_axes))
        if hits.size == 0:
            return tuple((0, n) for n in mask.shape)
        bbox.append((int(hits[0]), int(hits[-1]) + 1))
    return tuple(bbox)


def _slices(bbox: BBox) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in bbox)


def signed_label_dtype(seg: np.ndarray) -> np.dtype:
    """``seg``'s dtype if it is a signed integer; for unsigned (or bool) labels the smallest signed
    integer type that holds the largest label present (so ``-1`` can be stored)."""
    if seg.dtype == bool:
        return np.dtype(np.int8)
    if not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(
            f"label map dtype is {seg.dtype}; expected integer labels (convert with np.rint(seg).astype(np.int16))"
        )
    if np.issubdtype(seg.dtype, np.signedinteger):
        return seg.dtype
    largest = int(seg.max()) if seg.size else 0
    for dtype in _SIGNED_LABEL_DTYPES:
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"label value {largest} does not fit any signed integer type")


def crop_to_nonzero(data: np.ndarray, seg: np.ndarray | None = None) -> CropResult:
    """Crop ``data`` ``(C, Z, Y, X)`` and ``seg`` ``(1, Z, Y, X)`` to the bounding box of the nonzero mask.

    Returns copies (the inputs are left unchanged). In the cropped ``seg``, voxels that are 0 and outside
    the nonzero mask become ``-1``; unsigned label maps are converted by ``signed_label_dtype``.
    """
    mask = nonzero_mask(data)
    bbox = bounding_box(mask)
    spatial = _slices(bbox)
    cropped_mask = mask[spatial].copy()
    cropped_data = data[(slice(None), *spatial)].copy()
    cropped_seg = None
    if seg is not None:
        if seg.ndim != 4 or seg.shape[0] != 1 or seg.shape[1:] != data.shape[1:]:
            raise ValueError(
                f"label map shape {seg.shape} does not match the image {data.shape}: "
                f"expected (1, {', '.join(map(str, data.shape[1:]))})"
            )
        cropped_seg = seg[(slice(None), *spatial)].astype(signed_label_dtype(seg), copy=True)
        outside = (cropped_seg[0] == 0) & ~cropped_mask
        cropped_seg[0][outside] = -1
    return CropResult(data=cropped_data, seg=cropped_seg, bbox=bbox, mask=cropped_mask)


def uncrop(array: np.ndarray, bbox: BBox, full_shape_zyx: Sequence[int], fill: float = 0) -> np.ndarray:
    """Paste a cropped ``(..., Z', Y', X')`` array into a new ``(..., Z, Y, X)`` array filled with ``fill``.

    ``bbox`` is the crop's box from ``crop_to_nonzero``; leading axes (e.g. channels) are kept as they are.
    """
    full_shape = tuple(int(n) for n in full_shape_zyx)
    expected = tuple(stop - start for start, stop in bbox)
    if len(bbox) != 3 or array.shape[-3:] != expected:
        raise ValueError(f"cropped array shape {array.shape} does not match the bounding box {bbox} (size {expected})")
    if len(full_shape) != 3 or any(lo < 0 or hi > n for (lo, hi), n in zip(bbox, full_shape, strict=True)):
        raise ValueError(f"bounding box {bbox} does not fit in the full shape {full_shape}")
    out = np.full((*array.shape[:-3], *full_shape), fill, dtype=array.dtype)
    out[(Ellipsis, *_slices(bbox))] = array
    return out
