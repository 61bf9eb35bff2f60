"""The spatial step of training augmentation: rotation and scaling of a patch read with just the margin
it needs.

Per sample the sampler (``autoseg.data.sampler.PatchSampler``) draws a ``PatchTransform`` (rotation and scaling
about the patch centre, or None: 64 % of samples at p_rotation = p_scale = 0.2) and reads the box
``read_size`` gives for it: the bounding box of the rotated, scaled patch, so that interpolation never
reaches past what was read, and the patch itself for an untransformed sample. ``enlarged_patch_size`` is the
largest such box over all angles and scales (the worst case the memory estimates use).
``spatial_transform`` maps one sample's box to its patch (batchgenerators' rotation convention, pinned by a
test).

Interpolation: images linearly (``order_data=1``, as nnU-Net v2's SpatialTransform; 0 nearest; 3 cubic
B-spline, slower), labels per label linearly then the largest response (``order_seg=1``; 0 nearest).
Orders 0 and 1 run as ``torch.nn.functional.grid_sample``, faster than scipy's map_coordinates (docs/benchmarks.md,
"Training data pipeline").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from batchgenerators.transforms.abstract_transforms import AbstractTransform
from scipy import ndimage

from autoseg.memory.loader_worker import LABELS_PER_CALL
from autoseg.plan.training_data import LoaderConfig, box_size
from autoseg.preprocess.precompute import rotation_matrix


@dataclass(frozen=True)
class PatchTransform:
    """Rotation and scaling of one sample about its patch centre: input offset = ``matrix() @`` output offset.

    As batchgenerators' SpatialTransform: an output offset ``o`` samples the input at ``scale * o @ R``,
    with ``R = autoseg.preprocess.precompute.rotation_matrix(rotation_rad)`` (batchgenerators' ``Rx @ Ry @ Rz`` of
    angle_x, angle_y, angle_z, which turn the array's (y, x), (z, x) and (z, y) planes) for a 3D patch, and
    the 2 x 2 rotation by the one in-plane angle for 2D and dummy 2D. ``scale`` > 1 samples a larger region
    (zooms out)."""

    rotation_rad: tuple[float, ...]
    scale: float

    def matrix(self) -> np.ndarray:
        """(d, d) float64 acting on offsets from the patch centre in array order (d = 3, or 2 in-plane)."""
        if len(self.rotation_rad) == 1:
            c, s = math.cos(self.rotation_rad[0]), math.sin(self.rotation_rad[0])
            return self.scale * np.array([[c, -s], [s, c]]).T
        return self.scale * rotation_matrix(self.rotation_rad).T


def draw_patch_transform(rng: np.random.Generator, config: LoaderConfig) -> PatchTransform | None:
    """A sample's spatial transform (None: none), with batchgenerators' probabilities and ranges: rotation
    with ``p_rotation``, uniform in +-``rotation_deg_effective`` about each axis (in-plane only for 2D and
    dummy 2D); scaling with ``p_scale``, half of the time zooming in (``scale_range[0]``..1), else out."""
    in_plane = config.dim == 2 or config.dummy_2d
    rotate = bool(rng.random() < config.p_rotation) and config.rotation_deg_effective > 0
    scale = bool(rng.random() < config.p_scale)
    if not (rotate or scale):
        return None
    a = math.radians(config.rotation_deg_effective)
    angles = (
        tuple(float(v) for v in rng.uniform(-a, a, 1 if in_plane else 3)) if rotate else (0.0,) * (1 if in_plane else 3)
    )
    low, high = config.scale_range
    factor = 1.0
    if scale:
        zoom_in = rng.random() < 0.5 and low < 1
        factor = float(rng.uniform(low, 1.0) if zoom_in else rng.uniform(max(low, 1.0), high))
    return PatchTransform(angles, factor)


def read_size(patch_size: tuple[int, ...], transform: PatchTransform | None, dummy_2d: bool = False) -> tuple[int, ...]:
    """The box to read around the patch so that ``transform`` never samples outside it (the patch if None).

    Each axis is at least the patch and exceeds it by an even number of voxels (the centres coincide)."""
    patch = tuple(int(p) for p in patch_size)
    if transform is None:
        return patch
    if dummy_2d:
        return (patch[0], *box_size(patch[1:], transform.matrix()[None]))
    return box_size(patch, transform.matrix()[None])


def spatial_transform(
    data: np.ndarray,
    seg: np.ndarray,
    transform: PatchTransform | None,
    config: LoaderConfig,
    out_data: np.ndarray,
    out_seg: np.ndarray,
) -> None:
    """One sample, its patch centred in ``data`` float32 (C, *E) / ``seg`` (1, *E): writes the transformed
    patch into ``out_data`` float32 (C, *P) and ``out_seg`` (1, *P, seg dtype). E >= ``read_size``.

    Linear image planes and up to ``LABELS_PER_CALL`` label indicators (-1 counted as 0, as the loss treats
    it) are interpolated in one ``grid_sample`` call, which computes the interpolation weights once for all
    of them rather than once per plane group."""
    box = read_size(config.patch_size, transform, config.dummy_2d)
    start = [(e - b) // 2 for e, b in zip(data.shape[1:], box, strict=True)]
    crop = (slice(None), *(slice(s, s + b) for s, b in zip(start, box, strict=True)))
    if transform is None:
        out_data[...], out_seg[...] = data[crop], seg[crop]
        return
    d = 2 if (config.dim == 2 or config.dummy_2d) else 3
    patch_sp, box_sp = config.patch_size[-d:], box[-d:]
    data_box = data[crop].reshape(-1, *box_sp)  # (C [x Z], *E_sp): one plane per row
    seg_box = np.ascontiguousarray(seg[crop]).reshape(-1, *box_sp)
    positions = _positions(transform.matrix(), patch_sp, box_sp)  # (d, *P_sp) input voxel coordinates
    grid = _torch_grid(positions, box_sp)
    out_image, out_labels = out_data.reshape(-1, *patch_sp), out_seg.reshape(-1, *patch_sp)
    source = torch.from_numpy(seg_box)
    if config.order_seg == 0:
        out_labels[...] = _grid_sample(source.float(), grid, "nearest").numpy()
    if config.order_data != 1:
        _sample_image(np.ascontiguousarray(data_box), positions, grid, config.order_data, out_image)
    linear = data_box.shape[0] if config.order_data == 1 else 0
    base, others = _label_counts(seg_box) if config.order_seg == 1 else (0, [])
    vote = _LabelVote(base, out_labels) if config.order_seg == 1 else None
    for first in range(0, max(len(others), 1), LABELS_PER_CALL):
        labels, n_image, n_seg = others[first : first + LABELS_PER_CALL], linear if first == 0 else 0, len(seg_box)
        planes = np.empty((n_image + len(labels) * n_seg, *box_sp), dtype=np.float32)
        planes[:n_image] = data_box[:n_image]
        for i, label in enumerate(labels):  # indicator planes; 0 stands for -1 too
            indicator = torch.from_numpy(planes[n_image + i * n_seg : n_image + (i + 1) * n_seg])
            torch.le(source, 0, out=indicator) if label == 0 else torch.eq(source, label, out=indicator)
        if len(planes):
            sampled = _grid_sample(torch.from_numpy(planes), grid, "bilinear").numpy()
            out_image[:n_image] = sampled[:n_image]
            for label, response in zip(labels, sampled[n_image:].reshape(len(labels), *out_labels.shape)):
                vote.add(label, response)
    if vote is not None:
        vote.finish()


def _positions(matrix: np.ndarray, patch: tuple[int, ...], box: tuple[int, ...]) -> np.ndarray:
    """(d, *patch) float32: where each output voxel samples the box (about both centres)."""
    offsets = [np.arange(p, dtype=np.float64) - (p - 1) / 2 for p in patch]
    out = np.empty((len(patch), *patch), dtype=np.float32)
    for i in range(len(patch)):
        acc = np.full(patch, (box[i] - 1) / 2, dtype=np.float32)
        for j, o in enumerate(offsets):
            shape = [1] * len(patch)
            shape[j] = -1
            acc += (matrix[i, j] * o).astype(np.float32).reshape(shape)
        out[i] = acc
    return out


def _torch_grid(positions: np.ndarray, box: tuple[int, ...]) -> torch.Tensor:
    """grid_sample's (1, *P, d) grid (x first, align_corners=True: -1 and 1 are the edge voxels' centres),
    clipped to the box: the positions lie inside it but for rounding."""
    axes = [
        np.clip(2 * positions[i] / (box[i] - 1) - 1, -1, 1) if box[i] > 1 else np.zeros_like(positions[i])
        for i in reversed(range(len(box)))
    ]
    return torch.from_numpy(np.stack(axes, axis=-1))[None]


def _grid_sample(planes: torch.Tensor, grid: torch.Tensor, mode: str) -> torch.Tensor:
    """(N, *E) float32 -> (N, *P). The grid stays inside E, so the padding is never read ('zeros' runs
    twice as fast as 'border')."""
    return torch.nn.functional.grid_sample(planes[None], grid, mode=mode, padding_mode="zeros", align_corners=True)[0]


def _sample_image(planes: np.ndarray, positions: np.ndarray, grid: torch.Tensor, order: int, out: np.ndarray) -> None:
    """Planes (N, *E) float32 at the positions into ``out`` (N, *P): nearest, or cubic B-spline (scipy)."""
    if order == 0:
        out[...] = _grid_sample(torch.from_numpy(planes), grid, "nearest").numpy()
        return
    for n in range(planes.shape[0]):  # coefficients of the box only, float32
        coeffs = ndimage.spline_filter(planes[n], order, output=np.float32, mode="mirror")
        ndimage.map_coordinates(coeffs, positions, output=out[n], order=order, mode="mirror", prefilter=False)


def _label_counts(planes: np.ndarray) -> tuple[int, list[int]]:
    """(the most frequent label, the other labels present) in ``planes``, -1 counted as background 0."""
    unsigned = np.uint8 if planes.itemsize == 1 else np.uint16  # -1 is counted as 255 / 65535
    flat = torch.from_numpy(planes.reshape(-1).view(unsigned))  # torch: a third of numpy's time for uint8
    counts = torch.bincount(flat if planes.itemsize == 1 else flat.long(), minlength=np.iinfo(unsigned).max + 1)
    counts = counts.numpy()
    counts[0], counts[-1] = counts[0] + counts[-1], 0
    base = int(np.argmax(counts))
    return base, [int(v) for v in np.flatnonzero(counts) if v != base]


class _LabelVote:
    """The label of the largest linear response per voxel, into ``out`` (*P). Responses come for the labels
    other than ``base``; the responses of all labels sum to 1, so base's is 1 minus theirs (base wins ties,
    the others' ties go to the earlier label)."""

    def __init__(self, base: int, out: np.ndarray) -> None:
        self.base, self.out = base, out
        self.best, self.rest = np.zeros(out.shape, dtype=np.float32), np.ones(out.shape, dtype=np.float32)
        self.better = np.empty(out.shape, dtype=bool)
        out.fill(base)

    def add(self, label: int, response: np.ndarray) -> None:
        self.rest -= response
        np.greater(response, self.best, out=self.better)
        np.maximum(self.best, response, out=self.best)
        np.copyto(self.out, label, where=self.better)

    def finish(self) -> None:
        np.greater_equal(self.rest, self.best, out=self.better)
        np.copyto(self.out, self.base, where=self.better)


class PatchSpatialTransform(AbstractTransform):
    """The batch's per-sample ``transforms`` on ``data`` (B, C, *E) / ``seg`` (B, 1, *E) -> (B, C, *P)."""

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data, seg = batch["data"], batch["seg"]
        transforms = batch.pop("transforms", None) or [None] * len(data)
        patch = self.config.patch_size
        if data.shape[2:] == patch and all(t is None for t in transforms):
            return batch
        out_data = np.empty((*data.shape[:2], *patch), dtype=np.float32)
        out_seg = np.empty((len(seg), 1, *patch), dtype=seg.dtype)
        for i, t in enumerate(transforms):
            spatial_transform(data[i], seg[i], t, self.config, out_data[i], out_seg[i])
        batch["data"], batch["seg"] = out_data, out_seg
        return batch
