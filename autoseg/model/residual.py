"""The residual encoder U-Net (``residual_encoder_unet``; nnU-Net's ResEnc family, written here from its
description): the plain U-Net's decoder and heads on an encoder of residual basic blocks.

    encoder stage 0 : stem [Conv(k_0) -> InstanceNorm -> LReLU], then blocks_per_stage[0] residual blocks
    encoder stage s : blocks_per_stage[s] residual blocks; the first one strided by strides[s] and changing
                      the channels from features[s-1] to features[s]
    residual block  : y = LReLU(IN(Conv(k_s)(LReLU(IN(Conv(k_s; stride)(x))))) + skip(x))
                      skip(x) = x, or, where the block changes the shape, AvgPool(kernel = stride) where it
                      strides, then a 1x1 Conv -> InstanceNorm where it changes the channels (ResNet-D)
    decoder stage s : as the plain U-Net's, with conv_per_stage (1 as planned) conv blocks

The second norm of every block starts at zero (weight and bias), so each block starts as its skip: the
encoder starts close to a plain one and the residual branches grow from there (Goyal et al., 2017).
``autoseg.model.flops.forward_conv_flops`` counts its convolutions' FLOPs from the topology alone.
"""

from __future__ import annotations

import torch
from torch import nn

from autoseg.model.blocks import AVG_POOL, UNet, conv_block, conv_norm
from autoseg.model.topology import NetworkTopology


class ResidualBlock(nn.Module):
    """``(B, in_channels, *size)`` -> ``(B, out_channels, *size / stride)``: two convs (the first strided), a skip."""

    def __init__(
        self, dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        super().__init__()
        stride = tuple(stride)
        self.conv1 = conv_block(dim, in_channels, out_channels, kernel, stride)
        self.conv2 = nn.Sequential(*conv_norm(dim, out_channels, out_channels, kernel))
        skip: list[nn.Module] = []
        if any(s != 1 for s in stride):
            skip.append(AVG_POOL[dim](kernel_size=stride, stride=stride))
        if in_channels != out_channels:
            skip += conv_norm(dim, in_channels, out_channels, (1,) * dim)
        self.skip = nn.Sequential(*skip)  # empty: the identity
        self.nonlin = nn.LeakyReLU(negative_slope=0.01, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlin(self.conv2(self.conv1(x)) + self.skip(x))


def residual_stage(
    dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...], stride: tuple[int, ...], num_blocks: int
) -> list[nn.Module]:
    """``num_blocks`` residual blocks; only the first one strides and changes the channels."""
    return [
        ResidualBlock(dim, in_channels, out_channels, kernel, stride),
        *(ResidualBlock(dim, out_channels, out_channels, kernel, (1,) * dim) for _ in range(num_blocks - 1)),
    ]


class ResidualEncoderUNet(UNet):
    """A U-Net whose encoder stages are residual blocks (see the module docstring; ``UNet`` for the attributes)."""

    def __init__(self, topology: NetworkTopology, checkpointing: bool = False) -> None:
        super().__init__(topology, checkpointing)
        for module in self.encoder.modules():  # each block starts as its skip
            if isinstance(module, ResidualBlock):
                nn.init.zeros_(module.conv2[1].weight)
                nn.init.zeros_(module.conv2[1].bias)

    def build_encoder(self, topology: NetworkTopology) -> list[nn.Module]:
        dim, features, kernels = topology.dim, topology.features_per_stage, topology.kernel_sizes
        stem = conv_block(dim, topology.in_channels, features[0], kernels[0])
        stages = [
            nn.Sequential(
                stem,
                *residual_stage(
                    dim, features[0], features[0], kernels[0], topology.strides[0], topology.blocks_per_stage[0]
                ),
            )
        ]
        stages += [
            nn.Sequential(
                *residual_stage(
                    dim, features[s - 1], features[s], kernels[s], topology.strides[s], topology.blocks_per_stage[s]
                )
            )
            for s in range(1, topology.num_stages)
        ]
        return stages
