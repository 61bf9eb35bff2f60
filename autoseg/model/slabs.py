"""Convolutions run in slabs at inference on the CPU, so that oneDNN's hidden buffers stay small.

A CPU convolution holds buffers the dispatcher never sees: oneDNN reorders its input (or computes its output) in a
blocked layout, about max(input, output) bytes for a convolution and twice the output for a transposed one
(torch's CPU wheel: ``autoseg.memory.tracker.cpu_conv_scratch_bytes`` models them). On a 48x192x160 tile the
full-resolution decoder convolution (64 to 32 channels) hides 360 MiB, a third of the tile's real peak
(docs/memory.md). ``run_module`` runs a convolution whose input or output exceeds ``slab_bytes`` as slabs of output
rows along its largest spatial axis: each slab's input rows (with the kernel's halo, zero-padded at the ends as the
convolution's own padding would be) are copied out, convolved without padding on that axis and copied into one
preallocated output. The result is the same up to float32 rounding (bitwise for most shapes; oneDNN may sum a
slab's shape in another order: a few 1e-6 on a 32-to-16 convolution, tests/model/test_slabs.py); what is held
beyond the input and output is a slab's input, output and hidden buffer. ``transposed_into`` does the same for a
transposed convolution whose kernel equals its stride (the decoder's upsampling), writing straight into the
caller's buffer (the decoder's concatenation), so the whole upsampled map never exists on its own.

Only without autograd (inference), and only where the caller asks: ``UNet.slab_bytes`` is set by the torch tile
runner (``autoseg.model.torch_runner``) for CPU devices (``slab_bytes_for``); on CUDA the convolutions run whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from autoseg.core.units import MiB
from autoseg.model.cpu_conv import conv3d

# A slab's input or output at most: a large convolution then holds about half of what it holds whole, bitwise the
# same output, for some more time (the halo and the copies; docs/memory.md)
SLAB_BYTES = 32 * MiB

_CONV = {1: F.conv1d, 2: F.conv2d, 3: conv3d}  # 3D: oneDNN's kernel at a batch of 1 too (autoseg.model.cpu_conv)
_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_TRANSPOSED_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def slab_bytes_for(device: torch.device | str) -> int | None:
    """The slab size inference uses on ``device``: ``SLAB_BYTES`` on the CPU, None (whole convolutions) else."""
    return SLAB_BYTES if torch.device(device).type == "cpu" else None


@contextlib.contextmanager
def slabs_on(networks: Sequence[nn.Module], device: torch.device | str) -> Iterator[None]:
    """Within: the networks that have a ``slab_bytes`` attribute (``UNet``) use ``slab_bytes_for(device)``."""
    saved = [(n, n.slab_bytes) for n in networks if hasattr(n, "slab_bytes")]
    for n, _ in saved:
        n.slab_bytes = slab_bytes_for(device)
    try:
        yield
    finally:
        for n, value in saved:
            n.slab_bytes = value


def run_module(module: nn.Module, x: torch.Tensor, slab_bytes: int | None) -> torch.Tensor:
    """``module(x)``; a plain convolution (zeros padding) whose input or output is larger than ``slab_bytes`` runs
    in slabs (``conv_in_slabs``) when autograd is off."""
    slabs = _slab_count(module, x.shape, x.element_size(), slab_bytes)
    return module(x) if slabs is None else conv_in_slabs(module, x, slabs)


def _slab_count(conv: nn.Module, in_shape: torch.Size, element_size: int, slab_bytes: int | None) -> int | None:
    """How many slabs ``conv`` on an input of ``in_shape`` runs in: None (whole) unless it is a plain convolution
    (zeros padding), autograd is off and its input or output exceeds ``slab_bytes``."""
    if slab_bytes is None or torch.is_grad_enabled() or type(conv) not in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        return None
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    largest = max(math.prod(in_shape), math.prod(_conv_output_shape(conv, in_shape))) * element_size
    return None if largest <= slab_bytes else math.ceil(largest / slab_bytes)


def _conv_output_shape(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, shape: torch.Size) -> tuple[int, ...]:
    spatial = (
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(shape[2:], conv.kernel_size, conv.stride, conv.padding, conv.dilation, strict=True)
    )
    return (shape[0], conv.out_channels, *spatial)


def _row_ranges(rows: int, slabs: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of ``slabs`` (at most ``rows``) consecutive, nearly equal runs of ``rows`` rows."""
    step = -(-rows // min(slabs, rows))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def conv_in_slabs(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: torch.Tensor, slabs: int) -> torch.Tensor:
    """``conv(x)`` computed as ``slabs`` slabs of output rows along the largest spatial axis of the output."""
    return _conv_rows(conv, x.shape, lambda axis, lo, hi: x.narrow(axis, lo, hi - lo), slabs)


def _conv_rows(
    conv: nn.Conv1d | nn.Conv2d | nn.Conv3d,
    in_shape: torch.Size,
    rows_of: Callable[[int, int, int], torch.Tensor],
    slabs: int,
) -> torch.Tensor:
    """``conv_in_slabs`` of an input of ``in_shape`` given by ``rows_of(axis, lo, hi)``, its rows [lo, hi) along
    ``axis``: the input need never exist whole (``conv_of_upsampled_and_skip``)."""
    out_shape = _conv_output_shape(conv, in_shape)
    axis = 2 + max(range(len(out_shape) - 2), key=lambda a: out_shape[2 + a])
    a, ndim = axis - 2, len(in_shape)
    k, s, p, d = conv.kernel_size[a], conv.stride[a], conv.padding[a], conv.dilation[a]
    rows, size = out_shape[axis], in_shape[axis]
    padding = list(conv.padding)
    padding[a] = 0
    out = None
    for o0, o1 in _row_ranges(rows, slabs):
        lo, hi = o0 * s - p, (o1 - 1) * s - p + d * (k - 1) + 1  # the input rows these outputs read
        part = rows_of(axis, max(lo, 0), min(hi, size))
        pads = [0] * (2 * (ndim - 2))  # F.pad: the last axis first
        pads[2 * (ndim - 1 - axis)], pads[2 * (ndim - 1 - axis) + 1] = max(-lo, 0), max(hi - size, 0)
        part = F.pad(part, pads) if any(pads) else part.contiguous()
        y = _CONV[ndim - 2](part, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)
        del part
        if out is None:
            out = y.new_empty(out_shape)
        out.narrow(axis, o0, o1 - o0).copy_(y)
        del y
    return out


def conv_of_upsampled_and_skip(
    conv: nn.Module, upsample: nn.Module, coarse: torch.Tensor, skip: torch.Tensor, slab_bytes: int | None
) -> torch.Tensor | None:
    """``conv(torch.cat((upsample(coarse), skip), 1))`` (a decoder stage's first convolution) in slabs, without
    the concatenation ever existing whole: each slab's input rows are the upsampling of the coarse rows they come
    from, beside the skip's rows, so the stage holds the skip, the coarse map and the output (on a 48x192x160 tile
    of 32 features: 188 + 94 + 188 MiB instead of the concatenation's 376 + 188). The same values as
    ``conv_in_slabs`` of the concatenation. None where the convolution would not run in slabs (``run_module``'s
    rule), or the upsampling's kernel is not its stride: then the caller concatenates."""
    in_shape = torch.Size((skip.shape[0], upsample.out_channels + skip.shape[1], *skip.shape[2:]))
    slabs = _slab_count(conv, in_shape, skip.element_size(), slab_bytes)
    if slabs is None or not _plain_upsample(upsample):
        return None

    def rows_of(axis: int, lo: int, hi: int) -> torch.Tensor:
        step = upsample.stride[axis - 2]
        c0, c1 = lo // step, -(-hi // step)  # the coarse rows that make output rows [lo, hi)
        up = _TRANSPOSED[coarse.ndim - 2](
            coarse.narrow(axis, c0, c1 - c0).contiguous(), upsample.weight, upsample.bias, upsample.stride
        )
        return torch.cat((up.narrow(axis, lo - c0 * step, hi - lo), skip.narrow(axis, lo, hi - lo)), dim=1)

    return _conv_rows(conv, in_shape, rows_of, slabs)


def _plain_upsample(upsample: nn.Module) -> bool:
    """A transposed convolution whose kernel equals its stride: each input row makes ``stride`` rows of its own."""
    return (
        type(upsample) in _TRANSPOSED_TYPES
        and upsample.kernel_size == upsample.stride
        and not any(upsample.padding)
        and not any(upsample.output_padding)
        and all(dd == 1 for dd in upsample.dilation)
    )


def transposed_into(
    upsample: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d,
    x: torch.Tensor,
    out: torch.Tensor,
    slab_bytes: int | None,
) -> None:
    """``out.copy_(upsample(x))`` for a transposed convolution whose kernel equals its stride (each input row makes
    ``stride`` output rows of its own), in slabs of input rows along the largest spatial axis when the output is
    larger than ``slab_bytes`` and autograd is off."""
    if (
        slab_bytes is None
        or torch.is_grad_enabled()
        or not _plain_upsample(upsample)
        or out.numel() * x.element_size() <= slab_bytes
    ):
        out.copy_(upsample(x))
        return
    slabs = math.ceil(out.numel() * x.element_size() / slab_bytes)
    axis = 2 + max(range(x.ndim - 2), key=lambda a: x.shape[2 + a])
    s = upsample.stride[axis - 2]
    transposed = _TRANSPOSED[x.ndim - 2]
    for i0, i1 in _row_ranges(x.shape[axis], slabs):
        y = transposed(x.narrow(axis, i0, i1 - i0).contiguous(), upsample.weight, upsample.bias, upsample.stride)
        out.narrow(axis, i0 * s, (i1 - i0) * s).copy_(y)
        del y
