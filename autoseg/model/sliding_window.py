"""Sliding-window prediction of one preprocessed image: Gaussian-weighted tiles, mirror TTA, softmax (classes)
or sigmoid (regions).

The core holds no file IO: it takes a normalized, resampled ``(C, Z, Y, X)`` float32 array and returns
``(num_outputs, Z, Y, X)`` float32 probabilities on the CPU (``num_outputs``: the network's outputs).
Reading, preprocessing and exporting live in ``autoseg.predict.predictor``.

A 3D network sees ``(B, C, pz, py, px)`` tiles. A 2D network (``patch_size`` of 2 values) sees
``(B, C, py, px)`` tiles cut from single slices; tiles from different slices share a batch.

``tile_layout`` owns the padding and the tiles (``autoseg.memory.inference`` counts them with it), and
``predict_tile_batch`` the mirrored prediction of one tile batch (the memory model simulates it).

Device memory held for the whole call (see ``inference_buffer_bytes``): the padded input, the logit
accumulator, the weight map, the Gaussian, and one tile batch with its fp32 logit sum. Network
activations are not counted here (``autoseg.memory`` models them).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from autoseg.core.errors import InputError
from autoseg.core.precision import PRECISIONS

ACTIVATIONS = ("softmax", "sigmoid")  # LabelScheme.probabilities: softmax over classes, sigmoid per region
_FP32_BYTES = 4

# One tile's region in the padded (Z, Y, X) volume: 3 slices (3D), or (z index, y slice, x slice) (2D).
Region = tuple[int | slice, ...]


def gaussian_importance_map(
    patch_size: tuple[int, ...],
    sigma_scale: float = 1.0 / 8,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Gaussian weights ``(*patch_size)`` centred in the patch, sigma = ``patch_size * sigma_scale``.

    Normalized to a maximum of 1; voxels that underflow to 0 in ``dtype`` get the smallest nonzero value so
    the weight map never divides by zero. Cached per (patch, sigma, dtype, device): treat it as read-only.
    """
    patch = tuple(int(p) for p in patch_size)
    return _gaussian_cached(patch, float(sigma_scale), dtype, torch.device(device))


def clear_gaussian_cache() -> None:
    """Forget the cached Gaussians (a memory measurement that must see the Gaussian being created)."""
    _gaussian_cached.cache_clear()


@functools.lru_cache(maxsize=16)
def _gaussian_cached(
    patch: tuple[int, ...], sigma_scale: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    gauss = np.ones((), dtype=np.float64)
    for size in patch:
        offset = np.arange(size, dtype=np.float64) - (size - 1) / 2.0  # symmetric: flip(g) == g
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
    num_steps = math.ceil((size - patch) / (patch * step_fraction)) + 1
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
    def image_region(self) -> tuple[slice, slice, slice]:
        """Slices of the unpadded image inside the padded ``(Zp, Yp, Xp)`` volume."""
        return tuple(slice((p - s) // 2, (p - s) // 2 + s)  # type: ignore[return-value]
                     for s, p in zip(self.image_shape_zyx, self.padded_shape_zyx, strict=True))

    def regions(self) -> list[Region]:
        """Every tile's region in the padded volume: 3 slices (3D), or (z index, y slice, x slice) (2D)."""
        if len(self.patch_size) == 3:
            return [tuple(slice(s, s + p) for s, p in zip(start, self.patch_size, strict=True))
                    for start in itertools.product(*self.axis_starts)]
        py, px = self.patch_size
        return [(z, slice(y, y + py), slice(x, x + px)) for z, y, x in itertools.product(*self.axis_starts)]


def tile_layout(image_shape_zyx: Sequence[int], patch_size: Sequence[int], step_fraction: float = 0.5) -> TileLayout:
    """The padding and tiles of ``sliding_window_predict`` for an image of ``image_shape_zyx`` (Z, Y, X);
    ``patch_size`` (z, y, x) for a 3D network or (y, x) for a 2D network (each slice tiled over (Y, X)).

    Example: image (3, 5, 20), patch (4, 8, 8), step 0.5 -> padded (4, 8, 20), starts (0,), (0,), (0, 4, 8, 12)
    (ceil(12 / 4) + 1 = 4 along x): 4 tiles.
    """
    image = tuple(int(s) for s in image_shape_zyx)
    if len(image) != 3:
        raise ValueError(f"image_shape_zyx must be (Z, Y, X); got {image}")
    patch = tuple(int(p) for p in patch_size)
    _check_step_fraction(step_fraction)
    padded = tuple(max(s, p) for s, p in zip(image, _patch_as_zyx(patch), strict=True))
    tiled = tuple(_axis_starts(s, p, step_fraction) for s, p in zip(padded[-len(patch):], patch, strict=True))
    starts = tiled if len(patch) == 3 else (tuple(range(padded[0])), *tiled)  # 2D: every slice
    return TileLayout(image, patch, padded, starts)  # type: ignore[arg-type]


def _check_step_fraction(step_fraction: float) -> None:
    if not 0 < step_fraction <= 1:
        raise ValueError(f"step_fraction must be in (0, 1]; got {step_fraction}")


def _patch_as_zyx(patch_size: Sequence[int]) -> tuple[int, int, int]:
    if len(patch_size) == 2:
        return (1, int(patch_size[0]), int(patch_size[1]))
    if len(patch_size) == 3:
        return tuple(int(p) for p in patch_size)  # type: ignore[return-value]
    raise ValueError(f"patch_size must have 3 values (z, y, x) or 2 values (y, x); got {tuple(patch_size)}")


def inference_buffer_bytes(
    image_shape_zyx: Sequence[int],
    patch_size: Sequence[int],
    num_outputs: int,
    tile_batch_size: int,
    in_channels: int,
) -> dict[str, int]:
    """Device bytes held by ``sliding_window_predict``'s buffers (all fp32), network activations excluded.

    Keys: ``padded_input`` (C x Zp x Yp x Xp), ``accumulator`` (K x Zp x Yp x Xp), ``weight_map``
    (Zp x Yp x Xp), ``gaussian`` (patch), ``tile_batch`` (B x C x patch), ``tile_logits`` (B x K x patch),
    and ``total``. ``Zp, Yp, Xp`` is the image padded to at least the patch. Not counted: transient copies
    that live for one network call (a flipped tile batch, the network's output and its flip back) and the
    softmax's (Zp x Yp x Xp) max/sum temporaries, which appear after the input is freed.
    """
    padded_voxels = math.prod(tile_layout(image_shape_zyx, patch_size).padded_shape_zyx)
    patch_voxels = math.prod(patch_size)
    sizes = {
        "padded_input": in_channels * padded_voxels * _FP32_BYTES,
        "accumulator": num_outputs * padded_voxels * _FP32_BYTES,
        "weight_map": padded_voxels * _FP32_BYTES,
        "gaussian": patch_voxels * _FP32_BYTES,
        "tile_batch": tile_batch_size * in_channels * patch_voxels * _FP32_BYTES,
        "tile_logits": tile_batch_size * num_outputs * patch_voxels * _FP32_BYTES,
    }
    sizes["total"] = sum(sizes.values())
    return sizes


@dataclass(frozen=True)
class _Buffers:
    padded_input: torch.Tensor  # (C, Zp, Yp, Xp) fp32
    accumulator: torch.Tensor  # (K, Zp, Yp, Xp) fp32, sum of Gaussian-weighted logits
    weight_map: torch.Tensor  # (Zp, Yp, Xp) fp32, sum of Gaussian weights
    gaussian: torch.Tensor  # (*patch) fp32, cached and shared


def _allocate_buffers(
    data: torch.Tensor,
    layout: TileLayout,
    num_outputs: int,
    use_gaussian: bool,
    device: torch.device,
) -> _Buffers:
    """Allocate the device buffers; ``data`` (C, Z, Y, X) is copied into the centre of the padded input."""
    padded_zyx, patch_size = layout.padded_shape_zyx, layout.patch_size
    # C x Zp x Yp x Xp fp32, allocated on the device and filled there: one host -> device copy of the image.
    # Not acvl_utils' pad_nd_image: it is torch's F.pad, the same zero-fill + copy (CPU, measured: 1x96x320x320
    # to a 128^3 patch 26.3 vs 27.0 ms, 1x60x400x480 to 512^2 31.4 vs 29.8 ms, 50 / 60 MiB live either way), it
    # re-derives the placement that tile_layout owns, and where nothing needs padding it hands back the input
    # itself: on CPU the padded input would then be the caller's array, not the buffer inference_buffer_bytes
    # counts (tests/memory/test_memory.py's 3 estimate-vs-measurement cases fail by exactly that buffer).
    padded_input = torch.zeros((data.shape[0], *padded_zyx), dtype=torch.float32, device=device)
    padded_input[(slice(None), *layout.image_region)].copy_(data)  # constant-0 padding, symmetric
    # K x Zp x Yp x Xp fp32: the largest buffer (K times the weight map)
    accumulator = torch.zeros((num_outputs, *padded_zyx), dtype=torch.float32, device=device)
    weight_map = torch.zeros(padded_zyx, dtype=torch.float32, device=device)  # Zp x Yp x Xp fp32
    if use_gaussian:
        gaussian = gaussian_importance_map(patch_size, dtype=torch.float32, device=device)
    else:
        gaussian = torch.ones(patch_size, dtype=torch.float32, device=device)
    return _Buffers(padded_input, accumulator, weight_map, gaussian)


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[precision]
    if dtype is None or (dtype == torch.float16 and device.type == "cpu"):
        return contextlib.nullcontext()  # fp16 autocast is not meaningful on CPU: run fp32
    return torch.autocast(device_type=device.type, dtype=dtype)


def predict_tile_batch(
    network: nn.Module,
    tile_batch: torch.Tensor,
    num_outputs: int,
    mirror_axes: tuple[int, ...],
    precision: str,
) -> torch.Tensor:
    """Mean logits over all mirrorings of ``tile_batch`` (B, C, *patch); returns (B, K, *patch) fp32.

    ``mirror_axes`` index the patch's spatial axes (every subset is flipped, predicted and flipped back);
    ``precision`` is a key of ``PRECISIONS`` (autocast). Held at the peak: the tile batch, its flip, the
    network's activations and output, and the (B, K, *patch) fp32 sum.
    """
    expected = (tile_batch.shape[0], num_outputs, *tile_batch.shape[2:])
    logits = torch.zeros(expected, dtype=torch.float32, device=tile_batch.device)  # B x K x patch fp32
    flips = [s for r in range(len(mirror_axes) + 1) for s in itertools.combinations(mirror_axes, r)]
    for axes in flips:
        dims = [a + 2 for a in axes]  # spatial axis -> tensor dim after (B, C)
        with torch.inference_mode(), _autocast(precision, tile_batch.device):
            out = network(torch.flip(tile_batch, dims) if dims else tile_batch)
            if isinstance(out, (list, tuple)):  # deep supervision: full resolution first
                out = out[0]
            if tuple(out.shape) != expected:
                raise ValueError(f"network returned logits of shape {tuple(out.shape)} for a tile batch of "
                                 f"shape {tuple(tile_batch.shape)}; expected {expected}. Check num_outputs "
                                 "and that the patch size is divisible by the network's strides")
            logits += torch.flip(out, dims) if dims else out  # promotes bf16/fp16 to fp32
    logits /= len(flips)
    return logits


def sliding_window_predict(
    network: nn.Module,
    data: np.ndarray | torch.Tensor,
    patch_size: Sequence[int],
    num_outputs: int,
    *,
    step_fraction: float = 0.5,
    mirror_axes: Sequence[int] = (),
    tile_batch_size: int = 1,
    device: str | torch.device = "cpu",
    use_gaussian: bool = True,
    precision: str = "fp32",
    progress: bool = False,
    activation: str = "softmax",
) -> torch.Tensor:
    """Predict probabilities ``(num_outputs, Z, Y, X)`` float32 (CPU) for one image: ``activation``
    "softmax" over the channels (classes) or "sigmoid" per channel (regions) of the averaged logits.

    ``data``: ``(C, Z, Y, X)`` float32, normalized and resampled. ``patch_size``: (z, y, x) for a 3D
    network or (y, x) for a 2D network (then each slice is tiled; tiles of several slices share a batch).
    The network must already sit on ``device``; it is run in eval mode (its mode is restored afterwards).
    ``mirror_axes`` index the patch's spatial axes: every subset is flipped, predicted and flipped back,
    and the logits averaged (``2 ** len(mirror_axes)`` passes). ``precision``: "fp32", "bf16" or "fp16"
    (autocast; fp16 on CPU runs fp32). Accumulation is always fp32.
    """
    patch = tuple(int(p) for p in patch_size)
    mirror = tuple(int(a) for a in mirror_axes)
    device = torch.device(device)
    data_t = _as_float_tensor(data)
    _check_args(data_t, patch, num_outputs, step_fraction, mirror, tile_batch_size, precision)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")

    was_training = network.training
    network.eval()
    try:
        with torch.no_grad():
            layout = tile_layout(data_t.shape[1:], patch, step_fraction)
            buffers = _allocate_buffers(data_t, layout, num_outputs, use_gaussian, device)
            del data_t
            accumulator = _accumulate(network, buffers, layout, num_outputs, mirror, tile_batch_size,
                                      precision, progress)
            del buffers  # frees the padded input (C x Zp x Yp x Xp) before the softmax temporaries
            if activation == "sigmoid":
                accumulator.sigmoid_()  # in place, per region: no temporaries
            else:  # in-place softmax over classes: temporaries are one Zp x Yp x Xp fp32 map each
                accumulator -= accumulator.amax(dim=0, keepdim=True)
                accumulator.exp_()
                accumulator /= accumulator.sum(dim=0, keepdim=True)
            probabilities = accumulator[(slice(None), *layout.image_region)].cpu()  # device -> host sync
            return probabilities.contiguous()  # copies only when padding was cropped off
    finally:
        network.train(was_training)


def _accumulate(
    network: nn.Module,
    buffers: _Buffers,
    layout: TileLayout,
    num_outputs: int,
    mirror_axes: tuple[int, ...],
    tile_batch_size: int,
    precision: str,
    progress: bool,
) -> torch.Tensor:
    """Run all tile batches, add Gaussian-weighted logits; return accumulator / weight_map (K, Zp, Yp, Xp)."""
    accumulator, weight_map, gaussian = buffers.accumulator, buffers.weight_map, buffers.gaussian
    regions = layout.regions()
    with tqdm(total=len(regions), disable=not progress, desc="sliding window", unit="tile") as bar:
        for first in range(0, len(regions), tile_batch_size):
            batch_regions = regions[first:first + tile_batch_size]
            # B x C x patch fp32: a copy of the tiles, contiguous for the network
            tile_batch = torch.stack([buffers.padded_input[(slice(None), *r)] for r in batch_regions])
            logits = predict_tile_batch(network, tile_batch, num_outputs, mirror_axes, precision)
            for tile_logits, region in zip(logits, batch_regions, strict=True):
                accumulator[(slice(None), *region)].addcmul_(tile_logits, gaussian)
                weight_map[region] += gaussian
            bar.update(len(batch_regions))
    accumulator /= weight_map  # weights >= the Gaussian's smallest value > 0 everywhere: all voxels covered
    return accumulator


def _as_float_tensor(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.detach().to(torch.float32)
    array = np.asarray(data, dtype=np.float32)
    with warnings.catch_warnings():  # read-only memmaps: the tensor is only read (copied into the padding)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _check_args(
    data: torch.Tensor,
    patch: tuple[int, ...],
    num_outputs: int,
    step_fraction: float,
    mirror_axes: tuple[int, ...],
    tile_batch_size: int,
    precision: str,
) -> None:
    if data.ndim != 4:
        raise ValueError(f"data must be (C, Z, Y, X); got shape {tuple(data.shape)}. "
                         "Lift 2D images to Z = 1 and add a channel axis")
    _patch_as_zyx(patch)  # validates the number of patch axes
    if any(p < 1 for p in patch):
        raise ValueError(f"patch_size must be positive; got {patch}")
    if num_outputs < 1:
        raise ValueError(f"num_outputs must be >= 1; got {num_outputs}")
    _check_step_fraction(step_fraction)
    if tile_batch_size < 1:
        raise InputError(f"tile_batch_size must be >= 1; got {tile_batch_size}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}")
    if len(set(mirror_axes)) != len(mirror_axes) or any(not 0 <= a < len(patch) for a in mirror_axes):
        raise ValueError(f"mirror_axes {mirror_axes} must be distinct indices into the {len(patch)} spatial "
                         f"axes of patch {patch} (e.g. {tuple(range(len(patch)))})")
