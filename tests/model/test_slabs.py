"""Convolutions in slabs at inference (``autoseg.model.slabs``): the output of the whole convolution (bitwise for
most shapes; oneDNN may pick another summation order for a slab's shape), with less held beyond its input and
output, and only where asked (CPU inference, large enough)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoseg.memory.tracker import StorageTracker
from autoseg.model.network import build_network
from autoseg.model.slabs import (
    conv_in_slabs,
    conv_of_upsampled_and_skip,
    run_module,
    slabs_on,
    transposed_into,
)
from autoseg.model.topology import NetworkTopology


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (nn.Conv3d(6, 4, 3, padding=1), (1, 6, 10, 13, 7)),
        (nn.Conv3d(6, 4, (1, 3, 3), padding=(0, 1, 1)), (2, 6, 5, 9, 12)),
        (nn.Conv3d(4, 8, 3, stride=2, padding=1), (1, 4, 9, 16, 11)),  # strided, odd sizes
        (nn.Conv3d(4, 8, 1), (1, 4, 6, 17, 5)),  # a segmentation head
        (nn.Conv2d(3, 5, 3, padding=1), (2, 3, 19, 8)),
        (nn.Conv2d(3, 5, 5, padding=2, dilation=1, stride=(1, 2)), (1, 3, 21, 14)),
    ],
)
@pytest.mark.parametrize("slabs", [2, 3, 50])
def test_conv_in_slabs_is_the_whole_convolution(conv: nn.Module, shape: tuple[int, ...], slabs: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(conv_in_slabs(conv, x, slabs), conv(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stride", [(1, 2, 2), (2, 2, 2)])
def test_transposed_into_writes_the_upsampling_in_slabs(stride: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    up = nn.ConvTranspose3d(8, 4, stride, stride=stride)
    x = torch.randn(1, 8, 3, 10, 6)
    merged = torch.zeros(1, 8, *(s * k for s, k in zip(x.shape[2:], stride, strict=True)))
    with torch.no_grad():
        transposed_into(up, x, merged[:, :4], slab_bytes=64)
        torch.testing.assert_close(merged[:, :4], up(x), rtol=0, atol=0)
    assert not merged[:, 4:].any()  # nothing written beside the view


@pytest.mark.parametrize(
    ("stride", "coarse_shape", "slab_bytes"),
    [
        ((1, 2, 2), (1, 8, 3, 10, 6), 2000),  # slabs along y, a coarse row split between slabs
        ((2, 2, 2), (2, 8, 4, 5, 9), 3000),  # two samples, slabs along x
        ((1, 2, 2), (1, 8, 3, 10, 6), 10),  # a slab per output row
    ],
)
def test_a_decoder_stages_first_convolution_in_slabs_never_builds_the_concatenation(
    stride: tuple[int, ...], coarse_shape: tuple[int, ...], slab_bytes: int
) -> None:
    """``conv_of_upsampled_and_skip`` gives ``conv(cat(upsample(coarse), skip))`` while no tensor of the
    concatenation's size is ever allocated (StorageTracker sees every allocation)."""
    torch.manual_seed(0)
    up, conv = nn.ConvTranspose3d(8, 4, stride, stride=stride), nn.Conv3d(8, 4, 3, padding=1)
    coarse = torch.randn(coarse_shape)
    skip = torch.randn(coarse_shape[0], 4, *(s * k for s, k in zip(coarse_shape[2:], stride, strict=True)))
    whole_bytes = 2 * skip.numel() * 4
    with torch.no_grad():
        expected = conv(torch.cat((up(coarse), skip), dim=1))
        with StorageTracker() as tracker:
            out = conv_of_upsampled_and_skip(conv, up, coarse, skip, slab_bytes)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert 0 < max(tracker.sizes) < whole_bytes
        assert conv_of_upsampled_and_skip(conv, up, coarse, skip, slab_bytes=whole_bytes) is None  # small: whole
    assert conv_of_upsampled_and_skip(conv, up, coarse, skip, slab_bytes) is None  # autograd on: whole


def test_run_module_slabs_only_large_convolutions_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("autoseg.model.slabs.conv_in_slabs", lambda conv, x, slabs: calls.append(slabs) or conv(x))
    conv, x = nn.Conv3d(4, 8, 3, padding=1), torch.randn(1, 4, 4, 8, 8)  # output 8 KiB
    with torch.no_grad():
        run_module(conv, x, slab_bytes=8 * 4 * 8 * 8 * 4)  # exactly the output: whole
        run_module(conv, x, slab_bytes=None)
        run_module(nn.InstanceNorm3d(4), x, slab_bytes=1)
        assert calls == []
        run_module(conv, x, slab_bytes=1000)
    assert calls == [9]  # ceil(8192 / 1000)
    run_module(conv, x, slab_bytes=1000)  # autograd on: whole
    assert calls == [9]


def _peak_and_logits(net: nn.Module, x: torch.Tensor, device: str | None) -> tuple[int, torch.Tensor]:
    tracker = StorageTracker(cpu_conv_scratch=True)  # the tracked tensors and the convolutions' hidden buffers
    with torch.no_grad(), tracker:
        if device is None:
            out = net(x)
        else:
            with slabs_on([net], device):
                out = net(x)
    return tracker.peak_bytes, out


def test_network_in_slabs_on_cpu_gives_the_same_logits_and_holds_less(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole U-Net with slabs (as the torch tile runner runs it on the CPU): the same logits up to float32
    rounding (a 32-to-16 convolution's slabs sum in another order: a few 1e-6 apart); the slab size restored afterwards;
    on CUDA (by name: no device needed) nothing is slabbed."""
    monkeypatch.setattr("autoseg.model.slabs.SLAB_BYTES", 2**20)  # maps of 4 MiB: 4-8 slabs
    torch.manual_seed(0)
    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(16, 32, 64),
        kernel_sizes=((3, 3, 3),) * 3,
        strides=((1, 1, 1), (2, 2, 2), (2, 2, 2)),
        conv_per_stage=2,
        deep_supervision=False,
    )
    net = build_network(topology).eval()
    x = torch.randn(1, 1, 16, 64, 64)  # full-resolution maps: 16 x 16 x 64 x 64 x 4 B = 4 MiB
    whole_peak, whole = _peak_and_logits(net, x, None)
    with slabs_on([net], "cuda"):
        assert net.slab_bytes is None
    net.slab_bytes = 7
    slab_peak, slabbed = _peak_and_logits(net, x, "cpu")
    assert net.slab_bytes == 7
    torch.testing.assert_close(slabbed, whole, rtol=1e-5, atol=1e-5)
    full_resolution_map = 16 * 16 * 64 * 64 * 4
    assert slab_peak <= whole_peak - full_resolution_map  # the decoder's upsampling never exists whole
