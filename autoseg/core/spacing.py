"""Anisotropy of a voxel spacing: one threshold for the planner's target spacing, resampling's in-plane
path and its memory estimate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ANISOTROPY_THRESHOLD = 3.0  # an axis whose spacing is > 3x the finest is "strongly anisotropic"
# Voxels of edge padding per side under the spline of resampling's "skimage" style (what scipy's zoom pads by in
# mode "nearest"); the padded image is that style's spline temporary, which resampling's memory estimate counts.
SKIMAGE_SPLINE_PAD = 12


def is_anisotropic(spacing_mm: Sequence[float], threshold: float = ANISOTROPY_THRESHOLD) -> bool:
    """True when the largest spacing exceeds ``threshold`` times the smallest one."""
    return max(spacing_mm) / min(spacing_mm) > threshold


def out_of_plane_axis(spacing_mm: Sequence[float], threshold: float = ANISOTROPY_THRESHOLD) -> int | None:
    """The axis (0=z, 1=y, 2=x) with the largest spacing when ``spacing_mm`` is anisotropic, else None.

    Also None when two axes share the largest spacing (e.g. ``(5, 5, 1)``): there is no single
    out-of-plane axis, and such data is resampled in 3D.
    """
    if not is_anisotropic(spacing_mm, threshold):
        return None
    largest = max(spacing_mm)
    axes = [a for a, s in enumerate(spacing_mm) if np.isclose(s, largest)]
    return axes[0] if len(axes) == 1 else None


def compute_new_shape(
    shape_zyx: Sequence[int], spacing_mm: Sequence[float], new_spacing_mm: Sequence[float]
) -> tuple[int, int, int]:
    """``round(shape * spacing / new_spacing)`` per axis, at least 1."""
    if not (len(shape_zyx) == len(spacing_mm) == len(new_spacing_mm) == 3):
        raise ValueError(
            f"shape {tuple(shape_zyx)}, spacing {tuple(spacing_mm)} and new spacing {tuple(new_spacing_mm)} "
            "must each have 3 entries (z, y, x)"
        )
    if min(spacing_mm) <= 0 or min(new_spacing_mm) <= 0:
        raise ValueError(f"spacings must be positive; got {tuple(spacing_mm)} -> {tuple(new_spacing_mm)}")
    axes = zip(shape_zyx, spacing_mm, new_spacing_mm, strict=True)
    return tuple(max(1, int(round(n * s / t))) for n, s, t in axes)  # type: ignore[return-value]


# A case more than this many times finer or coarser than the spacing it is compared with (the dataset's median, or
# the plan's target at prediction) on one axis is a header in other units (m, um) or an unset spacing, not a scan
# of the same kind: resampled, it would hold that many times the voxels along the axis (a 1e6 mm header asked a
# tiny case for ~10^8 voxels per row and was killed for memory) or collapse to one voxel.
SPACING_RATIO_LIMIT = 100.0


def spacing_ratio_problem(
    spacing_mm: Sequence[float], reference_mm: Sequence[float | None], reference: str
) -> str | None:
    """Why ``spacing_mm`` (z, y, x) is too far from ``reference_mm`` (an axis None: not compared), named
    ``reference`` in the text, e.g. "the dataset's median"; None when every axis is within SPACING_RATIO_LIMIT."""
    names = "zyx"
    for axis, (s, r) in enumerate(zip(spacing_mm, reference_mm)):
        if r is not None and not (1 / SPACING_RATIO_LIMIT <= s / r <= SPACING_RATIO_LIMIT):
            return (
                f"spacing {s:.4g} mm along {names[axis]} is {s / r:.3g}x {reference} ({r:.4g} mm); more than "
                f"{SPACING_RATIO_LIMIT:.0f}x off is a header in other units or an unset spacing: fix the file's spacing"
            )
    return None
