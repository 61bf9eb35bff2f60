"""The segmentation network: a plain-convolution U-Net built from a ``NetworkTopology``.

Shape of the network (the same as nnU-Net's PlainConvUNet, written here from its description)::

    encoder stage s : conv_per_stage x [Conv(k_s; the first strided by strides[s]) -> InstanceNorm -> LReLU]
    decoder stage s : TransposedConv(kernel = stride = strides[s+1]) from stage s+1,
                      concat with the skip of encoder stage s,
                      conv_per_stage x [Conv(k_s) -> InstanceNorm -> LeakyReLU]
    seg head s      : 1x1 Conv -> num_outputs logits at the resolution of encoder stage s

Input ``(B, in_channels, *spatial)`` with ``spatial`` = ``(Y, X)`` (dim 2) or ``(Z, Y, X)`` (dim 3), each
axis a multiple of ``topology.patch_divisor()``. Output: logits ``(B, num_outputs, *spatial)``; with deep
supervision a list of ``num_stages - 1`` logits, full resolution first, then each coarser decoder output.

Networks are created through ``build_network``, which builds the ``architecture`` the topology (the plan) names;
new architectures register a constructor in ``NETWORKS``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoseg.core.errors import InputError
from autoseg.model.topology import NetworkTopology

_CONV = {2: nn.Conv2d, 3: nn.Conv3d}
_TRANSPOSED_CONV = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_INSTANCE_NORM = {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_CONV_TYPES = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def validate_topology(topology: NetworkTopology) -> None:
    """Raise ``ValueError`` naming the field of the topology (``network`` in plans.json) that is wrong."""
    where = "NetworkTopology (the 'network' entry of a configuration in plans.json)"
    if topology.dim not in (2, 3):
        raise InputError(f"{where}: dim is {topology.dim}; expected 2 or 3")
    n = topology.num_stages
    if n < 2:
        raise InputError(f"{where}: features_per_stage has {n} stage(s); a U-Net needs at least 2")
    if len(topology.kernel_sizes) != n or len(topology.strides) != n:
        raise InputError(f"{where}: features_per_stage has {n} stages but kernel_sizes has "
                         f"{len(topology.kernel_sizes)} and strides {len(topology.strides)}; "
                         "give one per stage")
    for name in ("kernel_sizes", "strides"):
        for s, values in enumerate(getattr(topology, name)):
            if len(values) != topology.dim or any(v < 1 for v in values):
                raise InputError(f"{where}: {name}[{s}] is {tuple(values)}; expected {topology.dim} "
                                 "positive integers (one per spatial axis)")
    for s, kernel in enumerate(topology.kernel_sizes):
        if any(k % 2 == 0 for k in kernel):
            raise InputError(f"{where}: kernel_sizes[{s}] is {tuple(kernel)}; kernels must be odd so that "
                             "padding k // 2 keeps the spatial size")
    if any(v != 1 for v in topology.strides[0]):
        raise InputError(f"{where}: strides[0] is {tuple(topology.strides[0])}; the first stage works at "
                         "full resolution, so its stride must be all ones")
    if min(topology.features_per_stage) < 1 or topology.in_channels < 1 or topology.num_outputs < 1:
        raise InputError(f"{where}: features_per_stage {topology.features_per_stage}, in_channels "
                         f"{topology.in_channels} and num_outputs {topology.num_outputs} must all be >= 1")
    if topology.conv_per_stage < 1:
        raise InputError(f"{where}: conv_per_stage is {topology.conv_per_stage}; expected >= 1")


def conv_block(dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...],
               stride: tuple[int, ...] | int = 1) -> nn.Sequential:
    """Conv(kernel, padding k // 2, bias) -> InstanceNorm(affine) -> LeakyReLU(0.01)."""
    return nn.Sequential(
        _CONV[dim](in_channels, out_channels, tuple(kernel), stride=stride,
                   padding=tuple(k // 2 for k in kernel), bias=True),
        _INSTANCE_NORM[dim](out_channels, eps=1e-5, affine=True),
        nn.LeakyReLU(negative_slope=0.01, inplace=True),
    )


def conv_stage(dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...],
               first_stride: tuple[int, ...] | int, num_convs: int) -> nn.Sequential:
    """``num_convs`` conv blocks; only the first one is strided."""
    blocks = [conv_block(dim, in_channels, out_channels, kernel, first_stride)]
    blocks += [conv_block(dim, out_channels, out_channels, kernel) for _ in range(num_convs - 1)]
    return nn.Sequential(*blocks)


class DecoderStage(nn.Module):
    """Upsample the coarser features, concatenate the skip, convolve.

    ``x`` ``(B, in_channels, *coarse)`` and ``skip`` ``(B, skip_channels, *fine)`` with
    ``fine = coarse * stride`` -> ``(B, skip_channels, *fine)``.
    """

    def __init__(self, dim: int, in_channels: int, skip_channels: int, kernel: tuple[int, ...],
                 stride: tuple[int, ...], num_convs: int) -> None:
        super().__init__()
        # kernel = stride: no overlap; with stride 1 this is a 1x1 conv and leaves the size unchanged
        self.upsample = _TRANSPOSED_CONV[dim](in_channels, skip_channels, kernel_size=tuple(stride),
                                              stride=tuple(stride), bias=True)
        self.convs = conv_stage(dim, 2 * skip_channels, skip_channels, kernel, 1, num_convs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.convs(torch.cat((self.upsample(x), skip), dim=1))


def _run(module: nn.Module, use_checkpoint: bool, *inputs: torch.Tensor) -> torch.Tensor:
    """Call ``module``; with ``use_checkpoint`` keep only its inputs and recompute the inside in backward."""
    if use_checkpoint:
        return checkpoint(module, *inputs, use_reentrant=False)
    return module(*inputs)


class PlainConvUNet(nn.Module):
    """A U-Net of plain conv blocks (see the module docstring).

    Attributes that may be changed after construction:
      ``deep_supervision``: return all decoder logits (list, full resolution first) or only the full
        resolution tensor; the coarse seg heads are then skipped (their parameters stay, so checkpoints load).
      ``checkpointing``: recompute each encoder and decoder stage in backward instead of storing its
        activations (only in training mode with grads enabled; outputs are unchanged).
    """

    def __init__(self, topology: NetworkTopology, checkpointing: bool = False) -> None:
        super().__init__()
        validate_topology(topology)
        self.topology = topology
        self.deep_supervision = bool(topology.deep_supervision)
        self.checkpointing = bool(checkpointing)
        dim, features = topology.dim, topology.features_per_stage
        in_channels = [topology.in_channels, *features[:-1]]
        self.encoder = nn.ModuleList(
            conv_stage(dim, in_channels[s], features[s], topology.kernel_sizes[s], topology.strides[s],
                       topology.conv_per_stage)
            for s in range(topology.num_stages)
        )
        # decoder[s] and seg_heads[s] work at the resolution of encoder stage s (s = 0 .. num_stages - 2)
        self.decoder = nn.ModuleList(
            DecoderStage(dim, features[s + 1], features[s], topology.kernel_sizes[s], topology.strides[s + 1],
                         topology.conv_per_stage)
            for s in range(topology.num_stages - 1)
        )
        self.seg_heads = nn.ModuleList(
            _CONV[dim](features[s], topology.num_outputs, kernel_size=1, bias=True)
            for s in range(topology.num_stages - 1)
        )
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``x`` ``(B, in_channels, *spatial)`` -> logits ``(B, num_outputs, *spatial)`` or, with deep
        supervision, a list of ``num_stages - 1`` logits, full resolution first."""
        self._check_input(x)
        use_checkpoint = self.checkpointing and self.training and torch.is_grad_enabled()
        skips = []
        for stage in self.encoder:
            x = _run(stage, use_checkpoint, x)
            skips.append(x)
        x = skips.pop()  # the bottleneck output feeds the lowest decoder stage
        logits: list[torch.Tensor] = []
        for s in reversed(range(len(self.decoder))):
            x = _run(self.decoder[s], use_checkpoint, x, skips[s])
            if self.deep_supervision or s == 0:
                logits.append(self.seg_heads[s](x))
        return logits[::-1] if self.deep_supervision else logits[-1]

    def _check_input(self, x: torch.Tensor) -> None:
        t = self.topology
        if x.ndim != t.dim + 2 or x.shape[1] != t.in_channels:
            raise ValueError(f"network input has shape {tuple(x.shape)}; expected (B, {t.in_channels}, "
                             f"{', '.join(['...'] * t.dim)}) for a {t.dim}D network with "
                             f"{t.in_channels} channel(s)")
        divisor = t.patch_divisor()
        if any(size % d for size, d in zip(x.shape[2:], divisor, strict=True)):
            raise ValueError(f"network input spatial shape {tuple(x.shape[2:])} is not a multiple of "
                             f"{divisor} (the product of the strides); pad the input or choose a patch size "
                             "that is a multiple of it")


def init_weights(module: nn.Module) -> None:
    """Kaiming-normal (a = 0.01, matching the LeakyReLU slope) conv weights, zero conv biases."""
    if isinstance(module, _CONV_TYPES):
        nn.init.kaiming_normal_(module.weight, a=1e-2)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


NETWORKS: dict[str, Callable[[NetworkTopology, bool], nn.Module]] = {
    "plain_unet": PlainConvUNet,
}


def build_network(topology: NetworkTopology, checkpointing: bool = False) -> nn.Module:
    """Create the network the topology names (``topology.architecture``, a key of ``NETWORKS``), freshly
    initialized."""
    if topology.architecture not in NETWORKS:
        raise InputError(f"network architecture {topology.architecture!r} (the 'network' entry of a configuration "
                         f"in plans.json) is not known; use one of {sorted(NETWORKS)}")
    return NETWORKS[topology.architecture](topology, checkpointing)
