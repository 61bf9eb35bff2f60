"""The residual encoder U-Net's own layout: nnU-Net's ResEnc block counts, the stem, the strided first block of a
stage, the skip's pooling and 1x1 projection only where the shape changes, blocks that start as their skip, its
parameters and FLOPs. The contract every architecture passes is in test_network.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoseg.model.flops import forward_conv_flops
from autoseg.model.network import build_network
from autoseg.model.residual import ResidualBlock, ResidualEncoderUNet
from autoseg.model.topology import RESIDUAL_ENCODER_UNET, NetworkTopology, resenc_blocks_per_stage


def resenc(
    dim: int = 3,
    features: tuple[int, ...] = (4, 8, 16, 16),
    strides: tuple[tuple[int, ...], ...] | None = None,
    kernels: tuple[tuple[int, ...], ...] | None = None,
    blocks: tuple[int, ...] | None = None,
    in_channels: int = 2,
    num_outputs: int = 3,
    decoder_convs: int = 1,
) -> NetworkTopology:
    n = len(features)
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=features,
        kernel_sizes=kernels or ((3,) * dim,) * n,
        strides=strides or ((1,) * dim,) + ((2,) * dim,) * (n - 1),
        conv_per_stage=decoder_convs,
        architecture=RESIDUAL_ENCODER_UNET,
        blocks_per_stage=resenc_blocks_per_stage(n) if blocks is None else blocks,
    )


def test_block_counts_are_nnunets_resenc_capped_at_the_stages() -> None:
    assert resenc_blocks_per_stage(2) == (1, 3)
    assert resenc_blocks_per_stage(6) == (1, 3, 4, 6, 6, 6)
    assert resenc_blocks_per_stage(7) == (1, 3, 4, 6, 6, 6, 6)


def test_stages_hold_a_stem_then_their_blocks_the_first_one_strided() -> None:
    topo = resenc(3, strides=((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)))
    net = build_network(topo)
    assert isinstance(net, ResidualEncoderUNet)
    stem, *blocks0 = net.encoder[0]
    assert isinstance(stem[0], nn.Conv3d) and stem[0].stride == (1, 1, 1) and len(blocks0) == 1
    assert [len(stage) for stage in net.encoder[1:]] == [3, 4, 6]
    for s, stage in enumerate(net.encoder[1:], start=1):
        assert all(isinstance(b, ResidualBlock) for b in stage)
        assert stage[0].conv1[0].stride == topo.strides[s]
        assert all(b.conv1[0].stride == (1, 1, 1) and b.conv2[0].stride == (1, 1, 1) for b in stage[1:])
    assert [len(d.convs) for d in net.decoder] == [1, 1, 1]  # one conv block per decoder stage


def test_the_skip_pools_and_projects_only_where_the_shape_changes() -> None:
    # stage 1: stride 2, 4 -> 8 channels; stage 2: stride 1, 8 -> 16; stage 3: stride 2, 16 -> 16
    net = build_network(resenc(2, features=(4, 8, 16, 16), strides=((1, 1), (2, 2), (1, 1), (2, 2))))
    kinds = [[type(m).__name__ for m in stage[0].skip] for stage in net.encoder[1:]]
    assert kinds == [["AvgPool2d", "Conv2d", "InstanceNorm2d"], ["Conv2d", "InstanceNorm2d"], ["AvgPool2d"]]
    assert net.encoder[1][0].skip[1].kernel_size == (1, 1)
    for stage in net.encoder[1:]:  # the later blocks of a stage keep its shape: identity skips
        later = [b for b in stage if isinstance(b, ResidualBlock)][1:]
        assert later and all(len(b.skip) == 0 for b in later)
    assert len(net.encoder[0][1].skip) == 0  # stage 0 keeps the stem's shape


def test_every_block_starts_as_its_skip() -> None:
    """The second norm starts at zero, so a fresh block returns LeakyReLU(skip(x))."""
    torch.manual_seed(0)
    net = build_network(resenc(3, features=(4, 8)))
    block = net.encoder[1][1]  # identity skip
    x = torch.randn(2, 8, 4, 4, 4)
    assert torch.equal(block(x.clone()), nn.functional.leaky_relu(x, 0.01))
    first = net.encoder[1][0]
    x = torch.randn(2, 4, 8, 8, 8)
    assert torch.allclose(first(x.clone()), nn.functional.leaky_relu(first.skip(x), 0.01))


def test_parameter_count_matches_hand_count() -> None:
    topo = resenc(2, features=(2, 4), blocks=(1, 1), in_channels=1, num_outputs=2)
    # stem: conv 1->2 (2*1*9 + 2) + norm 4 = 24;  stage 0 block: 2 x [conv 2->2 (2*2*9 + 2) + norm 4] = 2 * 42
    # stage 1 block: conv 2->4 (4*2*9 + 4) + norm 8 = 84, conv 4->4 (4*4*9 + 4) + norm 8 = 156,
    #   skip: 1x1 conv 2->4 (8 + 4) + norm 8 = 20
    # decoder 0: transposed 4->2 k2 (4*2*4 + 2) = 34, conv 4->2 (2*4*9 + 2) = 74, norm 4;  seg head 2->2 = 6
    count = sum(p.numel() for p in build_network(topo).parameters())
    assert count == 24 + 2 * 42 + (84 + 156 + 20) + (34 + 74 + 4) + 6


@pytest.mark.parametrize(
    "topo, patch",
    [
        (
            resenc(3, strides=((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)), kernels=((1, 3, 3),) + ((3, 3, 3),) * 3),
            (8, 16, 16),
        ),
        (resenc(2, features=(4, 8, 16, 16, 16), in_channels=3, num_outputs=5, decoder_convs=2), (32, 48)),
    ],
)
def test_forward_conv_flops_are_the_convolutions_torch_runs(topo: NetworkTopology, patch: tuple[int, ...]) -> None:
    from autoseg.plan.step_cost import step_flops

    net = build_network(topo)
    with FlopCounterMode(display=False) as counter:
        net(torch.randn(2, topo.in_channels, *patch))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.convolution"] == 2 * forward_conv_flops(topo, patch)
    assert step_flops(topo, patch, 2) == 3 * 2 * forward_conv_flops(topo, patch)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"blocks_per_stage": (1, 3)},
            r"blocks_per_stage is \[1, 3\]; a residual_encoder_unet needs one count >= 1 "
            r"per stage \(4\), e\.g\. nnU-Net's \[1, 3, 4, 6\]",
        ),
        ({"blocks_per_stage": (1, 0, 4, 6)}, r"blocks_per_stage is \[1, 0, 4, 6\]"),
        (
            {"architecture": "plain_unet"},
            r"blocks_per_stage is \[1, 3, 4, 6\] but architecture 'plain_unet' has no "
            r"residual blocks; set it to \[\]",
        ),
    ],
)
def test_invalid_blocks_are_rejected_with_the_field_to_fix(changes: dict, message: str) -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        build_network(replace(resenc(2), **changes))
