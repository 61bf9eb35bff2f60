"""The training data a configuration's plan asks for: ``LoaderConfig`` (patch, micro-batch, foreground
oversampling, nnU-Net's default augmentation ranges, dummy 2D, precomputed copies), ``loader_config`` of a
``ConfigurationPlan``, and ``enlarged_patch_size``: the largest box an augmented sample reads, which sizes
the loader workers' host RAM (``autoseg.memory.loader_worker.worker_bytes``) before any data exists.

- Dummy 2D: a 3D patch much thinner along z than in-plane (``max(patch) / patch[0] > DUMMY_2D_ANISOTROPY``,
  as nnU-Net decides it) is rotated and scaled in-plane only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoseg.core.errors import InputError
from autoseg.plan.plans import ConfigurationPlan


@dataclass(frozen=True)
class LoaderConfig:
    """How to sample and augment. Defaults follow nnU-Net's default training transforms.

    ``patch_size``: (z, y, x) for a 3D configuration, (y, x) for a 2D one (patches are single z-slices).
    ``dummy_2d``: 3D patches of anisotropic data, rotated/scaled in-plane only (per slice).
    ``use_precomputed`` (with ``augment``): each sample comes from the case or, uniformly, one of its
    augmented copies written by ``autoseg plan_and_preprocess --precompute-augmentations K``; the spatial
    transform (rotation, scaling) is skipped, so patches are read at the patch size; mirroring and the
    intensity transforms stay.
    ``mirror_axes``: spatial axes (0-based, in patch order) to flip with p=0.5 each; None = all, () = none.
    ``rotation_deg``: max angle about each axis for 3D; ``rotation_deg_2d``: max in-plane angle for 2D and
    dummy 2D. ``scale_range``: zoom factors (< 1 zooms in). ``p_*``: per-sample probabilities.
    ``previous_labels`` (a cascade stage): the values of the previous stage's label map (``autoseg.preprocess.store``
    ``open_previous_stage``) one-hot encoded as the last ``len(previous_labels)`` data channels; they are rotated,
    scaled and mirrored with the image (interpolated as image channels) but no intensity transform touches them.
    ``order_data``: image interpolation of rotated/scaled samples, 1 linear (nnU-Net v2's SpatialTransform),
    0 nearest, 3 cubic B-spline (nnU-Net v1; several times slower); ``order_seg``: 1 per label linearly, then the
    largest response; 0 nearest.
    """

    patch_size: tuple[int, ...]
    batch_size: int
    oversample_foreground: float = 0.33
    augment: bool = True
    dummy_2d: bool = False
    mirror_axes: tuple[int, ...] | None = None
    rotation_deg: float = 30.0
    rotation_deg_2d: float = 180.0
    scale_range: tuple[float, float] = (0.7, 1.4)
    p_rotation: float = 0.2
    p_scale: float = 0.2
    order_data: int = 1
    order_seg: int = 1
    p_noise: float = 0.1
    p_blur: float = 0.2
    p_brightness: float = 0.15
    p_contrast: float = 0.15
    p_low_res: float = 0.25
    p_gamma_inverted: float = 0.1
    p_gamma: float = 0.3
    use_precomputed: bool = False  # sample the case or one of its precomputed copies; no spatial transform
    previous_labels: tuple[int, ...] = ()  # a cascade stage: one-hot of the previous stage's labels, last channels

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "scale_range", tuple(float(s) for s in self.scale_range))
        if self.mirror_axes is not None:
            object.__setattr__(self, "mirror_axes", tuple(int(a) for a in self.mirror_axes))
        if len(self.patch_size) not in (2, 3) or min(self.patch_size) < 1:
            raise InputError(f"patch_size must be (y, x) or (z, y, x), positive; got {self.patch_size}")
        if self.batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0.0 <= self.oversample_foreground <= 1.0:
            raise InputError(f"oversample_foreground must be in [0, 1], got {self.oversample_foreground}")
        if self.dummy_2d and self.dim != 3:
            raise InputError("dummy_2d applies to 3D patches (z, y, x); set dummy_2d=False for a 2D patch")
        if any(not 0 <= a < self.dim for a in self.mirror_axes_effective):
            raise InputError(f"mirror_axes {self.mirror_axes} out of range for a {self.dim}D patch (0..{self.dim - 1})")
        if len(self.scale_range) != 2 or not 0 < self.scale_range[0] <= self.scale_range[1]:
            raise InputError(f"scale_range must be (low, high) with 0 < low <= high, got {self.scale_range}")
        object.__setattr__(self, "previous_labels", tuple(int(v) for v in self.previous_labels))
        if self.previous_labels and self.use_precomputed:
            raise InputError(
                "precomputed augmented copies have no previous-stage labels: a cascade stage samples "
                "the cases themselves (use_precomputed=False)"
            )
        if self.order_data not in (0, 1, 3) or self.order_seg not in (0, 1):
            raise InputError(
                f"order_data must be 0, 1 or 3 and order_seg 0 or 1; got {self.order_data}, {self.order_seg}"
            )

    @property
    def dim(self) -> int:
        return len(self.patch_size)

    @property
    def rotation_deg_effective(self) -> float:
        """The max rotation actually used: in-plane for 2D / dummy 2D, about each axis for 3D."""
        return self.rotation_deg_2d if (self.dim == 2 or self.dummy_2d) else self.rotation_deg

    @property
    def mirror_axes_effective(self) -> tuple[int, ...]:
        return tuple(range(self.dim)) if self.mirror_axes is None else self.mirror_axes

    @property
    def enlarged_patch_size(self) -> tuple[int, ...]:
        """The most the sampler reads per sample: the patch plus the margin of the worst rotation and scale
        (the patch if augment=False or use_precomputed)."""
        if not self.augment or self.use_precomputed:
            return self.patch_size
        rotation = self.rotation_deg_effective
        return enlarged_patch_size(self.patch_size, rotation, self.scale_range, self.dummy_2d)


DUMMY_2D_ANISOTROPY = 3.0


def uses_dummy_2d(patch_size: Sequence[int]) -> bool:
    """True for a 3D (z, y, x) patch more than ``DUMMY_2D_ANISOTROPY`` times larger in-plane than along z."""
    return len(patch_size) == 3 and max(patch_size) / patch_size[0] > DUMMY_2D_ANISOTROPY


def loader_config(
    config: ConfigurationPlan, augment: bool, use_precomputed: bool = False, previous_labels: Sequence[int] = ()
) -> LoaderConfig:
    """The loader of ``config``: its patch and micro-batch; augmentation as nnU-Net's defaults, in-plane
    only for a dummy-2D patch; with ``use_precomputed`` the spatial transform is skipped. ``previous_labels``: a
    cascade stage's (``Plans.previous_stage_values``)."""
    patch = tuple(config.patch_size)
    return LoaderConfig(
        patch_size=patch,
        batch_size=config.batch_size,
        augment=augment,
        dummy_2d=augment and uses_dummy_2d(patch),
        use_precomputed=use_precomputed,
        previous_labels=tuple(previous_labels),
    )


# Angles tried per rotation axis when bounding the rotated patch (3D: a 31^3 grid of rotation matrices).
_ANGLE_STEPS_3D = 31


_ANGLE_STEPS_2D = 721


def enlarged_patch_size(
    patch_size: tuple[int, ...],
    rotation_deg: float,
    scale_range: tuple[float, float],
    dummy_2d: bool = False,
) -> tuple[int, ...]:
    """The largest ``read_size`` over every rotation up to ``rotation_deg`` and every scale in ``scale_range``.

    ``rotation_deg``: the largest angle about each axis (3D: about z, y and x, composed; 2D and ``dummy_2d``:
    in-plane only, the z extent stays ``patch_size[0]``), capped at 180 deg. The rotated patch's bounding box
    over those angles, times the largest scale factor.

    Examples at scale (0.7, 1.4): (128, 128, 128) at 30 deg -> (302, 308, 302) (three composed 30 deg
    rotations tilt the patch almost onto its diagonal; 13.5x the patch's voxels); (512, 512) 2D at 180 deg
    -> (1014, 1014) (the diagonal, times 1.4). A sample reads this much only under its worst transform.
    """
    patch = tuple(int(p) for p in patch_size)
    if dummy_2d and len(patch) != 3:
        raise InputError(f"dummy_2d needs a 3D patch (z, y, x), got {patch}")
    spatial = patch[1:] if dummy_2d else patch
    if len(spatial) not in (2, 3):
        raise InputError(f"patch size must have 2 or 3 entries, got {patch}")
    rotations = _rotation_grid(len(spatial), math.radians(min(abs(rotation_deg), 180.0)))
    size = box_size(spatial, rotations.transpose(0, 2, 1) * max(1.0, float(max(scale_range))))
    return (patch[0], *size) if dummy_2d else size


def box_size(patch: tuple[int, ...], matrices: np.ndarray) -> tuple[int, ...]:
    """Smallest box (even margins) holding the patch mapped by every matrix (N, d, d): input = A @ offset."""
    half = (np.asarray(patch, dtype=np.float64) - 1.0) / 2.0  # half span of the voxel centres
    radius = np.einsum("ndj,j->nd", np.abs(matrices), half).max(axis=0)  # input axis d spans sum_j |A_dj| h_j
    size = []
    for r, p in zip(radius, patch, strict=True):
        e = max(p, math.ceil(2.0 * r + 1.0 - 1e-6))
        size.append(e + (e - p) % 2)
    return tuple(size)


def _rotation_grid(dim: int, max_angle_rad: float) -> np.ndarray:
    """Rotation matrices R (N, dim, dim) over a grid of angles in [-max_angle_rad, max_angle_rad] per axis
    (3D: ``rotation_matrix`` of every angle triple, vectorised)."""
    if dim == 2:
        a = np.linspace(-max_angle_rad, max_angle_rad, _ANGLE_STEPS_2D)
        c, s = np.cos(a), np.sin(a)
        return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], 1)
    a = np.linspace(-max_angle_rad, max_angle_rad, _ANGLE_STEPS_3D)
    c, s, one, zero = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)

    def matrix(rows: list[list[np.ndarray]]) -> np.ndarray:  # (N, 3, 3) from 3 x 3 arrays of shape (N,)
        return np.stack([np.stack(row, -1) for row in rows], 1)

    turn_yx = matrix([[one, zero, zero], [zero, c, -s], [zero, s, c]])
    turn_zx = matrix([[c, zero, s], [zero, one, zero], [-s, zero, c]])
    turn_zy = matrix([[c, -s, zero], [s, c, zero], [zero, zero, one]])
    first_two = np.einsum("aij,bjk->abik", turn_yx, turn_zx).reshape(-1, 3, 3)
    return np.einsum("aij,bjk->abik", first_two, turn_zy).reshape(-1, 3, 3)
