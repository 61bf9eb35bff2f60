"""Which kernel a 3D convolution runs on the CPU at inference: oneDNN's, whatever the tile batch.

torch's CPU wheel picks a convolution's kernel per call (``_select_conv_backend``): an fp32 3D convolution goes to
oneDNN only when its batch is over 1 or N x C x D x H (the width left out: a rule made for 2D) is over 20,480;
else to ``slow_conv3d``, an im2col buffer of C_in x kernel volume x output voxels and one GEMM. At a tile batch of
1 that is every convolution of a small tile and the early ones of a large tile. Measured here (2 cores, torch 2.13,
docs/prediction.md "oneDNN at a tile batch of 1"): an nnU-Net network of 8-64 features on a 16x64x64 tile 97 ms
through ``slow_conv3d`` against 19 ms through oneDNN; a 16-32-64-128 network on a 32x112x112 tile 478 against
407 ms; and the im2col buffer is 13.5 MiB where oneDNN holds 0.4 MiB (16 to 16 channels on 8x32x32). So inference
(``onednn_convolutions``, entered by the torch tile runner) calls oneDNN directly for every plain fp32
``nn.Conv3d`` on the CPU; the result equals torch's other kernels to float32 rounding (a few 1e-6).

The call goes through the operator ``autoseg::conv3d_onednn`` (``ONEDNN_CONV_OP``), so that the memory model's
tracker (``autoseg.memory.tracker``) sees which kernel ran and counts oneDNN's hidden buffers for it, and so that it
runs on fake tensors (the inference plan's simulation), where torch's own ``mkldnn_convolution`` has no shape
function. Not taken: with autograd on (training), under autocast (a bf16 convolution goes to oneDNN anyway), for
other dtypes and devices, while ONNX export traces (a graph keeps the standard convolution), when torch has no
oneDNN or it is switched off (``torch.backends.mkldnn``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_CONV_OP = "conv3d_onednn"  # the operator's name as a TorchDispatchMode sees it (``autoseg::conv3d_onednn``)


@torch.library.custom_op(f"autoseg::{ONEDNN_CONV_OP}", mutates_args=())
def conv3d_onednn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    """``F.conv3d(x, weight, bias, stride, padding, dilation, groups)`` computed by oneDNN, for a batch of 1 too.
    ``x`` ``(N, C_in, D, H, W)`` float32 on the CPU; returns ``(N, C_out, D', H', W')`` float32."""
    return torch.mkldnn_convolution(x.contiguous(), weight, bias, padding, stride, dilation, groups)


@conv3d_onednn.register_fake
def _conv3d_onednn_shape(x, weight, bias, stride, padding, dilation, groups):
    spatial = (
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation, strict=True)
    )
    return x.new_empty((x.shape[0], weight.shape[0], *spatial))


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 3D convolution of ``x`` by ``weight`` goes through ``conv3d_onednn`` here (the module docstring's
    conditions)."""
    return (
        x.ndim == 5
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.onnx.is_in_onnx_export()
        and not torch.jit.is_tracing()
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def conv3d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """A zero-padded 3D convolution as inference runs it: ``conv3d_onednn`` where ``onednn_applies``, else
    ``F.conv3d``."""
    if onednn_applies(x, weight):
        return conv3d_onednn(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    return F.conv3d(x, weight, bias, stride, padding, dilation, groups)


def _plain_conv3d_forward(conv: nn.Conv3d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return conv3d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


@contextlib.contextmanager
def onednn_convolutions(networks: Sequence[nn.Module], device: torch.device | str) -> Iterator[None]:
    """Within, on a CPU ``device``: the networks' plain ``nn.Conv3d`` modules (zero padding given as sizes) compute
    through ``conv3d`` (oneDNN where it applies); elsewhere, and afterwards, as torch would."""
    if torch.device(device).type != "cpu":
        yield
        return
    convs = [
        m
        for network in networks
        for m in network.modules()
        if type(m) is nn.Conv3d and m.padding_mode == "zeros" and not isinstance(m.padding, str)
    ]
    for conv in convs:
        conv._conv_forward = functools.partial(_plain_conv3d_forward, conv)  # nn.Conv3d.forward calls it
    try:
        yield
    finally:
        for conv in convs:
            del conv._conv_forward
