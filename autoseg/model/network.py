"""The segmentation networks: the registry ``NETWORKS`` and ``build_network(topology)``, which builds the
``architecture`` a ``NetworkTopology`` (the plan) names.

``plain_unet`` (``PlainConvUNet``, the same shape as nnU-Net's PlainConvUNet, written here from its description)::

    encoder stage s : conv_per_stage x [Conv(k_s; the first strided by strides[s]) -> InstanceNorm -> LReLU]
    decoder stage s : TransposedConv(kernel = stride = strides[s+1]) from stage s+1,
                      concat with the skip of encoder stage s,
                      conv_per_stage x [Conv(k_s) -> InstanceNorm -> LeakyReLU]
    seg head s      : 1x1 Conv -> num_outputs logits at the resolution of encoder stage s

``residual_encoder_unet`` (``autoseg.model.residual.ResidualEncoderUNet``, nnU-Net's ResEnc family): the same
decoder and heads (one conv block per decoder stage as planned), an encoder of residual blocks.

Input ``(B, in_channels, *spatial)`` with ``spatial`` = ``(Y, X)`` (dim 2) or ``(Z, Y, X)`` (dim 3), each
axis a multiple of ``topology.patch_divisor()``. Output: logits ``(B, num_outputs, *spatial)``; with deep
supervision a list of ``num_stages - 1`` logits, full resolution first, then each coarser decoder output.
Every registered architecture passes the same contract tests (``tests/model/test_network.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from autoseg.core.errors import InputError
from autoseg.model.blocks import UNet, conv_stage
from autoseg.model.residual import ResidualEncoderUNet
from autoseg.model.topology import PLAIN_UNET, RESIDUAL_ENCODER_UNET, NetworkTopology, validate_topology

__all__ = ["NETWORKS", "PlainConvUNet", "ResidualEncoderUNet", "build_network", "validate_topology"]


class PlainConvUNet(UNet):
    """A U-Net of plain conv blocks (see the module docstring and ``UNet`` for the attributes)."""

    def build_encoder(self, topology: NetworkTopology) -> list[nn.Module]:
        features = topology.features_per_stage
        in_channels = [topology.in_channels, *features[:-1]]
        return [
            conv_stage(
                topology.dim,
                in_channels[s],
                features[s],
                topology.kernel_sizes[s],
                topology.strides[s],
                topology.conv_per_stage,
            )
            for s in range(topology.num_stages)
        ]


NETWORKS: dict[str, Callable[[NetworkTopology, bool], nn.Module]] = {
    PLAIN_UNET: PlainConvUNet,
    RESIDUAL_ENCODER_UNET: ResidualEncoderUNet,
}


def build_network(topology: NetworkTopology, checkpointing: bool = False) -> nn.Module:
    """Create the network the topology names (``topology.architecture``, a key of ``NETWORKS``), freshly
    initialized."""
    if topology.architecture not in NETWORKS:
        raise InputError(
            f"network architecture {topology.architecture!r} (the 'network' entry of a configuration "
            f"in plans.json) is not known; use one of {sorted(NETWORKS)}"
        )
    return NETWORKS[topology.architecture](topology, checkpointing)
