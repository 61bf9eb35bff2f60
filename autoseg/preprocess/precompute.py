"""Precomputed spatial augmentations: rotated, scaled, elastically deformed copies of a whole case.

Training then reads patches from the original or one of its copies and applies only the cheap transforms
on the fly (mirroring, intensity), skipping the per-batch spatial transform
(``LoaderConfig.use_precomputed``).
Each copy is a deterministic function of the case and its ``SpatialParams``, which hold everything
needed to replay it (angles, scale, and the seed of the elastic field), and are recorded in the case
properties.

The transform maps an output voxel ``o`` (array index, (z, y, x)) to the input position
``centre + scale * R @ (o - centre) + d(o)``: ``R = Rz @ Ry @ Rx`` rotates about the z, y and x axes
(array index space, as batchgenerators does), ``scale < 1`` zooms in, ``d`` is the elastic displacement in
voxels: uniform random values in ``[-1, 1] * elastic_magnitude_vox`` on a control grid every
``elastic_grid_vox`` voxels, interpolated with cubic B-splines. ``in_plane_only`` (2D configurations and
data whose z spacing is the out-of-plane one) rotates about z only and scales and deforms (y, x) only;
every slice gets the same 2D transform and slices are never mixed.

Interpolation, in float32, a z-slab of the output at a time: images with cubic splines (coefficients
of one channel at a time, computed in float32 with a mirror boundary, 0 outside the image); label maps
per label (``-1`` included, 1 outside the image) linearly and then the largest response (``order_seg=1``,
as the on-the-fly augmentation), or nearest (``order_seg=0``); new label values are never created.
``augment_case_bytes`` gives the memory this holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from autoseg.core.errors import InputError

SLAB_VOXELS = 1 << 20  # output voxels interpolated per call: coordinates 3 x 4 bytes each (12 MiB)


@dataclass(frozen=True)
class PrecomputeConfig:
    """How to draw the spatial parameters of the copies (defaults: the on-the-fly augmentation's ranges).

    ``rotation_deg``: max angle about each axis (3D); ``rotation_deg_in_plane``: max angle about z when
    ``in_plane_only``. ``scale_range``: zoom factors (< 1 zooms in). ``p_elastic``: probability that a copy
    is also deformed elastically, with a magnitude drawn from ``elastic_magnitude_vox``.
    """

    num_copies: int = 0
    rotation_deg: float = 30.0
    rotation_deg_in_plane: float = 180.0
    scale_range: tuple[float, float] = (0.7, 1.4)
    p_elastic: float = 0.3
    elastic_magnitude_vox: tuple[float, float] = (2.0, 6.0)
    elastic_grid_vox: float = 24.0
    order_seg: int = 1

    def __post_init__(self) -> None:
        if self.num_copies < 0:
            raise InputError(f"num_copies must be >= 0 (--precompute-augmentations); got {self.num_copies}")
        if not 0 < self.scale_range[0] <= self.scale_range[1]:
            raise InputError(f"scale_range must be (low, high) with 0 < low <= high; got {self.scale_range}")
        if self.order_seg not in (0, 1):
            raise InputError(f"order_seg must be 0 (nearest) or 1 (linear per label); got {self.order_seg}")


@dataclass(frozen=True)
class SpatialParams:
    """Everything that determines one augmented copy (recorded in the case properties)."""

    seed: int  # seeds the elastic field's control points
    in_plane_only: bool
    rotation_rad_zyx: tuple[float, float, float]  # about the z, y and x axes
    scale: float
    elastic: bool
    elastic_magnitude_vox: float = 0.0
    elastic_grid_vox: float = 24.0
    order_seg: int = 1


def draw_spatial_params(rng: np.random.Generator, config: PrecomputeConfig, in_plane_only: bool) -> SpatialParams:
    """Random parameters of one copy; every draw comes from ``rng``."""
    if in_plane_only:
        a = math.radians(config.rotation_deg_in_plane)
        angles = (float(rng.uniform(-a, a)), 0.0, 0.0)
    else:
        a = math.radians(config.rotation_deg)
        angles = tuple(float(v) for v in rng.uniform(-a, a, size=3))
    scale = float(rng.uniform(*config.scale_range))
    elastic = bool(rng.random() < config.p_elastic)
    magnitude = float(rng.uniform(*config.elastic_magnitude_vox)) if elastic else 0.0
    return SpatialParams(
        seed=int(rng.integers(2**31)),
        in_plane_only=in_plane_only,
        rotation_rad_zyx=angles,
        scale=scale,
        elastic=elastic,
        elastic_magnitude_vox=magnitude,
        elastic_grid_vox=config.elastic_grid_vox,
        order_seg=config.order_seg,
    )


def rotation_matrix(angles_rad_zyx: Sequence[float]) -> np.ndarray:
    """``Rz @ Ry @ Rx`` (3, 3) float64 acting on (z, y, x) index vectors."""
    (cz, sz), (cy, sy), (cx, sx) = ((math.cos(a), math.sin(a)) for a in angles_rad_zyx)
    rz = np.array([[1, 0, 0], [0, cz, -sz], [0, sz, cz]])  # turns the (y, x) plane
    ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])  # turns the (z, x) plane
    rx = np.array([[cx, -sx, 0], [sx, cx, 0], [0, 0, 1]])  # turns the (z, y) plane
    # Rounded so that multiples of 90 deg are exact: cos(pi/2) = 6e-17 would put edge voxels at -1e-16,
    # outside the image for map_coordinates' "constant" mode.
    return np.round(rz @ ry @ rx, 12)


def _bspline_weights(n_out: int, grid_vox: float) -> np.ndarray:
    """(n_out, n_ctrl) float32 cubic B-spline weights of control points every ``grid_vox`` voxels."""
    n_ctrl = int(math.ceil((n_out - 1) / grid_vox)) + 4
    u = np.arange(n_out) / grid_vox + 1.0  # control point 1 sits on voxel 0
    i, t = np.floor(u).astype(np.int64), u - np.floor(u)
    basis = np.stack(
        [(1 - t) ** 3 / 6, (3 * t**3 - 6 * t**2 + 4) / 6, (-3 * t**3 + 3 * t**2 + 3 * t + 1) / 6, t**3 / 6], axis=1
    )
    weights = np.zeros((n_out, n_ctrl), dtype=np.float32)
    for k in range(4):
        np.add.at(weights, (np.arange(n_out), np.clip(i - 1 + k, 0, n_ctrl - 1)), basis[:, k])
    return weights


class _Mapping:
    """Input positions of output voxels a z-slab at a time: (3, nz, Y, X) float32, or (2, Y, X) in-plane."""

    def __init__(self, params: SpatialParams, shape_zyx: tuple[int, int, int]) -> None:
        self.params, self.shape = params, shape_zyx
        axes = (1, 2) if params.in_plane_only else (0, 1, 2)
        rotation = rotation_matrix(params.rotation_rad_zyx)
        self.matrix = params.scale * rotation[np.ix_(axes, axes)]  # (d, d) float64
        self.centre = np.array([(shape_zyx[a] - 1) / 2 for a in axes])
        self.axes = axes
        self.elastic = None
        if params.elastic and params.elastic_magnitude_vox > 0:
            weights = [_bspline_weights(shape_zyx[a], params.elastic_grid_vox) for a in axes]
            rng = np.random.default_rng(params.seed)
            control = rng.uniform(-1, 1, size=(len(axes), *(w.shape[1] for w in weights)))
            self.elastic = (weights, (control * params.elastic_magnitude_vox).astype(np.float32))

    def positions(self, z0: int, z1: int) -> np.ndarray:
        """Input positions of the output voxels ``[z0, z1)`` (3D) or of one slice (in-plane, z ignored)."""
        grids = [np.arange(z0, z1, dtype=np.float64)] if not self.params.in_plane_only else []
        grids += [np.arange(self.shape[1], dtype=np.float64), np.arange(self.shape[2], dtype=np.float64)]
        rel = [g - c for g, c in zip(grids, self.centre, strict=True)]
        d = len(self.axes)
        out = np.empty((d, *(len(g) for g in grids)), dtype=np.float32)
        for i in range(d):
            acc = np.full(out.shape[1:], self.centre[i], dtype=np.float32)
            for j in range(d):
                shape = [1] * d
                shape[j] = -1
                acc += (self.matrix[i, j] * rel[j]).astype(np.float32).reshape(shape)
            out[i] = acc
        if self.elastic is not None:
            weights, control = self.elastic
            if not self.params.in_plane_only:
                weights = [weights[0][z0:z1], *weights[1:]]
            for i in range(d):  # separable: contract the control grid with each axis's weights
                field = control[i]
                for w in weights:
                    field = np.tensordot(field, w, axes=([0], [1]))  # the contracted axis moves last
                out[i] += field
        return out


def _slabs(shape_zyx: tuple[int, int, int]) -> list[tuple[int, int]]:
    nz = max(1, SLAB_VOXELS // (shape_zyx[1] * shape_zyx[2]))
    return [(z0, min(z0 + nz, shape_zyx[0])) for z0 in range(0, shape_zyx[0], nz)]


def augment_case(data: np.ndarray, seg: np.ndarray, params: SpatialParams) -> tuple[np.ndarray, np.ndarray]:
    """One spatially augmented copy of a preprocessed case, same shape and dtypes.

    ``data`` float32 (C, Z, Y, X) (0 outside the image after the transform); ``seg`` signed integer
    (1, Z, Y, X) (``-1`` outside the image after the transform). Memory: ``augment_case_bytes``.
    """
    if data.ndim != 4 or seg.shape != (1, *data.shape[1:]) or not np.issubdtype(seg.dtype, np.signedinteger):
        raise ValueError(
            f"expected data (C, Z, Y, X) and a signed integer seg (1, Z, Y, X); got "
            f"{data.shape} and {seg.dtype} {seg.shape}"
        )
    shape = tuple(int(s) for s in data.shape[1:])
    mapping = _Mapping(params, shape)
    out_data = np.empty(data.shape, dtype=np.float32)
    for c in range(data.shape[0]):
        _interpolate_image(data[c], mapping, out_data[c])
    out_seg = _interpolate_labels(seg[0], mapping, params.order_seg)
    return out_data, out_seg[None]


def _interpolate_image(channel: np.ndarray, mapping: _Mapping, out: np.ndarray) -> None:
    """Cubic spline of ``channel`` (Z, Y, X) at the mapping's positions, into ``out`` float32 (Z, Y, X)."""
    if mapping.params.in_plane_only:
        positions = mapping.positions(0, 1)  # (2, Y, X), the same for every slice
        for k in range(channel.shape[0]):
            coeffs = ndimage.spline_filter(channel[k], 3, output=np.float32, mode="mirror")
            ndimage.map_coordinates(
                coeffs, positions, output=out[k], order=3, mode="constant", cval=0.0, prefilter=False
            )
        return
    coeffs = ndimage.spline_filter(channel, 3, output=np.float32, mode="mirror")  # Z x Y x X x 4 bytes
    for z0, z1 in _slabs(mapping.shape):
        ndimage.map_coordinates(
            coeffs, mapping.positions(z0, z1), output=out[z0:z1], order=3, mode="constant", cval=0.0, prefilter=False
        )


def _interpolate_labels(seg_zyx: np.ndarray, mapping: _Mapping, order_seg: int) -> np.ndarray:
    """Labels of ``seg_zyx`` (Z, Y, X) at the mapping's positions; -1 where they fall outside the image."""
    out = np.empty(seg_zyx.shape, dtype=seg_zyx.dtype)
    in_plane = mapping.params.in_plane_only
    fixed = mapping.positions(0, 1) if in_plane else None  # (2, Y, X): every slice moves the same way
    if order_seg == 0:
        if in_plane:
            for k in range(seg_zyx.shape[0]):
                ndimage.map_coordinates(seg_zyx[k], fixed, output=out[k], order=0, mode="constant", cval=-1)
        else:
            for z0, z1 in _slabs(mapping.shape):
                ndimage.map_coordinates(
                    seg_zyx, mapping.positions(z0, z1), output=out[z0:z1], order=0, mode="constant", cval=-1
                )
        return out
    labels = sorted({-1, *(int(v) for k in range(seg_zyx.shape[0]) for v in np.unique(seg_zyx[k]))})
    masks = np.empty((len(labels), *seg_zyx.shape), dtype=bool)  # L x Z x Y x X bytes
    for i, label in enumerate(labels):
        np.equal(seg_zyx, label, out=masks[i])
    masks = masks.view(np.uint8)
    for z0, z1 in _slabs(mapping.shape):
        positions = None if in_plane else mapping.positions(z0, z1)
        best = np.full((z1 - z0, *seg_zyx.shape[1:]), -1.0, dtype=np.float32)
        response = np.empty_like(best)
        better = np.empty(best.shape, dtype=bool)
        for i, label in enumerate(labels):
            cval = 1.0 if label == -1 else 0.0  # outside the image counts as "outside the body"
            if in_plane:
                for k in range(z0, z1):
                    ndimage.map_coordinates(
                        masks[i, k], fixed, output=response[k - z0], order=1, mode="constant", cval=cval
                    )
            else:
                ndimage.map_coordinates(masks[i], positions, output=response, order=1, mode="constant", cval=cval)
            np.greater(response, best, out=better)  # ties keep the smaller label
            np.copyto(best, response, where=better)
            np.copyto(out[z0:z1], label, where=better)
    return out


def augment_case_bytes(
    shape_zyx: Sequence[int], num_channels: int, num_labels: int, order_seg: int = 1, label_itemsize: int = 1
) -> int:
    """Peak bytes ``augment_case`` holds beyond its inputs (an upper bound).

    The copy (float32 data, labels), the spline coefficients of one channel (float32, input-sized), and
    per slab: positions (3 x float32) and the mapping's float32 temporaries; for ``order_seg=1`` the
    label masks (``num_labels`` + 1 bytes per voxel, ``-1`` included) and slab-sized float32 best score and
    response and bool comparison.
    """
    v = math.prod(int(s) for s in shape_zyx)
    slab = min(v, max(SLAB_VOXELS, int(shape_zyx[1]) * int(shape_zyx[2])))
    copy = num_channels * v * 4 + v * label_itemsize
    image = v * 4 + slab * (3 * 4 + 2 * 4 + 4)
    labels = 0 if order_seg == 0 else (num_labels + 1) * v + slab * (3 * 4 + 4 + 4 + 1 + 2 * 4)
    return copy + max(image, labels)
