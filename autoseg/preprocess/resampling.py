"""Resampling images and label maps to a new voxel grid, one channel at a time in float32.

Grid convention (matches SimpleITK resampling of a centred grid): a volume of ``n`` voxels of spacing
``s`` covers the physical extent ``[-s/2, (n - 1/2) s]`` around its first voxel centre, and the resampled
volume of ``n'`` voxels covers the same extent with the effective spacing ``s * n / n'``. Output voxel
``j`` therefore samples the input at the continuous index ``(j + 1/2) * n / n' - 1/2`` (scipy's
``grid_mode=True``); in SimpleITK terms, the output origin is the input origin shifted by half the
spacing difference, ``origin + (s' - s) / 2``. Boundary handling also follows SimpleITK (B-spline
coefficients with a mirror extension; linear and nearest clamp to the edge voxel), so with the same output
grid ``sitk.Resample`` with ``sitkBSpline`` / ``sitkLinear`` gives the same values as ``order=3`` / ``1``
up to float32 rounding, border voxels included (see tests/preprocess/test_resampling.py).

Anisotropic data (largest / smallest spacing > 3) is resampled in-plane first (spline of ``order``, one
2D slice at a time) and then along the out-of-plane axis with ``order_z`` (0 = nearest, 1 = linear), so
thick slices are not smeared into each other by a cubic spline.

``style`` "sitk" is the above. "skimage" reproduces nnU-Net v2's image resampling (``skimage.transform.resize`` with
``mode="edge"``, no anti-aliasing, ``clip=True``, for a model imported from nnU-Net: ``autoseg.nnunet``): the spline
extends the border voxel instead of mirroring the image, and each zoomed image (each 2D slice on the anisotropic
path) is clipped to its input's range; orders <= 1 are the same in both styles.

Memory: the spline prefilter is computed by us in float32 (scipy's own prefilter makes a float64 copy of
the input), and each channel is written straight into the output array. ``autoseg.memory.host.resampling_peak_bytes``
states what ``resample_image`` holds beyond its input.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import ndimage

from autoseg.core.spacing import SKIMAGE_SPLINE_PAD, out_of_plane_axis
from autoseg.plan.plans import IMAGE_RESAMPLING


def _boundary_mode(order: int) -> str:
    """scipy boundary mode that reproduces SimpleITK: its B-spline coefficients use a whole-sample
    mirror ("mirror"); its linear / nearest interpolators clamp to the edge voxel ("reflect" gives that
    for order <= 1). Neither mode makes scipy pre-pad the input."""
    return "mirror" if order > 1 else "reflect"


def _zoom_into(src: np.ndarray, out: np.ndarray, order: int, style: str = "sitk") -> None:
    """Resample ``src`` onto ``out``'s grid (any ndim) with a spline of ``order``, in float32 (``style``: the module
    docstring's).

    For order > 1 the B-spline coefficients are computed here in float32 (one ``src``-sized temporary);
    every axis is prefiltered, so axes that keep their size are reproduced exactly.
    """
    if style == "skimage":
        _zoom_as_skimage(src, out, order)
        return
    mode = _boundary_mode(order)
    if order > 1:
        src = ndimage.spline_filter(src, order, output=np.float32, mode=mode)
    factors = [n_out / n_in for n_out, n_in in zip(out.shape, src.shape, strict=True)]
    ndimage.zoom(src, factors, output=out, order=order, mode=mode, prefilter=False, grid_mode=True)


def _zoom_as_skimage(src: np.ndarray, out: np.ndarray, order: int) -> None:
    """``skimage.transform.resize(src, out.shape, order, mode="edge", anti_aliasing=False)`` into ``out``: scipy's
    zoom in mode "nearest", whose spline prefilter runs on the input padded by ``SKIMAGE_SPLINE_PAD`` edge voxels per
    side (done here in float32, in place: one temporary of the padded input), then clipped to ``src``'s range."""
    low, high = float(src.min()), float(src.max())
    scale = [n_in / n_out for n_in, n_out in zip(src.shape, out.shape, strict=True)]
    pad = SKIMAGE_SPLINE_PAD if order > 1 else 0
    coefficients = _edge_padded(src, pad) if pad else src
    if pad:
        ndimage.spline_filter(coefficients, order, output=coefficients, mode="nearest")
    offset = [0.5 * f - 0.5 + pad for f in scale]  # grid_mode: output voxel j samples (j + 1/2) * n / n' - 1/2
    ndimage.affine_transform(
        coefficients, scale, offset, out.shape, output=out, order=order, mode="nearest", prefilter=False
    )
    np.clip(out, low, high, out=out)


def _edge_padded(src: np.ndarray, pad: int) -> np.ndarray:
    """float32 ``src`` padded by ``pad`` copies of its border voxels per side (``np.pad(mode="edge")``, which holds an
    input-sized temporary beside the result; here one face of it)."""
    out = np.empty([s + 2 * pad for s in src.shape], np.float32)
    out[tuple(slice(pad, pad + s) for s in src.shape)] = src
    for axis, size in enumerate(src.shape):

        def at(part: slice, axis: int = axis) -> tuple[slice, ...]:
            return tuple(part if a == axis else slice(None) for a in range(src.ndim))

        # the face copied first: numpy would copy the whole overlapping source otherwise
        out[at(slice(0, pad))] = out[at(slice(pad, pad + 1))].copy()
        out[at(slice(pad + size, None))] = out[at(slice(pad + size - 1, pad + size))].copy()
    return out


def _check_order(order: int, name: str) -> None:
    if not 0 <= order <= 5:
        raise ValueError(f"{name}={order} is not a spline order scipy supports; use 0 (nearest) to 5")


def resample_channel(
    channel: np.ndarray,
    new_shape_zyx: Sequence[int],
    spacing_mm: Sequence[float],
    order: int = 3,
    order_z: int = 0,
    out: np.ndarray | None = None,
    style: str = "sitk",
) -> np.ndarray:
    """Resample one channel ``(Z, Y, X)`` to ``new_shape_zyx``; returns float32 ``new_shape_zyx``.

    ``spacing_mm`` is the spacing of ``channel``; when it is anisotropic the out-of-plane axis is
    resampled separately with ``order_z`` (see the module docstring). ``out`` (float32, ``new_shape_zyx``,
    any strides) receives the result if given. Extra memory: for order > 1 one float32 input-sized
    spline temporary (3D path) or one slice of it (anisotropic path), plus on the anisotropic path an
    intermediate ``new_shape`` with the out-of-plane axis left at its original size. ``style``: whose
    resampling to reproduce (``IMAGE_RESAMPLING``, the module docstring).
    """
    if style not in IMAGE_RESAMPLING:
        raise ValueError(f"style {style!r} is not one of {list(IMAGE_RESAMPLING)}")
    _check_order(order, "order")
    _check_order(order_z, "order_z")
    new_shape = tuple(int(n) for n in new_shape_zyx)
    if channel.ndim != 3 or len(new_shape) != 3 or min(new_shape) < 1:
        raise ValueError(
            f"expected a (Z, Y, X) channel and a 3-entry positive shape; got {channel.shape} -> {new_shape}"
        )
    if out is None:
        out = np.empty(new_shape, dtype=np.float32)
    elif out.shape != new_shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 with shape {new_shape}; got {out.dtype} {out.shape}")
    src = channel if channel.dtype == np.float32 else channel.astype(np.float32)
    if src.shape == new_shape:
        out[...] = src
        return out
    axis = out_of_plane_axis(spacing_mm)
    if axis is None:
        _zoom_into(src, out, order, style)
        return out
    # Put the out-of-plane axis first: slices src_a[k] are the in-plane images (views, no copies).
    src_a, out_a = np.moveaxis(src, axis, 0), np.moveaxis(out, axis, 0)
    if src_a.shape[1:] == out_a.shape[1:]:
        mid_a = src_a
    else:
        same_depth = src_a.shape[0] == out_a.shape[0]
        mid_a = out_a if same_depth else np.empty((src_a.shape[0], *out_a.shape[1:]), np.float32)
        for k in range(src_a.shape[0]):
            _zoom_into(src_a[k], mid_a[k], order, style)
    if mid_a is not out_a:
        _zoom_into(mid_a, out_a, order_z)
    return out


def resample_image(
    data: np.ndarray,
    new_shape_zyx: Sequence[int],
    spacing_mm: Sequence[float],
    order: int = 3,
    order_z: int = 0,
    style: str = "sitk",
) -> np.ndarray:
    """Resample an image ``(C, Z, Y, X)`` to float32 ``(C, *new_shape_zyx)``, channel by channel.

    ``spacing_mm`` is the spacing of ``data`` (it decides the anisotropic path); ``style``: ``resample_channel``'s.
    Returns ``data`` itself
    (as float32) when the shape is unchanged. Extra memory at peak: see ``resampling_peak_bytes``.
    """
    if data.ndim != 4:
        raise ValueError(f"resample_image expects (C, Z, Y, X); got an array of shape {data.shape}")
    new_shape = tuple(int(n) for n in new_shape_zyx)
    if data.shape[1:] == new_shape:
        return data.astype(np.float32, copy=False)
    out = np.empty((data.shape[0], *new_shape), dtype=np.float32)  # C x Z' x Y' x X' x 4 bytes
    for c in range(data.shape[0]):
        resample_channel(data[c], new_shape, spacing_mm, order, order_z, out=out[c], style=style)
    return out


def _present_labels(seg_zyx: np.ndarray) -> list[int]:
    """Sorted label values in ``seg_zyx``, found slice by slice (no volume-sized sort)."""
    labels: set[int] = set()
    for k in range(seg_zyx.shape[0]):
        labels.update(int(v) for v in np.unique(seg_zyx[k]))
    return sorted(labels)


def resample_segmentation(
    seg: np.ndarray,
    new_shape_zyx: Sequence[int],
    spacing_mm: Sequence[float],
    order: int = 1,
    order_z: int = 0,
) -> np.ndarray:
    """Resample a label map ``(1, Z, Y, X)`` (integer) to ``(1, *new_shape_zyx)`` of the same dtype.

    Never creates label values that are not in ``seg``. ``order=0``: nearest neighbour. ``order>=1``:
    each label's (``-1`` included) binary mask is resampled as float32 like an image channel and each
    voxel takes the label of the largest response (ties go to the smaller label). Memory beyond the
    input: the output, a float32 running best score, a float32 response, a bool comparison buffer (all
    output-sized), one float32 input-sized mask, and ``resample_channel``'s temporaries.

    Linear / nearest (``order`` and ``order_z`` <= 1, what preprocessing uses) take a faster path with the
    same result up to float32 rounding (ties may break differently): each label's response is computed
    only inside the output box its voxels can reach (``interpolate_separable``), and the most frequent
    label's response is not computed at all but is one minus the others' (linear weights sum to one).
    Memory: a float32 running sum instead of the response; one label's box at a time.
    """
    if seg.ndim != 4 or seg.shape[0] != 1:
        raise ValueError(f"resample_segmentation expects (1, Z, Y, X); got an array of shape {seg.shape}")
    if not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(f"segmentation dtype is {seg.dtype}; expected integer labels (cast with astype(np.int16))")
    new_shape = tuple(int(n) for n in new_shape_zyx)
    if seg.shape[1:] == new_shape:
        return seg
    out = np.empty((1, *new_shape), dtype=seg.dtype)
    if order == 0:
        factors = [n / s for n, s in zip(new_shape, seg.shape[1:], strict=True)]
        ndimage.zoom(seg[0], factors, output=out[0], order=0, mode="reflect", grid_mode=True)
        return out
    labels = _present_labels(seg[0])
    out.fill(labels[0])
    if len(labels) == 1:
        return out
    if order <= 1 and order_z <= 1:
        orders = [order] * 3
        axis = out_of_plane_axis(spacing_mm)
        if axis is not None:
            orders[axis] = order_z
        return _resample_labels_separable(seg, labels, out, tuple(orders))
    mask = np.empty(seg.shape[1:], dtype=np.float32)
    np.equal(seg[0], labels[0], out=mask)
    best_score = resample_channel(mask, new_shape, spacing_mm, order, order_z)
    response = np.empty(new_shape, dtype=np.float32)
    better = np.empty(new_shape, dtype=bool)
    for label in labels[1:]:
        np.equal(seg[0], label, out=mask)
        resample_channel(mask, new_shape, spacing_mm, order, order_z, out=response)
        np.greater(response, best_score, out=better)
        np.copyto(best_score, response, where=better)
        np.copyto(out[0], label, where=better)
    return out


def axis_taps(n_in: int, n_out: int, order: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output index along an axis: the two input indices it interpolates (clamped to the edge)
    and the weight of the second (0 for nearest), on the grid of the module docstring."""
    coord = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    if order == 0:
        nearest = np.clip(np.floor(coord + 0.5), 0, n_in - 1).astype(np.intp)
        return nearest, nearest, np.zeros(n_out, np.float32)
    low = np.floor(coord)
    weight = (coord - low).astype(np.float32)
    low = low.astype(np.intp)
    return np.clip(low, 0, n_in - 1), np.clip(low + 1, 0, n_in - 1), weight


def interpolate_separable(block: np.ndarray, taps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Linear / nearest interpolation of float32 ``block`` one axis at a time with precomputed ``taps``
    (``axis_taps``: indices into ``block`` and weights per axis). An axis whose taps read consecutive voxels with
    no weight is sliced, not copied: when every axis is, the result is a view of ``block``."""
    for axis, (low, high, weight) in enumerate(taps):
        if not np.any(weight) and len(low) and np.array_equal(low, np.arange(low[0], low[0] + len(low))):
            block = block[(slice(None),) * axis + (slice(int(low[0]), int(low[0]) + len(low)),)]
            continue
        shape = [1] * block.ndim
        shape[axis] = -1
        w = weight.reshape(shape)
        lo = np.take(block, low, axis=axis)
        if np.any(weight):
            hi = np.take(block, high, axis=axis)
            hi -= lo
            hi *= w
            lo += hi
            del hi
        block = lo
    return block


def _resample_labels_separable(
    seg: np.ndarray, labels: list[int], out: np.ndarray, orders: tuple[int, ...]
) -> np.ndarray:
    """``resample_segmentation``'s fast path (see its docstring) into ``out`` ``(1, *new_shape)``."""
    shape, new_shape = seg.shape[1:], out.shape[1:]
    taps = [axis_taps(n_in, n_out, o) for n_in, n_out, o in zip(shape, new_shape, orders, strict=True)]
    counts = {label: 0 for label in labels}
    for k in range(shape[0]):  # slice by slice: no volume-sized temporaries
        values, n = np.unique(seg[0, k], return_counts=True)
        for v, c in zip(values.tolist(), n.tolist(), strict=True):
            counts[v] += c
    dominant = max(labels, key=lambda v: (counts[v], -v))
    others_sum = np.zeros(new_shape, np.float32)
    best_score = np.zeros(new_shape, np.float32)
    out.fill(dominant)
    for label in labels:
        if label == dominant:
            continue
        box_in, box_out, box_taps = _label_box(seg[0], label, taps)
        response = interpolate_separable((seg[0][box_in] == label).astype(np.float32), box_taps)
        others_sum[box_out] += response
        best = best_score[box_out]  # a view: updated in place
        better = response > best
        best[better] = response[better]
        out[0][box_out][better] = label
        del response, better, best  # before the next label's passes
    # The dominant label's response is 1 - (the others' sum): it wins where that is larger than the best
    # other response, and on a tie with a larger label value.
    dominant_score = np.subtract(1.0, others_sum, out=others_sum)
    wins = dominant_score > best_score
    wins |= (dominant_score == best_score) & (out[0] > dominant)
    out[0][wins] = dominant
    return out


def _label_box(
    seg_zyx: np.ndarray, label: int, taps: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> tuple[tuple[slice, ...], tuple[slice, ...], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """The input box holding ``label`` (plus one voxel per side, so every tap of an output voxel that reads
    the label falls inside it), the output box of those voxels, and the taps relative to the input box."""
    present = [np.zeros(n, bool) for n in seg_zyx.shape]
    for k in range(seg_zyx.shape[0]):
        hit = seg_zyx[k] == label
        if hit.any():
            present[0][k] = True
            present[1] |= hit.any(axis=1)
            present[2] |= hit.any(axis=0)
    box_in, box_out, box_taps = [], [], []
    for axis_present, (low, high, weight) in zip(present, taps, strict=True):
        where = np.flatnonzero(axis_present)
        a, b = int(where[0]), int(where[-1]) + 1
        reach = np.flatnonzero((high >= a) & (low < b))  # output voxels that read a voxel of [a, b)
        j0, j1 = int(reach[0]), int(reach[-1]) + 1
        a0, b0 = max(0, a - 1), min(len(axis_present), b + 1)
        box_in.append(slice(a0, b0))
        box_out.append(slice(j0, j1))
        box_taps.append((low[j0:j1] - a0, high[j0:j1] - a0, weight[j0:j1]))
    return tuple(box_in), tuple(box_out), box_taps
