"""What every U-Net of the registry shares: the conv block, the decoder stage, and ``UNet``, the skeleton that
holds an encoder (given by the architecture) and builds the decoder, the segmentation heads and the forward pass.

``UNet`` keeps the module names the memory model and ``autoseg explain`` read (``encoder.s``, ``decoder.s``,
``seg_heads.s``: one entry per stage, see ``autoseg.memory.training_simulation.stage_modules``), so an
architecture differs only in what its encoder stages hold.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoseg.model.slabs import conv_of_upsampled_and_skip, run_module, transposed_into
from autoseg.model.topology import NetworkTopology, validate_topology

CONV = {2: nn.Conv2d, 3: nn.Conv3d}
TRANSPOSED_CONV = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
INSTANCE_NORM = {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
AVG_POOL = {2: nn.AvgPool2d, 3: nn.AvgPool3d}
_CONV_TYPES = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def conv_norm(
    dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...], stride: tuple[int, ...] | int = 1
) -> list[nn.Module]:
    """Conv(kernel, padding k // 2, bias) -> InstanceNorm(affine), as a list of modules."""
    return [
        CONV[dim](
            in_channels, out_channels, tuple(kernel), stride=stride, padding=tuple(k // 2 for k in kernel), bias=True
        ),
        INSTANCE_NORM[dim](out_channels, eps=1e-5, affine=True),
    ]


def conv_block(
    dim: int, in_channels: int, out_channels: int, kernel: tuple[int, ...], stride: tuple[int, ...] | int = 1
) -> nn.Sequential:
    """Conv(kernel, padding k // 2, bias) -> InstanceNorm(affine) -> LeakyReLU(0.01)."""
    return nn.Sequential(
        *conv_norm(dim, in_channels, out_channels, kernel, stride), nn.LeakyReLU(negative_slope=0.01, inplace=True)
    )


def conv_stage(
    dim: int,
    in_channels: int,
    out_channels: int,
    kernel: tuple[int, ...],
    first_stride: tuple[int, ...] | int,
    num_convs: int,
) -> nn.Sequential:
    """``num_convs`` conv blocks; only the first one is strided."""
    blocks = [conv_block(dim, in_channels, out_channels, kernel, first_stride)]
    blocks += [conv_block(dim, out_channels, out_channels, kernel) for _ in range(num_convs - 1)]
    return nn.Sequential(*blocks)


class DecoderStage(nn.Module):
    """Upsample the coarser features, concatenate the skip, convolve.

    ``x`` ``(B, in_channels, *coarse)`` and ``skip`` ``(B, skip_channels, *fine)`` with
    ``fine = coarse * stride`` -> ``(B, skip_channels, *fine)``.
    """

    def __init__(
        self,
        dim: int,
        in_channels: int,
        skip_channels: int,
        kernel: tuple[int, ...],
        stride: tuple[int, ...],
        num_convs: int,
    ) -> None:
        super().__init__()
        # kernel = stride: no overlap; with stride 1 this is a 1x1 conv and leaves the size unchanged
        self.upsample = TRANSPOSED_CONV[dim](
            in_channels, skip_channels, kernel_size=tuple(stride), stride=tuple(stride), bias=True
        )
        self.convs = conv_stage(dim, 2 * skip_channels, skip_channels, kernel, 1, num_convs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.convs(torch.cat((self.upsample(x), skip), dim=1))

    def forward_releasing(self, maps: list[torch.Tensor], slab_bytes: int | None = None) -> torch.Tensor:
        """``forward(maps.pop(), maps.pop())`` for inference (no autograd), with fewer maps alive at once: the
        concatenation is allocated first and filled in place, each input released as soon as it is copied
        (``maps`` holds the only references), and the conv blocks' modules run one at a time, so one input and one
        output are alive. The stage's peak, in maps of its output: the concatenation (2), the coarse map and its
        upsampling (1) against ``forward``'s 6 (the concatenation, the conv stage's input held while its blocks
        run, the skip, the upsampling, a conv block's input, output and norm); what that saves on a tile:
        docs/memory.md section 4 (oneDNN's hidden convolution buffers come on top).
        ``slab_bytes``: convolutions larger than this run in slabs, the upsampling straight into the concatenation
        (``autoseg.model.slabs``)."""
        modules = list(_modules_in_order(self.convs))
        merged = conv_of_upsampled_and_skip(modules[0], self.upsample, maps[-1], maps[-2], slab_bytes)
        if merged is not None:  # in slabs: the concatenation never exists whole
            del maps[-2:], modules[0]
        else:
            skip = maps[-2]
            dtype = torch.promote_types(skip.dtype, _upsampled_dtype(maps[-1]))  # torch.cat's
            merged = skip.new_empty((skip.shape[0], 2 * skip.shape[1], *skip.shape[2:]), dtype=dtype)
            del skip
            merged[:, merged.shape[1] // 2 :].copy_(maps.pop(-2))  # the skip, released after the copy
            transposed_into(self.upsample, maps.pop(), merged[:, : merged.shape[1] // 2], slab_bytes)  # coarse map
        for module in modules:
            merged = run_module(module, merged, slab_bytes)  # the input is released as soon as the output exists
        return merged


def run_in_order(module: nn.Module, x: torch.Tensor, slab_bytes: int | None) -> torch.Tensor:
    """``module(x)`` without autograd: its (nested) ``nn.Sequential`` modules called one at a time through
    ``run_module``, each intermediate released as soon as the next output exists."""
    for inner in _modules_in_order(module):
        x = run_module(inner, x, slab_bytes)
    return x


def _upsampled_dtype(coarse: torch.Tensor) -> torch.dtype:
    """The dtype of a transposed convolution's output on ``coarse``: autocast's where it is on, else the input's."""
    device = coarse.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else coarse.dtype


def _modules_in_order(module: nn.Module) -> Iterator[nn.Module]:
    """The modules a (nested) ``nn.Sequential`` calls, in order; any other module is itself."""
    if isinstance(module, nn.Sequential):
        for child in module:
            yield from _modules_in_order(child)
    else:
        yield module


def _run(module: nn.Module, use_checkpoint: bool, *inputs: torch.Tensor) -> torch.Tensor:
    """Call ``module``; with ``use_checkpoint`` keep only its inputs and recompute the inside in backward."""
    if use_checkpoint:
        return checkpoint(module, *inputs, use_reentrant=False)
    return module(*inputs)


class UNet(nn.Module):
    """An encoder (``encoder[s]``: stage ``s``, output ``features_per_stage[s]`` channels at the resolution of
    ``strides[:s + 1]``), a decoder of ``conv_per_stage`` conv blocks per stage and a 1x1 seg head per decoder
    stage. Subclasses build the encoder (``build_encoder``) and may initialize more (``init_weights`` runs first).

    Attributes that may be changed after construction:
      ``deep_supervision``: return all decoder logits (list, full resolution first) or only the full
        resolution tensor; the coarse seg heads are then skipped (their parameters stay, so checkpoints load).
      ``checkpointing``: recompute each encoder and decoder stage in backward instead of storing its
        activations (only in training mode with grads enabled; outputs are unchanged).
      ``slab_bytes``: without autograd, convolutions larger than this run in slabs (``autoseg.model.slabs``; set
        by ``autoseg.model.torch_runner.TorchTileRunner`` on the CPU). None: whole.
    """

    def __init__(self, topology: NetworkTopology, checkpointing: bool = False) -> None:
        super().__init__()
        validate_topology(topology)
        self.topology = topology
        self.deep_supervision = bool(topology.deep_supervision)
        self.checkpointing = bool(checkpointing)
        self.slab_bytes: int | None = None
        dim, features = topology.dim, topology.features_per_stage
        self.encoder = nn.ModuleList(self.build_encoder(topology))
        # decoder[s] and seg_heads[s] work at the resolution of encoder stage s (s = 0 .. num_stages - 2)
        self.decoder = nn.ModuleList(
            DecoderStage(
                dim,
                features[s + 1],
                features[s],
                topology.kernel_sizes[s],
                topology.strides[s + 1],
                topology.conv_per_stage,
            )
            for s in range(topology.num_stages - 1)
        )
        self.seg_heads = nn.ModuleList(
            CONV[dim](features[s], topology.num_outputs, kernel_size=1, bias=True)
            for s in range(topology.num_stages - 1)
        )
        self.apply(init_weights)

    def build_encoder(self, topology: NetworkTopology) -> list[nn.Module]:
        """One module per encoder stage: ``(B, C_in, *size)`` -> ``(B, features_per_stage[s], *size / strides[s])``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``x`` ``(B, in_channels, *spatial)`` -> logits ``(B, num_outputs, *spatial)`` or, with deep
        supervision, a list of ``num_stages - 1`` logits, full resolution first."""
        self._check_input(x)
        use_checkpoint = self.checkpointing and self.training and torch.is_grad_enabled()
        skips, grad = [], torch.is_grad_enabled()
        for stage in self.encoder:
            x = _run(stage, use_checkpoint, x) if grad else run_in_order(stage, x, self.slab_bytes)
            skips.append(x)
        del x  # maps: every stage's output; the last one (the bottleneck's) feeds the lowest decoder stage
        maps, logits = skips, []
        for s in reversed(range(len(self.decoder))):  # each replaces the last two maps with its output
            if grad:  # autograd keeps what backward reads, whatever is released here
                maps.append(_run(self.decoder[s], use_checkpoint, maps.pop(), maps.pop()))
            else:
                maps.append(self.decoder[s].forward_releasing(maps, self.slab_bytes))
            if self.deep_supervision or s == 0:
                logits.append(run_module(self.seg_heads[s], maps[-1], self.slab_bytes))
        return logits[::-1] if self.deep_supervision else logits[-1]

    def _check_input(self, x: torch.Tensor) -> None:
        t = self.topology
        if x.ndim != t.dim + 2 or x.shape[1] != t.in_channels:
            raise ValueError(
                f"network input has shape {tuple(x.shape)}; expected (B, {t.in_channels}, "
                f"{', '.join(['...'] * t.dim)}) for a {t.dim}D network with "
                f"{t.in_channels} channel(s)"
            )
        divisor = t.patch_divisor()
        if any(size % d for size, d in zip(x.shape[2:], divisor, strict=True)):
            raise ValueError(
                f"network input spatial shape {tuple(x.shape[2:])} is not a multiple of "
                f"{divisor} (the product of the strides); pad the input or choose a patch size "
                "that is a multiple of it"
            )


def init_weights(module: nn.Module) -> None:
    """Kaiming-normal (a = 0.01, matching the LeakyReLU slope) conv weights, zero conv biases."""
    if isinstance(module, _CONV_TYPES):
        nn.init.kaiming_normal_(module.weight, a=1e-2)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
