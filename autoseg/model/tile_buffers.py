"""The buffers of one ``sliding_window_predict`` call, and their bytes (``inference_buffer_bytes``, held against
the allocated tensors in tests/model/test_sliding_window.py): the padded input, the logit accumulator and weight
map over a z-window, the Gaussian, and the output or the sink that finished slabs go to. torch is imported where
the buffers are allocated: the planner counts their bytes without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from autoseg.core.precision import element_bytes
from autoseg.model.agreement import agreement_bytes
from autoseg.model.tiles import TileLayout, accumulator_depth, gaussian_importance_map, tile_layout
from autoseg.model.tta import mirror_variants
from autoseg.model.window import SlidingWindow

if TYPE_CHECKING:
    import torch

# The output's dtypes: float16 halves the largest array prediction holds (K x the image) at 1e-3 precision.
OUTPUT_DTYPES = {"float32": 4, "float16": 2}  # torch's dtype of that name -> bytes per element
# The accumulator's dtypes. float16 halves the largest buffer of the sliding window (K x D x Yp x Xp, e.g. 13 classes
# x 48 slices of 512 x 512), as nnU-Net's half-precision logits do; its 11-bit precision changes a label only where
# the top two classes nearly tie (at most 0.1% of voxels: tests/model/test_sliding_window_reference.py).
ACCUMULATOR_DTYPES = {"float32": 4, "float16": 2}  # torch's dtype of that name -> bytes per element
PREDICTION_ACCUMULATOR = "float16"  # what prediction, validation and the planned inference tile use unless told
FLOAT16_MAX = 65504.0  # float16's largest value: a float16 accumulator's mean logits are clamped to it
_FP32_BYTES = 4


def finish_chunk_slices(depth: int, num_outputs: int, accumulator_dtype: str) -> int:
    """z-slices finished at once: float32, all of a finished range in place; float16, ``depth // (K + 1)`` (at
    least 1) at a time, each copied to float32 first, so the copy and its softmax temporary hold at most the
    (D x Yp x Xp) fp32 map the float32 path's temporary holds."""
    return depth if accumulator_dtype == "float32" else max(1, depth // (num_outputs + 1))


def finish_temp_bytes(depth: int, plane_voxels: int, num_outputs: int, accumulator_dtype: str) -> int:
    """Bytes of finishing the accumulator's slices beside the buffers: float32, the softmax's (slices x Yp x Xp)
    fp32 temporary; float16, a chunk's fp32 copy (K x chunk x Yp x Xp) and that temporary (``plane_voxels``: Yp x
    Xp)."""
    chunk = finish_chunk_slices(depth, num_outputs, accumulator_dtype)
    copies = 0 if accumulator_dtype == "float32" else num_outputs
    return (copies + 1) * chunk * plane_voxels * _FP32_BYTES


def inference_buffer_bytes(
    image_shape_zyx: Sequence[int],
    window: SlidingWindow,
    in_channels: int,
    precision: str = "fp32",
    device: str = "cpu",
) -> dict[str, int]:
    """Bytes held by the buffers of ``sliding_window_predict`` with ``window`` on an image of ``image_shape_zyx``
    (fp32; the accumulator in ``window.accumulator_dtype``, the logits in ``precision``'s compute dtype), network
    activations excluded.

    Keys: ``padded_input`` (C x Zp x Yp x Xp; 0 on CPU when the image needs no padding: the input itself is read),
    ``accumulator`` (K x D x Yp x Xp, D = ``accumulator_depth``), ``weight_map`` (D x Yp x Xp), ``gaussian``
    (tile), ``output`` (K x Z x Y x X in ``window.output_dtype``, on the host; 0 for None: the slabs go to
    ``on_slab``), ``tile_batch`` (B x C x tile), ``tile_logits`` (B x K x tile), ``agreement`` (the members' label
    tiles and their counting, ``agreement_bytes``; 0 without ``window.agreement``), and ``total``. ``Zp, Yp, Xp`` is
    the image padded to at least the tile. Not counted: transient copies (a flipped tile, a tile's logits flipped
    back) and finishing a slab's slices (``finish_temp_bytes``).
    """
    layout = tile_layout(image_shape_zyx, window.tile, window.step_fraction)
    reads_input = device == "cpu" and not layout.pads
    _, yp, xp = layout.padded_shape_zyx
    num_variants = len(mirror_variants(window.mirror_axes, window.tta))
    window_voxels = accumulator_depth(layout, num_variants, window.tile_batch_size) * yp * xp
    tile_voxels = math.prod(window.tile)
    num_outputs, batch = window.num_outputs, window.tile_batch_size
    sizes = {
        "padded_input": 0 if reads_input else in_channels * math.prod(layout.padded_shape_zyx) * _FP32_BYTES,
        "accumulator": num_outputs * window_voxels * ACCUMULATOR_DTYPES[window.accumulator_dtype],
        "weight_map": window_voxels * _FP32_BYTES,
        "gaussian": tile_voxels * _FP32_BYTES,
        "output": 0
        if window.output_dtype is None
        else num_outputs * math.prod(layout.image_shape_zyx) * OUTPUT_DTYPES[window.output_dtype],
        "tile_batch": batch * in_channels * tile_voxels * _FP32_BYTES,
        "tile_logits": batch * num_outputs * tile_voxels * element_bytes(precision),
        "agreement": agreement_bytes(window.agreement, batch, tuple(window.tile), num_outputs),
    }
    sizes["total"] = sum(sizes.values())
    return sizes


# Where finished probabilities go: ``on_slab(z_start, z_stop, probabilities)`` with the image's z-slices
# ``[z_start, z_stop)`` as a (K, z_stop - z_start, Y, X) fp32 tensor on the accumulator's device, valid only
# during the call (its memory is the accumulator's, reused afterwards). Slabs come in z order, each once.
SlabSink = Callable[[int, int, "torch.Tensor"], None]


@dataclass
class TileBuffers:
    """The buffers of one ``sliding_window_predict`` call (``inference_buffer_bytes`` counts them). The padded
    input lives on the compute device; the accumulator, weight map and Gaussian on the accumulator's device;
    the output (if any) on the host. The accumulator and weight map hold the padded z-slices ``[z0, z0 + D)``
    only: slices before ``z0`` are final and have gone to ``on_slab``."""

    padded_input: torch.Tensor  # (C, Zp, Yp, Xp) fp32 (on CPU the input itself when it needs no padding)
    accumulator: torch.Tensor  # (K, D, Yp, Xp), Gaussian-weighted mean logits over networks, tiles and variants
    weight_map: torch.Tensor  # (D, Yp, Xp) fp32, sum of the Gaussian over every (network, tile, variant) added
    gaussian: torch.Tensor  # (*patch) fp32, cached and shared
    on_slab: SlabSink  # where finished slabs go
    output: torch.Tensor | None = None  # (K, Z, Y, X) probabilities of the unpadded image on the host, or None
    z0: int = 0  # the padded z-slice the accumulator's first slice holds


def allocate_buffers(
    data: torch.Tensor,
    layout: TileLayout,
    window: SlidingWindow,
    device: torch.device,
    depth: int | None = None,
    on_slab: SlabSink | None = None,
) -> TileBuffers:
    """Allocate the buffers of ``window`` on ``layout``; ``data`` (C, Z, Y, X) is copied into the centre of the
    padded input on ``device`` (on CPU, an image that needs no padding is read where it is). ``depth``: the
    accumulator's z-slices (``accumulator_depth``; None: all). ``on_slab`` None: a ``window.output_dtype`` output
    receives the slabs. The accumulator, weight map and Gaussian go to ``window.accumulator_device`` (None:
    ``device``)."""
    import torch

    padded_zyx, tile = layout.padded_shape_zyx, layout.patch_size
    acc_device = device if window.accumulator_device is None else torch.device(window.accumulator_device)
    if device.type == "cpu" and not layout.pads and data.device.type == "cpu":
        padded_input = data  # read only: tiles are copied out of it
    else:
        # C x Zp x Yp x Xp fp32, allocated on the device and filled there: one host -> device copy of the image.
        # Not acvl_utils' pad_nd_image: it is torch's F.pad, the same zero-fill + copy in the same time and memory,
        # and it re-derives the placement that tile_layout owns.
        padded_input = torch.zeros((data.shape[0], *padded_zyx), dtype=torch.float32, device=device)
        padded_input[(slice(None), *layout.image_region)].copy_(data)  # constant-0 padding, symmetric
    # K x D x Yp x Xp: the z-slices tiles still add to
    shape = (padded_zyx[0] if depth is None else depth, *padded_zyx[1:])
    accumulator = torch.zeros(
        (window.num_outputs, *shape), dtype=getattr(torch, window.accumulator_dtype), device=acc_device
    )
    weight_map = torch.zeros(shape, dtype=torch.float32, device=acc_device)  # D x Yp x Xp fp32
    if window.use_gaussian:
        centre = window.gaussian_centre
        gaussian = gaussian_importance_map(tile, dtype=torch.float32, device=acc_device, centre=centre)
    else:
        gaussian = torch.ones(tile, dtype=torch.float32, device=acc_device)
    output = None
    if on_slab is None:  # K x Z x Y x X on the host: each finished slab's probabilities, in output_dtype
        output = torch.empty(
            (window.num_outputs, *layout.image_shape_zyx), dtype=getattr(torch, window.output_dtype or "float32")
        )
        on_slab = partial(_write_slab, output)
    return TileBuffers(padded_input, accumulator, weight_map, gaussian, on_slab, output)


def _write_slab(output: torch.Tensor, z_start: int, z_stop: int, probabilities: torch.Tensor) -> None:
    output[:, z_start:z_stop].copy_(probabilities)  # device -> host (a sync) and to the output's dtype
