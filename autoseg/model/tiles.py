"""Where the sliding window puts its tiles on one image: the padding, each axis's tile starts (one step fraction
per axis, ``overlap_step_fractions`` for a tile larger than the training patch), the Gaussian weight of a tile,
and how many z-slices one tile batch writes (``accumulator_depth``, the accumulator's window). The sliding window
(``autoseg.model.sliding_window``), its memory model (``autoseg.memory.inference``), the inference tile
(``autoseg.plan.inference_tile``) and the time budget (``autoseg.train.schedule``) all count tiles with it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Where a tile's Gaussian weight peaks on an axis of n voxels: "middle" ((n - 1) / 2: symmetric, flip(g) == g), or
# "floor" (n // 2: nnU-Net v2's importance map, for a model imported from it; half a voxel off on an even axis)
GAUSSIAN_CENTRES = ("middle", "floor")

# One tile's region in the padded (Z, Y, X) volume: 3 slices (3D), or (z index, y slice, x slice) (2D).
Region = tuple[int | slice, ...]


def gaussian_importance_map(
    patch_size: tuple[int, ...],
    sigma_scale: float = 1.0 / 8,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    centre: str = "middle",
) -> torch.Tensor:
    """Gaussian weights ``(*patch_size)`` peaking at the patch's ``centre`` (``GAUSSIAN_CENTRES``), sigma =
    ``patch_size * sigma_scale``, in ``dtype`` (None: float32).

    Normalized to a maximum of 1; voxels that underflow to 0 in ``dtype`` get the smallest nonzero value so
    the weight map never divides by zero. Cached per (patch, sigma, dtype, device): treat it as read-only.
    (torch is imported here, not with the module: the tile layout below is counted without it.)
    """
    import torch

    patch = tuple(int(p) for p in patch_size)
    return _gaussian_cached(patch, float(sigma_scale), dtype or torch.float32, torch.device(device), centre)


def clear_gaussian_cache() -> None:
    """Forget the cached Gaussians (a memory measurement that must see the Gaussian being created)."""
    _gaussian_cached.cache_clear()


@functools.lru_cache(maxsize=16)
def _gaussian_cached(
    patch: tuple[int, ...], sigma_scale: float, dtype: torch.dtype, device: torch.device, centre: str
) -> torch.Tensor:
    import torch

    gauss = np.ones((), dtype=np.float64)
    for size in patch:
        offset = np.arange(size, dtype=np.float64) - ((size - 1) / 2.0 if centre == "middle" else size // 2)
        sigma = size * sigma_scale
        gauss = np.multiply.outer(gauss, np.exp(-0.5 * (offset / sigma) ** 2))
    gauss /= gauss.max()
    out = torch.from_numpy(gauss).to(dtype)
    zero = out == 0
    if zero.any():
        out[zero] = out[~zero].min()
    return out.to(device)


def _axis_starts(size: int, patch: int, step_fraction: float) -> tuple[int, ...]:
    """The tile-count rule, written once: starts of the tiles along one axis of ``size`` >= ``patch``:
    ``ceil((size - patch) / (patch * step_fraction)) + 1`` starts, evenly spaced from 0 to ``size - patch``
    (rounded), so consecutive tiles overlap by at least ``1 - step_fraction`` of a patch and the last tile
    ends on the border."""
    # 1e-9: a step from overlap_step_fractions (e.g. 48 * (1 - 20 / 48)) may land a rounding error above an
    # exact number of steps
    num_steps = math.ceil((size - patch) / (patch * step_fraction) - 1e-9) + 1
    return tuple(int(s) for s in np.round(np.linspace(0, size - patch, num_steps)).astype(int))


@dataclass(frozen=True)
class TileLayout:
    """Where ``sliding_window_predict`` puts its tiles on one image; ``tile_layout`` builds it.

    ``padded_shape_zyx``: the image padded (zeros, centred; the odd voxel after) to at least the patch; a 2D
    patch pads only (Y, X), never Z. ``axis_starts``: per padded axis, the tiles' start indices (a 2D
    patch: every slice z along Z). The tiles are every combination, in C order.
    """

    image_shape_zyx: tuple[int, int, int]
    patch_size: tuple[int, ...]  # (z, y, x) for a 3D network, (y, x) for a 2D one
    padded_shape_zyx: tuple[int, int, int]
    axis_starts: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

    @property
    def num_tiles(self) -> int:
        return math.prod(len(starts) for starts in self.axis_starts)

    @property
    def pads(self) -> bool:
        """Whether the image is smaller than the patch along some axis (and padded there)."""
        return self.padded_shape_zyx != self.image_shape_zyx

    @property
    def image_region(self) -> tuple[slice, slice, slice]:
        """Slices of the unpadded image inside the padded ``(Zp, Yp, Xp)`` volume."""
        return tuple(
            slice((p - s) // 2, (p - s) // 2 + s)  # type: ignore[return-value]
            for s, p in zip(self.image_shape_zyx, self.padded_shape_zyx, strict=True)
        )

    def regions(self) -> list[Region]:
        """Every tile's region in the padded volume: 3 slices (3D), or (z index, y slice, x slice) (2D)."""
        if len(self.patch_size) == 3:
            return [
                tuple(slice(s, s + p) for s, p in zip(start, self.patch_size, strict=True))
                for start in itertools.product(*self.axis_starts)
            ]
        py, px = self.patch_size
        return [(z, slice(y, y + py), slice(x, x + px)) for z, y, x in itertools.product(*self.axis_starts)]


def tile_layout(
    image_shape_zyx: Sequence[int], patch_size: Sequence[int], step_fraction: float | Sequence[float] = 0.5
) -> TileLayout:
    """The padding and tiles of ``sliding_window_predict`` for an image of ``image_shape_zyx`` (Z, Y, X);
    ``patch_size`` (z, y, x) for a 3D network or (y, x) for a 2D network (each slice tiled over (Y, X)).
    ``step_fraction``: one for every axis of the patch, or one per axis (``overlap_step_fractions``).

    Example: image (3, 5, 20), patch (4, 8, 8), step 0.5 -> padded (4, 8, 20), starts (0,), (0,), (0, 4, 8, 12)
    (ceil(12 / 4) + 1 = 4 along x): 4 tiles.
    """
    image = tuple(int(s) for s in image_shape_zyx)
    if len(image) != 3:
        raise ValueError(f"image_shape_zyx must be (Z, Y, X); got {image}")
    patch = tuple(int(p) for p in patch_size)
    fractions = step_fractions(step_fraction, len(patch))
    padded = tuple(max(s, p) for s, p in zip(image, patch_as_zyx(patch), strict=True))
    tiled = tuple(_axis_starts(s, p, f) for s, p, f in zip(padded[-len(patch) :], patch, fractions, strict=True))
    starts = tiled if len(patch) == 3 else (tuple(range(padded[0])), *tiled)  # 2D: every slice
    return TileLayout(image, patch, padded, starts)  # type: ignore[arg-type]


def overlap_step_fractions(
    tile_size: Sequence[int], patch_size: Sequence[int], step_fraction: float = 0.5
) -> tuple[float, ...]:
    """Per-axis step fractions of a ``tile_size`` tile that keep the overlap of consecutive tiles, in voxels, what
    ``step_fraction`` gives the training patch ``patch_size``: ``1 - (1 - step_fraction) * patch / tile``. A tile
    of twice the patch at step 0.5 steps 3/4 of itself (overlap: half a patch); the patch itself steps 0.5."""
    if len(tile_size) != len(patch_size):
        raise ValueError(f"tile {tuple(tile_size)} and patch {tuple(patch_size)} must have as many axes")
    step_fractions(step_fraction, len(patch_size))
    return tuple(1.0 - (1.0 - step_fraction) * p / t for t, p in zip(tile_size, patch_size, strict=True))


def step_fractions(step_fraction: float | Sequence[float], num_axes: int) -> tuple[float, ...]:
    """One step fraction per patch axis, each in (0, 1]."""
    fractions = (
        tuple(float(f) for f in step_fraction)
        if isinstance(step_fraction, Sequence)
        else (float(step_fraction),) * num_axes
    )
    if len(fractions) != num_axes or not all(0 < f <= 1 for f in fractions):
        raise ValueError(
            f"step_fraction must be in (0, 1], one value or one per patch axis ({num_axes}); got {step_fraction}"
        )
    return fractions


def patch_as_zyx(patch_size: Sequence[int]) -> tuple[int, int, int]:
    if len(patch_size) == 2:
        return (1, int(patch_size[0]), int(patch_size[1]))
    if len(patch_size) == 3:
        return tuple(int(p) for p in patch_size)  # type: ignore[return-value]
    raise ValueError(f"patch_size must have 3 values (z, y, x) or 2 values (y, x); got {tuple(patch_size)}")


def accumulator_depth(layout: TileLayout, num_variants: int, tile_batch_size: int) -> int:
    """Padded z-slices the accumulator holds: the widest z-range one tile batch writes, from its first tile's start
    (every slice before it is final and has been handed out) to its last tile's end. Tiles come in C order (z
    slowest), each with its ``num_variants`` mirror variants in a row; batches of ``tile_batch_size``."""
    pz = patch_as_zyx(layout.patch_size)[0]
    per_tile = math.prod(len(s) for s in layout.axis_starts[1:]) * num_variants  # items with one z start
    zs = layout.axis_starts[0]
    num_items = len(zs) * per_tile
    depth = 0
    for first in range(0, num_items, tile_batch_size):
        last = min(first + tile_batch_size, num_items) - 1
        depth = max(depth, zs[last // per_tile] + pz - zs[first // per_tile])
    return min(depth, layout.padded_shape_zyx[0])
