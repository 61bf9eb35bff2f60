"""Sliding-window prediction of one preprocessed image: Gaussian-weighted tiles, mirror TTA, softmax (classes)
or sigmoid (regions).

The core holds no file IO: it takes a normalized, resampled ``(C, Z, Y, X)`` float32 array and returns
``(num_outputs, Z, Y, X)`` float32 or float16 probabilities on the CPU (``num_outputs``: the network's outputs),
or hands each finished slab of z-slices to a callback (``on_slab``) and holds no output at all. Several networks
(the folds of a model) are one ensemble: every tile runs through each of them and their logits are averaged, as
nnU-Net does. Reading, preprocessing and exporting live in ``autoseg.predict``.

A 3D network sees ``(B, C, pz, py, px)`` tiles. A 2D network (``patch_size`` of 2 values) sees
``(B, C, py, px)`` tiles cut from single slices; tiles from different slices share a batch.

Test-time augmentation averages the logits of the first N ``mirror_variants`` (``parse_tta`` reads
``--tta``). One forward pass takes up to ``tile_batch_size`` (tile, mirror variant) pairs, tile by tile.
``autoseg.model.tiles.tile_layout`` owns the padding and the tiles (``autoseg.memory.inference`` counts them
with it), and ``run_tile_batch`` one forward pass and its accumulation (the memory model simulates it).

Memory held for the whole call (``inference_buffer_bytes``): the padded input (on the device; on CPU the input
itself when it needs no padding), the logit accumulator and weight map over a z-window (the volume is finished
slab by slab) and the Gaussian (on the accumulator's device: the device, or the host when they do not fit beside
the tiles), the output (host; none with ``on_slab``), and one tile batch with its logits. Network activations
are not counted here (``autoseg.memory`` models them).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from autoseg.core.errors import InputError
from autoseg.core.precision import PRECISIONS, autocast_dtype
from autoseg.model.slabs import slabs_on
from autoseg.model.tile_buffers import (
    ACCUMULATOR_DTYPES,
    FLOAT16_MAX,
    OUTPUT_DTYPES,
    SlabSink,
    TileBuffers,
    allocate_buffers,
    finish_chunk_slices,
)
from autoseg.model.tiles import (
    Region,
    TileLayout,
    accumulator_depth,
    patch_as_zyx,
    step_fractions,
    tile_layout,
)
from autoseg.model.tta import mirror_variants

ACTIVATIONS = ("softmax", "sigmoid")  # LabelScheme.probabilities: softmax over classes, sigmoid per region


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(precision)
    if dtype is None or (dtype == torch.float16 and device.type == "cpu"):
        return contextlib.nullcontext()  # fp16 autocast is not meaningful on CPU: run fp32
    return torch.autocast(device_type=device.type, dtype=dtype)


def predict_tile_batch(
    network: nn.Module,
    tile_batch: torch.Tensor,
    num_outputs: int,
    precision: str,
) -> torch.Tensor:
    """One forward pass: logits ``(B, K, *patch)`` of ``tile_batch`` ``(B, C, *patch)`` fp32, in the compute
    dtype (bf16/fp16 under autocast). ``precision`` is a key of ``PRECISIONS``."""
    expected = (tile_batch.shape[0], num_outputs, *tile_batch.shape[2:])
    with torch.inference_mode(), _autocast(precision, tile_batch.device):
        out = network(tile_batch)
    if isinstance(out, (list, tuple)):  # deep supervision: full resolution first
        out = out[0]
    if tuple(out.shape) != expected:
        raise ValueError(
            f"network returned logits of shape {tuple(out.shape)} for a tile batch of "
            f"shape {tuple(tile_batch.shape)}; expected {expected}. Check num_outputs "
            "and that the patch size is divisible by the network's strides"
        )
    return out


# One forward-pass input: a tile's region and the index of its mirror variant (into ``mirror_variants``).
Item = tuple[Region, int]


def run_tile_batch(
    networks: Sequence[nn.Module],
    buffers: TileBuffers,
    items: Sequence[Item],
    variants: Sequence[tuple[int, ...]],
    num_outputs: int,
    precision: str,
) -> None:
    """Predict ``items`` with each of ``networks`` in one forward pass each and add their Gaussian-weighted logits
    to the accumulator.

    Held at the peak (``autoseg.memory.inference`` simulates this function): the ``(B, C, *patch)`` fp32
    input, one network's activations and its ``(B, K, *patch)`` logits, one tile's flipped-back logits (on
    the accumulator's device, with a copy of the logits there when it is not the compute device). A network's
    logits are added and freed before the next network runs.
    """
    shape = buffers.padded_input[(slice(None), *items[0][0])].shape  # C x patch
    # B x C x patch fp32: each tile copied in, flipped as its variant says
    tile_batch = torch.empty((len(items), *shape), dtype=torch.float32, device=buffers.padded_input.device)
    for row, (region, v) in zip(tile_batch, items, strict=True):
        tile = buffers.padded_input[(slice(None), *region)]
        row.copy_(torch.flip(tile, [a + 1 for a in variants[v]]) if variants[v] else tile)
    for i, network in enumerate(networks):
        logits = predict_tile_batch(network, tile_batch, num_outputs, precision)
        if i == len(networks) - 1:
            del tile_batch  # not held while the last logits are added
        _accumulate(logits, buffers, items, variants)
        del logits  # before the next network's forward pass


def _accumulate(
    logits: torch.Tensor, buffers: TileBuffers, items: Sequence[Item], variants: Sequence[tuple[int, ...]]
) -> None:
    """Fold one forward pass's ``(B, K, *patch)`` logits, each flipped back, into the accumulator's running
    Gaussian-weighted mean: per voxel, ``W += g`` (the weight map) and ``mean += (g / W) (logits - mean)``.
    A mean, not a sum: it stays at the logits' scale, so a float16 accumulator neither underflows where a tile's
    corner weighs exp(-24) of its centre nor overflows when hundreds of logits add up, and the finished slices
    need no division. Temporaries: a tile's ``g / W`` (patch fp32); float16, the region's K x patch fp32 copy
    (updated there, then stored back: measured 7x faster than mixed-dtype arithmetic on the float16 region)."""
    accumulator, gaussian = buffers.accumulator, buffers.gaussian
    # to the accumulator's device, once per batch (where it is the host: a B x K x patch copy there, one sync)
    logits = logits.to(accumulator.device)
    for tile_logits, (region, v) in zip(logits, items, strict=True):  # K x patch each
        if variants[v]:
            tile_logits = torch.flip(tile_logits, [a + 1 for a in variants[v]])  # a copy: K x patch
        window = _in_window(region, buffers.z0)
        weights = buffers.weight_map[window]
        weights += gaussian
        share = gaussian / weights  # this tile's share of the mean: 1 where it is the first
        mean = accumulator[(slice(None), *window)]
        if mean.dtype == torch.float32:
            mean.lerp_(tile_logits.float(), share)
        else:  # float16: a mean of finite logits is within float16's range; a larger logit is clamped to it
            mean.copy_(mean.float().lerp_(tile_logits.float(), share).clamp_(-FLOAT16_MAX, FLOAT16_MAX))
        del share


def _in_window(region: Region, z0: int) -> Region:
    """A tile's region in the accumulator, whose first slice is padded z-slice ``z0``."""
    z = region[0]
    return (slice(z.start - z0, z.stop - z0) if isinstance(z, slice) else z - z0, *region[1:])


def sliding_window_predict(
    network: nn.Module | Sequence[nn.Module],
    data: np.ndarray | torch.Tensor,
    patch_size: Sequence[int],
    num_outputs: int,
    *,
    step_fraction: float | Sequence[float] = 0.5,
    mirror_axes: Sequence[int] = (),
    tta: int | None = None,
    tile_batch_size: int = 1,
    device: str | torch.device = "cpu",
    accumulator_device: str | torch.device | None = None,
    use_gaussian: bool = True,
    precision: str = "fp32",
    progress: bool = False,
    activation: str = "softmax",
    output_dtype: str = "float32",
    on_slab: SlabSink | None = None,
    accumulator_dtype: str = "float32",
) -> torch.Tensor | None:
    """Probabilities ``(num_outputs, Z, Y, X)`` in ``output_dtype`` (float32 or float16; CPU) of one image:
    ``activation`` "softmax" over the channels (classes) or "sigmoid" per channel (regions) of the averaged
    logits; with ``on_slab`` (``SlabSink``) each finished slab goes there and None is returned (no output).

    ``network``: one network or several (a fold ensemble: each tile runs through every one, and their logits are
    averaged). ``data``: ``(C, Z, Y, X)`` float32, normalized and resampled. ``patch_size``: (z, y, x) for a 3D
    network or (y, x) for a 2D network (then each slice is tiled; tiles of several slices share a batch).
    The networks must already sit on ``device``; they are run in eval mode (their modes are restored afterwards).
    ``mirror_axes`` index the patch's spatial axes; ``tta`` picks the first N of their ``mirror_variants``
    (None: all ``2 ** len(mirror_axes)``): each variant is flipped, predicted and flipped back, and the logits
    averaged. One forward pass takes ``tile_batch_size`` (tile, variant) pairs, tile by tile (2 tiles x 4
    variants in a batch of 8). ``accumulator_device`` (None: ``device``; ``plan_inference`` chooses it and the
    batch). ``precision``: "fp32", "bf16" or "fp16" (autocast; CPU: fp32). ``accumulator_dtype``: a key of
    ``ACCUMULATOR_DTYPES`` (each tile is added in fp32, the softmax runs in fp32). The volume is finished slab by
    slab along z (tiles in z order): the accumulator holds only the z-slices tiles still add to.
    """
    networks = [network] if isinstance(network, nn.Module) else list(network)
    patch = tuple(int(p) for p in patch_size)
    mirror = tuple(int(a) for a in mirror_axes)
    device = torch.device(device)
    acc_device = device if accumulator_device is None else torch.device(accumulator_device)
    data_t = _as_float_tensor(data)
    _check_args(
        data_t,
        patch,
        num_outputs,
        step_fraction,
        mirror,
        tile_batch_size,
        precision,
        activation,
        output_dtype,
        len(networks),
        accumulator_dtype,
    )
    variants, was_training = mirror_variants(mirror, tta), [n.training for n in networks]
    for n in networks:
        n.eval()
    try:
        with torch.no_grad(), slabs_on(networks, device):  # CPU: large convolutions in slabs
            layout = tile_layout(data_t.shape[1:], patch, step_fraction)
            depth = accumulator_depth(layout, len(variants), tile_batch_size)
            buffers = allocate_buffers(
                data_t,
                layout,
                num_outputs,
                use_gaussian,
                device,
                acc_device,
                depth,
                output_dtype,
                on_slab,
                accumulator_dtype,
            )
            del data_t
            _run_tiles(
                networks, buffers, layout, variants, num_outputs, tile_batch_size, precision, progress, activation
            )
            return buffers.output
    finally:
        for n, mode in zip(networks, was_training, strict=True):
            n.train(mode)


def _run_tiles(
    networks: list[nn.Module],
    buffers: TileBuffers,
    layout: TileLayout,
    variants: list[tuple[int, ...]],
    num_outputs: int,
    tile_batch_size: int,
    precision: str,
    progress: bool,
    activation: str,
) -> None:
    """Run every (tile, variant) pair in batches, in z order; after each batch, finish the z-slices no later tile
    touches (``_finish_slices``) and slide the accumulator past them."""
    items = [(region, v) for region in layout.regions() for v in range(len(variants))]  # tile by tile
    z_start = [_z_range(region)[0] for region, _ in items]
    depth, num_slices = buffers.accumulator.shape[1], layout.padded_shape_zyx[0]
    finished = 0  # padded z-slices before this one are in the output
    with tqdm(total=len(items), disable=not progress, desc="sliding window", unit="tile") as bar:
        for first in range(0, len(items), tile_batch_size):
            batch = items[first : first + tile_batch_size]
            if _z_range(batch[-1][0])[1] - buffers.z0 > depth:
                _slide(buffers, finished)
            run_tile_batch(networks, buffers, batch, variants, num_outputs, precision)
            bar.update(len(batch))
            done = z_start[first + len(batch)] if first + len(batch) < len(items) else num_slices
            if done > finished:
                _finish_slices(buffers, layout, finished, done, activation)
                finished = done


def _z_range(region: Region) -> tuple[int, int]:
    z = region[0]
    return (z.start, z.stop) if isinstance(z, slice) else (z, z + 1)


def _slide(buffers: TileBuffers, z0: int) -> None:
    """Make the accumulator and weight map start at padded z-slice ``z0`` (the slices before it are finished):
    the slices kept move to the front one at a time (no temporary), the rest is zeroed."""
    shift = z0 - buffers.z0
    depth = buffers.accumulator.shape[1]
    keep = max(depth - shift, 0)
    for j in range(keep):  # ascending: slice j + shift is read before anything overwrites it
        buffers.accumulator[:, j].copy_(buffers.accumulator[:, j + shift])
        buffers.weight_map[j].copy_(buffers.weight_map[j + shift])
    buffers.accumulator[:, keep:].zero_()
    buffers.weight_map[keep:].zero_()
    buffers.z0 = z0


def _finish_slices(buffers: TileBuffers, layout: TileLayout, start: int, stop: int, activation: str) -> None:
    """Padded z-slices ``[start, stop)`` have all their tiles: their mean logits become probabilities and the
    image's part of them goes to ``on_slab``: a float32 accumulator's slices in place, a float16 one's
    ``finish_chunk_slices`` at a time through an fp32 copy (``finish_temp_bytes`` counts either)."""
    num_outputs, depth = buffers.accumulator.shape[:2]
    chunk = finish_chunk_slices(depth, num_outputs, str(buffers.accumulator.dtype).removeprefix("torch."))
    zs, ys, xs = layout.image_region
    for a in range(start, stop, chunk):
        b = min(a + chunk, stop)
        logits = buffers.accumulator[:, a - buffers.z0 : b - buffers.z0].float()  # float32: a view
        if activation == "sigmoid":
            logits.sigmoid_()  # in place, per region: no temporaries
        else:  # in-place softmax over classes: temporaries are one slices x Yp x Xp fp32 map each
            logits -= logits.amax(dim=0, keepdim=True)
            logits.exp_()
            logits /= logits.sum(dim=0, keepdim=True)
        z_from, z_to = max(a, zs.start), min(b, zs.stop)
        if z_from < z_to:
            buffers.on_slab(z_from - zs.start, z_to - zs.start, logits[:, z_from - a : z_to - a, ys, xs])


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
    step_fraction: float | Sequence[float],
    mirror_axes: tuple[int, ...],
    tile_batch_size: int,
    precision: str,
    activation: str,
    output_dtype: str,
    num_networks: int,
    accumulator_dtype: str,
) -> None:
    if num_networks < 1:
        raise ValueError("sliding_window_predict needs at least one network")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if accumulator_dtype not in ACCUMULATOR_DTYPES:
        raise InputError(f"accumulator dtype must be one of {sorted(ACCUMULATOR_DTYPES)}; got {accumulator_dtype!r}")
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {sorted(OUTPUT_DTYPES)}; got {output_dtype!r}")
    if data.ndim != 4:
        raise ValueError(
            f"data must be (C, Z, Y, X); got shape {tuple(data.shape)}. Lift 2D images to Z = 1 and add a channel axis"
        )
    patch_as_zyx(patch)  # validates the number of patch axes
    if any(p < 1 for p in patch):
        raise ValueError(f"patch_size must be positive; got {patch}")
    if num_outputs < 1:
        raise ValueError(f"num_outputs must be >= 1; got {num_outputs}")
    step_fractions(step_fraction, len(patch))
    if tile_batch_size < 1:
        raise InputError(f"tile_batch_size must be >= 1; got {tile_batch_size}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}")
    if len(set(mirror_axes)) != len(mirror_axes) or any(not 0 <= a < len(patch) for a in mirror_axes):
        raise ValueError(
            f"mirror_axes {mirror_axes} must be distinct indices into the {len(patch)} spatial "
            f"axes of patch {patch} (e.g. {tuple(range(len(patch)))})"
        )
