"""Training augmentation: nnU-Net's default transforms (batchgenerators) on enlarged patches.

The sampler (``autoseg.loader.PatchSampler``) draws patches larger than the training patch, by the margin
``enlarged_patch_size`` computes, so that rotating and scaling about the patch centre never reaches past
what was read. ``Augmenter`` turns such a batch into the training patch:

- ``augment=True``: rotation / scaling (``SpatialTransform``, which also crops to the patch), Gaussian
  noise, blur, brightness, contrast, simulated low resolution, gamma (inverted and plain), mirroring,
  then segmentation ``-1`` (outside the body mask, and outside the image) -> 0.
- ``augment=False``: a centre crop to the patch and ``-1`` -> 0.
- ``use_precomputed=True``: as ``augment=True`` without ``SpatialTransform``; the patches come from the
  spatially augmented copies ``autoseg.precompute`` wrote, read at the patch size.

batchgenerators draws its random numbers from NumPy's global state (and, for the noise variance, from
Python's ``random``). ``Augmenter.__call__`` seeds both from the ``seed`` it is given and restores the
caller's states afterwards, so one batch's augmentation is a function of (batch, seed) alone and can be
replayed from its seed.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import numpy as np
from batchgenerators.transforms.abstract_transforms import AbstractTransform, Compose
from batchgenerators.transforms.color_transforms import (
    BrightnessMultiplicativeTransform,
    ContrastAugmentationTransform,
    GammaTransform,
)
from batchgenerators.transforms.noise_transforms import GaussianBlurTransform, GaussianNoiseTransform
from batchgenerators.transforms.resample_transforms import SimulateLowResolutionTransform
from batchgenerators.transforms.spatial_transforms import MirrorTransform, SpatialTransform
from batchgenerators.transforms.utility_transforms import RemoveLabelTransform

if TYPE_CHECKING:
    from autoseg.loader import LoaderConfig

# Angles tried per rotation axis when bounding the rotated patch (3D: a 31^3 grid of Rx @ Ry @ Rz).
_ANGLE_STEPS_3D = 31
_ANGLE_STEPS_2D = 721


def enlarged_patch_size(
    patch_size: tuple[int, ...],
    rotation_deg: float,
    scale_range: tuple[float, float],
    dummy_2d: bool = False,
) -> tuple[int, ...]:
    """Size of the region to read so that any augmentation of ``patch_size`` stays inside it.

    ``rotation_deg``: the largest angle drawn about each axis (3D: x, y and z independently as
    batchgenerators composes them; 2D and ``dummy_2d``: in-plane only, the z extent stays ``patch_size[0]``).
    The rotated patch's bounding box is taken over all those angles (capped at 180 deg), then multiplied by
    the largest scale factor (a scale > 1 samples a larger region: zoom out). Each axis is at least the
    patch and grows by an even number of voxels, so the patch centre sits on a voxel centre.

    Examples at scale (0.7, 1.4): (128, 128, 128) at 30 deg -> (302, 308, 302) (three composed 30 deg
    rotations tilt the patch almost onto its diagonal; 13.5x the patch's voxels); (512, 512) 2D at 180 deg
    -> (1014, 1014) (the diagonal, times 1.4).
    """
    patch = tuple(int(p) for p in patch_size)
    if dummy_2d:
        if len(patch) != 3:
            raise ValueError(f"dummy_2d needs a 3D patch (z, y, x), got {patch}")
        return (patch[0], *_bounding_size(patch[1:], rotation_deg, scale_range))
    return _bounding_size(patch, rotation_deg, scale_range)


def _bounding_size(
    patch: tuple[int, ...], rotation_deg: float, scale_range: tuple[float, float]
) -> tuple[int, ...]:
    if len(patch) not in (2, 3):
        raise ValueError(f"patch size must have 2 or 3 entries, got {patch}")
    half = (np.asarray(patch, dtype=np.float64) - 1.0) / 2.0  # half span of the voxel centres
    rotations = _rotation_grid(len(patch), math.radians(min(abs(rotation_deg), 180.0)))
    # batchgenerators maps coordinates c -> c @ M, so output axis d spans sum_j |M[j, d]| * half[j].
    radius = np.einsum("njd,j->nd", np.abs(rotations), half).max(axis=0)
    radius = np.minimum(radius, np.linalg.norm(half))  # never more than the half diagonal
    radius *= max(1.0, float(max(scale_range)))
    size = []
    for r, p in zip(radius, patch, strict=True):
        e = max(p, math.ceil(2.0 * r + 1.0 - 1e-6))
        size.append(e + (e - p) % 2)
    return tuple(size)


def _rotation_grid(dim: int, max_angle_rad: float) -> np.ndarray:
    """Rotation matrices (N, dim, dim) over a grid of angles in [-max_angle_rad, max_angle_rad] per axis."""
    if dim == 2:
        a = np.linspace(-max_angle_rad, max_angle_rad, _ANGLE_STEPS_2D)
        c, s = np.cos(a), np.sin(a)
        return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], 1)
    a = np.linspace(-max_angle_rad, max_angle_rad, _ANGLE_STEPS_3D)
    c, s, one, zero = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)

    def matrix(rows: list[list[np.ndarray]]) -> np.ndarray:  # (N, 3, 3) from 3 x 3 arrays of shape (N,)
        return np.stack([np.stack(row, -1) for row in rows], 1)

    rx = matrix([[one, zero, zero], [zero, c, -s], [zero, s, c]])
    ry = matrix([[c, zero, s], [zero, one, zero], [-s, zero, c]])
    rz = matrix([[c, -s, zero], [s, c, zero], [zero, zero, one]])
    rxy = np.einsum("aij,bjk->abik", rx, ry).reshape(-1, 3, 3)
    return np.einsum("aij,bjk->abik", rxy, rz).reshape(-1, 3, 3)


class _SlicesToChannels(AbstractTransform):
    """(B, C, Z, Y, X) -> (B, C * Z, Y, X) so a 2D spatial transform moves every slice the same way."""

    def __call__(self, **batch: Any) -> dict[str, Any]:
        for key in ("data", "seg"):
            b, c, z, y, x = batch[key].shape
            batch[f"_{key}_cz"] = (c, z)
            batch[key] = batch[key].reshape(b, c * z, y, x)
        return batch


class _ChannelsToSlices(AbstractTransform):
    """Inverse of ``_SlicesToChannels``."""

    def __call__(self, **batch: Any) -> dict[str, Any]:
        for key in ("data", "seg"):
            c, z = batch.pop(f"_{key}_cz")
            b, _, y, x = batch[key].shape
            batch[key] = batch[key].reshape(b, c, z, y, x)
        return batch


def _spatial_transforms(config: LoaderConfig) -> list[AbstractTransform]:
    """Rotation and scaling (batchgenerators' SpatialTransform), cropping the enlarged patch to the patch."""
    spatial_patch = tuple(config.patch_size[1:]) if config.dummy_2d else tuple(config.patch_size)
    angle = math.radians(config.rotation_deg_effective)
    transforms: list[AbstractTransform] = [_SlicesToChannels()] if config.dummy_2d else []
    transforms.append(
        SpatialTransform(
            spatial_patch, patch_center_dist_from_border=None,
            do_elastic_deform=False, alpha=(0.0, 0.0), sigma=(0.0, 0.0),
            do_rotation=angle > 0, angle_x=(-angle, angle), angle_y=(-angle, angle), angle_z=(-angle, angle),
            p_rot_per_axis=1, do_scale=True, scale=tuple(config.scale_range),
            border_mode_data="constant", border_cval_data=0, order_data=config.order_data,
            border_mode_seg="constant", border_cval_seg=-1, order_seg=config.order_seg,
            random_crop=False,  # the sampler already placed the patch; crop about the centre
            p_el_per_sample=0, p_scale_per_sample=config.p_scale, p_rot_per_sample=config.p_rotation,
        )
    )
    if config.dummy_2d:
        transforms.append(_ChannelsToSlices())
    return transforms


def build_train_transforms(config: LoaderConfig) -> Compose:
    """nnU-Net's default training transforms for ``config`` (probabilities and ranges from the config).

    ``config.use_precomputed``: no SpatialTransform (patches come from precomputed augmented copies, read
    at the patch size); mirroring and the intensity transforms stay."""
    ignore_axes = (0,) if config.dummy_2d else None
    transforms = [] if config.use_precomputed else _spatial_transforms(config)
    transforms += [
        GaussianNoiseTransform(noise_variance=(0.0, 0.1), p_per_sample=config.p_noise),
        GaussianBlurTransform((0.5, 1.0), different_sigma_per_channel=True, p_per_sample=config.p_blur,
                              p_per_channel=0.5),
        BrightnessMultiplicativeTransform(multiplier_range=(0.75, 1.25), p_per_sample=config.p_brightness),
        ContrastAugmentationTransform(p_per_sample=config.p_contrast),
        SimulateLowResolutionTransform(zoom_range=(0.5, 1.0), per_channel=True, p_per_channel=0.5,
                                       order_downsample=0, order_upsample=3, p_per_sample=config.p_low_res,
                                       ignore_axes=ignore_axes),
        GammaTransform((0.7, 1.5), invert_image=True, per_channel=True, retain_stats=True,
                       p_per_sample=config.p_gamma_inverted),
        GammaTransform((0.7, 1.5), invert_image=False, per_channel=True, retain_stats=True,
                       p_per_sample=config.p_gamma),
    ]
    if config.mirror_axes_effective:
        transforms.append(MirrorTransform(config.mirror_axes_effective))
    transforms.append(RemoveLabelTransform(-1, 0))
    return Compose(transforms)


class Augmenter:
    """Turns a sampled batch into a training batch of ``config.patch_size``.

    Input: ``data`` float32 (B, C, *E) and ``seg`` int8/int16 (B, 1, *E), E = the enlarged patch.
    Output: ``data`` float32 (B, C, *patch) and ``target`` int64 (B, 1, *patch) with -1 mapped to 0.
    The input arrays may be modified or released.
    """

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.transforms = build_train_transforms(config) if config.augment else None

    def __call__(self, batch: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
        """Augment ``batch``; the result depends only on (batch, seed), so a batch replays from its seed."""
        if self.transforms is None:
            return center_crop(batch["data"], batch["seg"], self.config.patch_size)
        numpy_state, python_state = np.random.get_state(), random.getstate()
        np.random.seed(int(seed) % 2**32)
        random.seed(int(seed))  # GaussianNoiseTransform draws its variance from Python's random
        try:
            out = self.transforms(data=batch.pop("data"), seg=batch.pop("seg"))
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)
        seg = out["seg"]  # float32 from SpatialTransform (integral values), else the sampled int8
        target = seg.astype(np.int64)
        del out["seg"], seg
        return {"data": np.ascontiguousarray(out["data"], dtype=np.float32), "target": target}


def center_crop(data: np.ndarray, seg: np.ndarray, patch_size: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Centre crop (B, C, *E) / (B, 1, *E) to ``patch_size``: float32 data, int64 target with -1 -> 0."""
    starts = [(e - p) // 2 for e, p in zip(data.shape[2:], patch_size, strict=True)]
    if any(s < 0 for s in starts):
        raise ValueError(f"cannot crop {data.shape[2:]} to the larger patch {tuple(patch_size)}")
    window = (slice(None), slice(None), *(slice(s, s + p) for s, p in zip(starts, patch_size, strict=True)))
    target = seg[window].astype(np.int64)
    target[target < 0] = 0
    return {"data": np.array(data[window], dtype=np.float32), "target": target}
