"""Training augmentation: nnU-Net's default transforms on patches read with just the margin they need.

Per sample the sampler (``autoseg.data.sampler.PatchSampler``) draws a rotation and scaling and reads the box it
needs (``autoseg.data.augment_spatial``). ``Augmenter`` turns the batch into training patches:

- ``augment=True``: ``PatchSpatialTransform`` (each sample's transform, cropping to the patch), Gaussian
  noise, blur, brightness, contrast, simulated low resolution, gamma (inverted and plain), mirroring,
  then segmentation ``-1`` (outside the body mask, and outside the image) -> 0.
- ``augment=False``: a centre crop to the patch and ``-1`` -> 0.
- ``use_precomputed=True``: as ``augment=True`` without the spatial step; the patches come from the
  spatially augmented copies ``autoseg.preprocess.precompute`` wrote, read at the patch size.

A cascade stage's one-hot previous-stage channels (the last ``len(config.previous_labels)`` data channels) are
rotated, scaled and mirrored with the image but left out of every intensity transform.

The spatial step is ``autoseg.data.augment_spatial``'s. This module's noise, gamma, low-resolution and
mirroring (and blur) transforms draw their parameters exactly as batchgenerators' do (tests compare them with
batchgenerators' on the same seed; the noise values come from a torch generator) and cost a third of the
time or less; mirroring is applied while the output is written. Brightness and contrast are
batchgenerators'. The worker runs the spatial step per sample as it reads it
(``PatchSampler.sample_patches``), so the batch reaching ``Augmenter`` is already at the patch size.

Randomness: spatial transforms come from the sampler's generator and travel with the batch; the other
transforms draw from NumPy's global state (and, for the noise level, Python's ``random``), which
``Augmenter.__call__`` seeds from its ``seed`` and restores afterwards. So a batch's augmentation is a
function of (batch, seed) alone and replays from its seed.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from batchgenerators.augmentations.utils import uniform
from batchgenerators.transforms.abstract_transforms import AbstractTransform, Compose
from batchgenerators.transforms.color_transforms import BrightnessMultiplicativeTransform, ContrastAugmentationTransform
from scipy import ndimage

from autoseg.data.augment_spatial import PatchSpatialTransform
from autoseg.memory.loader_worker import LOW_RESOLUTION_ZOOM, RESIZE_CACHE_ENTRIES
from autoseg.plan.training_data import LoaderConfig


class SimulateLowResolution(AbstractTransform):
    """batchgenerators' SimulateLowResolutionTransform (per_channel, nearest downsampling, spline
    upsampling with mode 'edge', clipped to the downsampled range), with the same random draws, computed axis
    by axis (``low_resolution``): one matrix product per axis instead of a 3D spline zoom (docs/benchmarks.md,
    "Training data pipeline")."""

    def __init__(
        self,
        zoom_range: tuple[float, float],
        p_per_sample: float,
        p_per_channel: float,
        order_upsample: int = 3,
        ignore_axes: tuple[int, ...] | None = None,
    ) -> None:
        self.zoom_range, self.p_per_sample, self.p_per_channel = zoom_range, p_per_sample, p_per_channel
        self.order_upsample, self.ignore_axes = order_upsample, ignore_axes or ()

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data = batch["data"]
        for b in range(data.shape[0]):
            if np.random.uniform() < self.p_per_sample:
                for c in range(data.shape[1]):
                    if np.random.uniform() < self.p_per_channel:
                        shape = np.array(data.shape[2:])
                        target = np.round(shape * uniform(*self.zoom_range)).astype(int)
                        target[list(self.ignore_axes)] = shape[list(self.ignore_axes)]
                        data[b, c] = low_resolution(data[b, c], tuple(target), self.order_upsample)
        return batch


def low_resolution(channel: np.ndarray, target_shape: tuple[int, ...], order: int = 3) -> np.ndarray:
    """``channel`` (Z, Y, X) or (Y, X) float32 resampled to ``target_shape`` by nearest neighbour and back by
    a spline of ``order``, clipped to the downsampled range: skimage's ``resize`` (mode 'edge') twice, as
    batchgenerators does, but separable: one (out, in) matrix product per axis (float32)."""
    small = channel
    for axis, (n, m) in enumerate(zip(channel.shape, target_shape, strict=True)):
        if m != n:
            small = np.take(small, _nearest_indices(n, m), axis=axis)
    out = small
    for axis, (m, n) in enumerate(zip(small.shape, channel.shape, strict=True)):
        if m != n:
            out = np.moveaxis(_resize_matrix(m, n, order) @ np.moveaxis(out, axis, -2), -2, axis)
    return np.clip(out, small.min(), small.max())


@lru_cache(maxsize=RESIZE_CACHE_ENTRIES)
def _nearest_indices(n_in: int, n_out: int) -> np.ndarray:
    """Source index of each of ``n_out`` samples (``ndimage.zoom`` order 0, grid mode, as skimage)."""
    ramp = np.arange(n_in, dtype=np.float64)
    return ndimage.zoom(ramp, n_out / n_in, order=0, mode="nearest", grid_mode=True).astype(np.intp)


@lru_cache(maxsize=RESIZE_CACHE_ENTRIES)
def _resize_matrix(n_in: int, n_out: int, order: int) -> np.ndarray:
    """(n_out, n_in) float32: ``ndimage.zoom`` of length n_in to n_out (spline ``order``, 'nearest' edges,
    grid mode, as skimage's resize), column k being the zoom of the k-th unit vector."""
    matrix = ndimage.zoom(np.eye(n_in), (n_out / n_in, 1.0), order=order, mode="nearest", grid_mode=True)
    if matrix.shape != (n_out, n_in):
        raise AssertionError(f"zoom gave {matrix.shape}, expected {(n_out, n_in)}")
    return matrix.astype(np.float32)


class GaussianNoise(AbstractTransform):
    """batchgenerators' GaussianNoiseTransform: with ``p_per_sample``, noise of a standard deviation drawn
    uniformly from ``std_range`` (with Python's ``random``, as it does). The noise is float32 from a torch
    generator seeded off NumPy's global state (replayable), cheaper than float64 ``np.random.normal``
    (docs/benchmarks.md, "Training data pipeline")."""

    def __init__(self, std_range: tuple[float, float], p_per_sample: float) -> None:
        self.std_range, self.p_per_sample = std_range, p_per_sample

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data = batch["data"]
        for b in range(len(data)):
            if np.random.uniform() < self.p_per_sample:
                std = random.uniform(*self.std_range)
                generator = torch.Generator().manual_seed(int(np.random.randint(2**31)))
                torch.from_numpy(data[b]).add_(torch.randn(data.shape[1:], generator=generator), alpha=std)
        return batch


class GaussianBlur(AbstractTransform):
    """batchgenerators' GaussianBlurTransform with a sigma per channel (the same draws: NumPy for the sample
    and channel, Python's ``random`` for sigma), as scipy's ``gaussian_filter`` (truncate 4, 'reflect'):
    the first axis as a weighted sum of shifted contiguous slices instead of a strided 1D correlation (contiguous
    reads are the cheaper pass over memory)."""

    def __init__(self, sigma_range: tuple[float, float], p_per_sample: float, p_per_channel: float) -> None:
        self.sigma_range, self.p_per_sample, self.p_per_channel = sigma_range, p_per_sample, p_per_channel

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data = batch["data"]
        for b in range(len(data)):
            if np.random.uniform() < self.p_per_sample:
                for c in range(data.shape[1]):
                    if np.random.uniform() <= self.p_per_channel:
                        data[b, c] = gaussian_blur(data[b, c], random.uniform(*self.sigma_range))
        return batch


def gaussian_blur(channel: np.ndarray, sigma: float) -> np.ndarray:
    """``scipy.ndimage.gaussian_filter(channel, sigma)`` for a float32 (Z, Y, X) or (Y, X) channel."""
    radius = int(4.0 * sigma + 0.5)
    offsets = np.arange(-radius, radius + 1)
    kernel = np.exp(-0.5 * (offsets / sigma) ** 2)
    kernel /= kernel.sum()
    n = channel.shape[0]
    if n > radius:  # 'reflect' pads (d c b a | a b c d | d c b a) along the first axis
        padded = (
            np.concatenate([channel[radius - 1 :: -1], channel, channel[: n - radius - 1 : -1]]) if radius else channel
        )
        out = padded[radius : radius + n] * np.float32(kernel[radius])
        pair = np.empty_like(out)
        for j in range(1, radius + 1):
            np.add(padded[radius - j : radius - j + n], padded[radius + j : radius + j + n], out=pair)
            pair *= np.float32(kernel[radius + j])
            out += pair
    else:
        out = ndimage.correlate1d(channel, kernel, axis=0, mode="reflect")
    for axis in range(1, channel.ndim):
        out = ndimage.correlate1d(out, kernel, axis=axis, mode="reflect")
    return out


class Gamma(AbstractTransform):
    """batchgenerators' GammaTransform (per channel, retaining mean and standard deviation; the same draws),
    in place in float32: (x - min) / range to the power gamma, back to the range; inverted first and last
    with ``invert_image``. A third of its time, without its ten temporary arrays."""

    def __init__(self, gamma_range: tuple[float, float], invert_image: bool, p_per_sample: float) -> None:
        self.gamma_range, self.invert_image, self.p_per_sample = gamma_range, invert_image, p_per_sample

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data, (low, high) = batch["data"], self.gamma_range
        for b in range(len(data)):
            if np.random.uniform() < self.p_per_sample:
                for x in data[b]:  # (*P) views, one channel at a time
                    if np.random.random() < 0.5 and low < 1:
                        gamma = np.random.uniform(low, 1)
                    else:
                        gamma = np.random.uniform(max(low, 1), high)
                    _gamma_in_place(x, gamma, self.invert_image)
        return batch


def _gamma_in_place(x: np.ndarray, gamma: float, invert: bool) -> None:
    """batchgenerators' ``augment_gamma`` (retain_stats) on a float32 channel, in place. x ** gamma as
    exp(gamma * log(x)) with torch's log and exp (faster than numpy's, and than ``np.power``), and the final
    standard deviation as a dot product of the centred values (faster than ``std``)."""
    t = torch.from_numpy(x)
    if invert:
        t.neg_()
    mean, std = x.mean(), x.std()
    low, span = x.min(), float(x.max() - x.min()) + 1e-7
    t.sub_(low).div_(span).log_().mul_(gamma).exp_()  # log(0) = -inf and exp(-inf) = 0 = 0 ** gamma
    t.mul_(span).add_(low)
    t.sub_(x.mean())
    flat = x.reshape(-1)
    centred_std = math.sqrt(float(np.dot(flat, flat)) / max(flat.size, 1))
    t.mul_(std / (centred_std + 1e-8)).add_(mean)
    if invert:
        t.neg_()


class Mirror(AbstractTransform):
    """batchgenerators' MirrorTransform (each axis flipped with p = 0.5; the same draws), all of a sample's
    flips in one copy instead of one per axis. ``Augmenter`` draws the flips (``draw``) and flips while it
    writes its output, without this extra copy."""

    def __init__(self, axes: tuple[int, ...]) -> None:
        self.axes = axes

    def draw(self, batch_size: int, spatial_dims: int) -> list[tuple[slice, ...]]:
        """Per sample the index that flips it: a slice per spatial axis, reversed for a flipped axis."""
        out = []
        for _ in range(batch_size):
            np.random.uniform()  # MirrorTransform's per-sample draw (p_per_sample = 1)
            flips = [a for a in range(min(spatial_dims, 3)) if a in self.axes and np.random.uniform() < 0.5]
            out.append(tuple(slice(None, None, -1) if a in flips else slice(None) for a in range(spatial_dims)))
        return out

    def __call__(self, **batch: Any) -> dict[str, Any]:
        data, seg = batch["data"], batch["seg"]
        for b, index in enumerate(self.draw(len(data), data.ndim - 2)):
            if any(i.step == -1 for i in index):
                data[b], seg[b] = data[b][(slice(None), *index)], seg[b][(slice(None), *index)]
        return batch


def build_train_transforms(config: LoaderConfig) -> tuple[Compose, Compose]:
    """nnU-Net's default training transforms for ``config`` (probabilities and ranges from the config), as the
    spatial step and the intensity transforms, except mirroring, which ``Augmenter`` applies last, as nnU-Net does,
    while writing its output.

    ``config.use_precomputed``: no spatial step (patches come from precomputed augmented copies, read
    at the patch size); mirroring and the intensity transforms stay."""
    ignore_axes = (0,) if config.dummy_2d else None
    spatial: list[AbstractTransform] = [] if config.use_precomputed else [PatchSpatialTransform(config)]
    transforms: list[AbstractTransform] = [
        GaussianNoise((0.0, 0.1), p_per_sample=config.p_noise),
        GaussianBlur((0.5, 1.0), p_per_sample=config.p_blur, p_per_channel=0.5),
        BrightnessMultiplicativeTransform(multiplier_range=(0.75, 1.25), p_per_sample=config.p_brightness),
        ContrastAugmentationTransform(p_per_sample=config.p_contrast),
        SimulateLowResolution(
            LOW_RESOLUTION_ZOOM,
            p_per_sample=config.p_low_res,
            p_per_channel=0.5,
            order_upsample=3,
            ignore_axes=ignore_axes,
        ),
        Gamma((0.7, 1.5), invert_image=True, p_per_sample=config.p_gamma_inverted),
        Gamma((0.7, 1.5), invert_image=False, p_per_sample=config.p_gamma),
    ]
    return Compose(spatial), Compose(transforms)


class Augmenter:
    """Turns a sampled batch into a training batch of ``config.patch_size``.

    Input: ``data`` float32 (B, C, *E), ``seg`` int8/int16 (B, 1, *E), E = the batch's read box, and
    ``transforms`` (one ``PatchTransform`` or None per sample). Output: ``data`` float32 (B, C, *patch) and
    ``target`` (B, 1, *patch) in the seg's dtype with -1 mapped to 0 (the loss casts it to int64 on the
    device: an int64 target here would move 8 bytes a voxel out of the worker instead of 1), written into
    ``out`` when given (e.g. a worker's shared-memory slot), mirrored on
    the way. The input arrays may be modified or released.
    """

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.transforms = build_train_transforms(config) if config.augment else None
        self.previous_channels = len(config.previous_labels)
        axes = config.mirror_axes_effective if config.augment else ()
        self.mirror = Mirror(axes) if axes else None

    def __call__(
        self, batch: dict[str, Any], seed: int, out: dict[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Augment ``batch``; the result depends only on (batch, seed), so a batch replays from its seed."""
        if self.transforms is None:
            data, seg = center_crop(batch["data"], batch["seg"], self.config.patch_size)
            return _write_output(data, seg, [()] * len(data), out)
        numpy_state, python_state = np.random.get_state(), random.getstate()
        np.random.seed(int(seed) % 2**32)
        random.seed(int(seed))  # GaussianNoiseTransform draws its variance from Python's random
        try:
            spatial, intensity = self.transforms
            done = spatial(data=batch.pop("data"), seg=batch.pop("seg"), transforms=batch.get("transforms"))
            data, seg = done["data"], done["seg"]
            image = data[:, : data.shape[1] - self.previous_channels]  # a view: the image channels only
            changed = intensity(data=image, seg=seg)["data"]
            if changed is not image:
                image[...] = changed
            flips = self.mirror.draw(len(data), data.ndim - 2) if self.mirror else [()] * len(data)
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)
        return _write_output(data, seg, flips, out)


def _write_output(
    data: np.ndarray, seg: np.ndarray, flips: list[tuple[slice, ...]], out: dict[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """``data`` as float32 and ``seg`` with -1 -> 0, each sample flipped by its index, into ``out`` (new
    arrays if None): one pass over each."""
    if out is None:
        out = {"data": np.empty(data.shape, np.float32), "target": np.empty(seg.shape, seg.dtype)}
    if out["data"].shape != data.shape or out["target"].shape != seg.shape:
        raise ValueError(
            f"output buffers {out['data'].shape} / {out['target'].shape} do not fit the batch "
            f"{data.shape} / {seg.shape}"
        )
    for b, index in enumerate(flips):
        np.copyto(out["data"][b], data[b][(slice(None), *index)], casting="same_kind")
        np.maximum(seg[b][(slice(None), *index)], 0, out=out["target"][b])
    return out


def center_crop(data: np.ndarray, seg: np.ndarray, patch_size: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Views of (B, C, *E) / (B, 1, *E) cropped to ``patch_size`` at the centre."""
    starts = [(e - p) // 2 for e, p in zip(data.shape[2:], patch_size, strict=True)]
    if any(s < 0 for s in starts):
        raise ValueError(f"cannot crop {data.shape[2:]} to the larger patch {tuple(patch_size)}")
    window = (slice(None), slice(None), *(slice(s, s + p) for s, p in zip(starts, patch_size, strict=True)))
    return data[window], seg[window]
