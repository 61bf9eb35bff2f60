"""Sliding-window prediction of one preprocessed image: Gaussian-weighted tiles, mirror TTA, softmax (classes)
or sigmoid (regions).

The core holds no file IO: it takes a normalized, resampled ``(C, Z, Y, X)`` float32 array and returns
``(num_outputs, Z, Y, X)`` float32 or float16 probabilities on the CPU (``num_outputs``: the network's outputs),
or hands each finished slab of z-slices to a callback (``on_slab``) and holds no output at all. Its settings are
one ``SlidingWindow`` (``autoseg.model.window``). The folds' networks are ``TileRunner``s
(``autoseg.model.tile_runner``): a tile batch in, logits out; several are one ensemble: every tile runs through each
of them and their logits are averaged, as nnU-Net does. The tiling, mirroring, Gaussian weighting, accumulation and
finishing here are the same whatever runs the tiles. Reading, preprocessing and exporting live in
``autoseg.predict``.

A 3D network sees ``(B, C, pz, py, px)`` tiles. A 2D network (a tile of 2 values) sees ``(B, C, py, px)`` tiles
cut from single slices; tiles from different slices share a batch.

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

import warnings
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.errors import InputError
from autoseg.core.precision import PRECISIONS
from autoseg.model.agreement import AgreementCounter
from autoseg.model.tile_buffers import (
    ACCUMULATOR_DTYPES,
    FLOAT16_MAX,
    OUTPUT_DTYPES,
    SlabSink,
    TileBuffers,
    allocate_buffers,
    finish_chunk_slices,
)
from autoseg.model.tile_runner import TileRunner
from autoseg.model.tiles import (
    Region,
    TileLayout,
    accumulator_depth,
    patch_as_zyx,
    step_fractions,
    tile_layout,
)
from autoseg.model.tta import mirror_variants
from autoseg.model.window import ACTIVATIONS, SlidingWindow


def predict_tile_batch(runner: TileRunner, tile_batch: torch.Tensor, num_outputs: int) -> torch.Tensor:
    """One forward pass: logits ``(B, K, *tile)`` of ``tile_batch`` ``(B, C, *tile)`` fp32, in the runner's compute
    dtype (bf16/fp16 under autocast); refused when they are not ``num_outputs`` maps of the tile's shape."""
    expected = (tile_batch.shape[0], num_outputs, *tile_batch.shape[2:])
    out = runner(tile_batch)
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
    runners: Sequence[TileRunner],
    buffers: TileBuffers,
    items: Sequence[Item],
    variants: Sequence[tuple[int, ...]],
    num_outputs: int,
    agreement: AgreementCounter | None = None,
) -> None:
    """Predict ``items`` with each of ``runners`` in one forward pass each and add their Gaussian-weighted logits
    to the accumulator; with ``agreement``, each runner's label tiles to its running sums too.

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
    for i, runner in enumerate(runners):
        logits = predict_tile_batch(runner, tile_batch, num_outputs)
        if i == len(runners) - 1:
            del tile_batch  # not held while the last logits are added
        if agreement is not None:
            for tile_logits, (region, v) in zip(logits, items, strict=True):
                agreement.add(tile_logits, region, variants[v], fold=i, variant=v)
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
    (updated there, then stored back: several times faster than mixed-dtype arithmetic on the float16 region)."""
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
    runners: Sequence[TileRunner],
    data: np.ndarray | torch.Tensor,
    window: SlidingWindow,
    on_slab: SlabSink | None = None,
    agreement: AgreementCounter | None = None,
) -> torch.Tensor | None:
    """Probabilities ``(window.num_outputs, Z, Y, X)`` in ``window.output_dtype`` (float32 or float16; CPU) of one
    image: ``window.activation`` ("softmax" over the outputs, "sigmoid" per output, or "none") of the averaged
    logits; with ``on_slab`` (``SlabSink``) each finished slab goes there and None is returned (no output).

    ``runners``: the folds' ``TileRunner`` (one, or several: an ensemble; each tile runs through every one, and
    their logits are averaged), on one device: the padded input lives there. ``data``: ``(C, Z, Y, X)`` float32,
    normalized and resampled. ``window``: the tile, steps, mirror variants, tile batch, accumulator and output
    (``SlidingWindow``). The volume is finished slab by slab along z (tiles in z order): the accumulator holds only
    the z-slices tiles still add to.
    """
    runners = list(runners)
    data_t = _as_float_tensor(data)
    _check_args(data_t, window, runners, on_slab)
    device = runners[0].device
    variants = mirror_variants(tuple(int(a) for a in window.mirror_axes), window.tta)
    with torch.no_grad():
        layout = tile_layout(data_t.shape[1:], tuple(int(t) for t in window.tile), window.step_fraction)
        depth = accumulator_depth(layout, len(variants), window.tile_batch_size)
        buffers = allocate_buffers(data_t, layout, window, device, depth, on_slab)
        del data_t
        if window.agreement is not None:
            window.agreement.check(len(runners), len(variants))
            if agreement is None:
                raise ValueError("window.agreement asks for the members' agreement: pass an AgreementCounter")
            agreement.start(buffers.gaussian, layout.image_region)
        _run_tiles(runners, buffers, layout, variants, window, agreement)
        return buffers.output


def _run_tiles(
    runners: list[TileRunner],
    buffers: TileBuffers,
    layout: TileLayout,
    variants: list[tuple[int, ...]],
    window: SlidingWindow,
    agreement: AgreementCounter | None = None,
) -> None:
    """Run every (tile, variant) pair in batches of ``window.tile_batch_size``, in z order; after each batch,
    finish the z-slices no later tile touches (``_finish_slices``) and slide the accumulator past them."""
    items = [(region, v) for region in layout.regions() for v in range(len(variants))]  # tile by tile
    z_start = [_z_range(region)[0] for region, _ in items]
    depth, num_slices = buffers.accumulator.shape[1], layout.padded_shape_zyx[0]
    finished = 0  # padded z-slices before this one are in the output
    with tqdm(total=len(items), disable=not window.progress, desc="sliding window", unit="tile") as bar:
        for first in range(0, len(items), window.tile_batch_size):
            batch = items[first : first + window.tile_batch_size]
            if _z_range(batch[-1][0])[1] - buffers.z0 > depth:
                _slide(buffers, finished)
            run_tile_batch(runners, buffers, batch, variants, window.num_outputs, agreement)
            bar.update(len(batch))
            done = z_start[first + len(batch)] if first + len(batch) < len(items) else num_slices
            if done > finished:
                _finish_slices(buffers, layout, finished, done, window.activation)
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
        elif activation == "softmax":  # in place over classes: temporaries are one slices x Yp x Xp fp32 map each
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


def _check_args(data: torch.Tensor, window: SlidingWindow, runners: list[TileRunner], on_slab: SlabSink | None) -> None:
    if not runners:
        raise ValueError("sliding_window_predict needs at least one network")
    if len({torch.device(r.device) for r in runners}) > 1:
        raise ValueError(
            f"the runners are on different devices ({', '.join(str(r.device) for r in runners)}); put every "
            "fold's network on the one device the sliding window runs on"
        )
    for precision in {r.precision for r in runners}:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}")
    if window.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {window.activation!r}")
    if window.accumulator_dtype not in ACCUMULATOR_DTYPES:
        raise InputError(
            f"accumulator dtype must be one of {sorted(ACCUMULATOR_DTYPES)}; got {window.accumulator_dtype!r}"
        )
    if window.output_dtype is None and on_slab is None:
        raise ValueError("output_dtype None returns no output: give on_slab, where the finished slabs go")
    if window.output_dtype is not None and window.output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {sorted(OUTPUT_DTYPES)}; got {window.output_dtype!r}")
    if data.ndim != 4:
        raise ValueError(
            f"data must be (C, Z, Y, X); got shape {tuple(data.shape)}. Lift 2D images to Z = 1 and add a channel axis"
        )
    tile, mirror_axes = tuple(int(t) for t in window.tile), tuple(int(a) for a in window.mirror_axes)
    patch_as_zyx(tile)  # validates the number of tile axes
    if any(t < 1 for t in tile):
        raise ValueError(f"patch_size must be positive; got {tile}")
    if window.num_outputs < 1:
        raise ValueError(f"num_outputs must be >= 1; got {window.num_outputs}")
    step_fractions(window.step_fraction, len(tile))
    if window.tile_batch_size < 1:
        raise InputError(f"tile_batch_size must be >= 1; got {window.tile_batch_size}")
    if len(set(mirror_axes)) != len(mirror_axes) or any(not 0 <= a < len(tile) for a in mirror_axes):
        raise ValueError(
            f"mirror_axes {mirror_axes} must be distinct indices into the {len(tile)} spatial "
            f"axes of patch {tile} (e.g. {tuple(range(len(tile)))})"
        )
