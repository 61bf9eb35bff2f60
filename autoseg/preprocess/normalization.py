"""Intensity normalization of one channel, by scheme name (a small registry).

Every scheme takes a float32 ``(Z, Y, X)`` image and returns float32 ``(Z, Y, X)``. A writable float32
input is normalized in place and returned (other inputs are converted once to a float32 copy). Statistics
are accumulated in float64 one slice at a time, so no float64 copy of a volume is ever made; only
"rescale" holds one float32 copy of the voxels while finding its percentiles.

Schemes:

- ``"ct"``: clip to the dataset's foreground ``[p0.5, p99.5]``, then ``(x - mean) / std`` with the
  dataset's foreground statistics (``IntensityProperties`` from the fingerprint). Ignores ``mask``.
- ``"zscore"``: ``(x - mean) / std`` with this image's statistics; with a ``mask``, the statistics come
  from the voxels inside it and the voxels outside it are set to 0.
- ``"rescale"``: clip to this image's own 0.5 / 99.5 percentiles and map that range to ``[0, 1]``.
  Ignores ``mask``.
- ``"none"``: cast to float32 only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autoseg.core.errors import InputError
from autoseg.plan.plans import IntensityProperties

EPS = 1e-8

Normalizer = Callable[[np.ndarray, np.ndarray | None, IntensityProperties | None], np.ndarray]


def _as_float32(image: np.ndarray) -> np.ndarray:
    """The image itself if it is a writable float32 array, else a float32 copy (one, not float64)."""
    if image.dtype == np.float32 and image.flags.writeable:
        return image
    return image.astype(np.float32)


def _mean_std(image: np.ndarray, mask: np.ndarray | None) -> tuple[float, float]:
    """Mean and (population) std of ``image`` (inside ``mask`` if given), two passes, slice by slice.

    float64 accumulators, float64 temporaries of at most one slice.
    """
    count, total = 0, 0.0
    for k in range(image.shape[0]):
        values = image[k] if mask is None else image[k][mask[k]]
        count += values.size
        total += float(np.sum(values, dtype=np.float64))
    if count == 0:
        return 0.0, 0.0
    mean = total / count
    squares = 0.0
    for k in range(image.shape[0]):
        values = image[k] if mask is None else image[k][mask[k]]
        squares += float(np.sum(np.square(values.astype(np.float64) - mean)))
    return mean, float(np.sqrt(squares / count))


def _ct(image: np.ndarray, mask: np.ndarray | None, props: IntensityProperties | None) -> np.ndarray:
    if props is None:
        raise InputError(
            "CT normalization needs the dataset's foreground intensity properties (mean, std, percentiles); "
            "got props=None. Pass plans.intensity_properties[channel]."
        )
    image = _as_float32(image)
    np.clip(image, float(props.percentile_00_5), float(props.percentile_99_5), out=image)
    image -= float(props.mean)
    image /= max(float(props.std), EPS)
    return image


def _zscore(image: np.ndarray, mask: np.ndarray | None, props: IntensityProperties | None) -> np.ndarray:
    image = _as_float32(image)
    mean, std = _mean_std(image, mask)
    image -= mean
    image /= max(std, EPS)
    if mask is not None:
        for k in range(image.shape[0]):  # one bool slice at a time instead of a volume-sized ~mask
            image[k][~mask[k]] = 0.0
    return image


def _rescale(image: np.ndarray, mask: np.ndarray | None, props: IntensityProperties | None) -> np.ndarray:
    image = _as_float32(image)
    low, high = (float(v) for v in np.percentile(image, (0.5, 99.5)))  # one float32 copy, partitioned
    np.clip(image, low, high, out=image)
    image -= low
    image /= max(high - low, EPS)
    return image


def _none(image: np.ndarray, mask: np.ndarray | None, props: IntensityProperties | None) -> np.ndarray:
    return image.astype(np.float32, copy=False)


NORMALIZERS: dict[str, Normalizer] = {
    "ct": _ct,
    "zscore": _zscore,
    "rescale": _rescale,
    "none": _none,
}


def normalize(
    image: np.ndarray,
    scheme: str,
    mask: np.ndarray | None = None,
    props: IntensityProperties | None = None,
) -> np.ndarray:
    """Normalize one channel ``image`` float32 ``(Z, Y, X)`` with ``scheme``; returns float32 ``(Z, Y, X)``.

    ``mask`` (bool ``(Z, Y, X)``) is used by "zscore" only; ``props`` is required by "ct". A writable
    float32 ``image`` is modified in place and returned.
    """
    if scheme not in NORMALIZERS:
        raise InputError(f"unknown normalization scheme {scheme!r}; known schemes: {sorted(NORMALIZERS)}")
    if image.ndim != 3:
        raise ValueError(f"normalize expects one channel (Z, Y, X); got an array of shape {image.shape}")
    if mask is not None and (mask.shape != image.shape or mask.dtype != bool):
        raise ValueError(f"mask must be bool with the image's shape {image.shape}; got {mask.dtype} {mask.shape}")
    return NORMALIZERS[scheme](image, mask, props)
