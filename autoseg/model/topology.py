"""``NetworkTopology``: the shape of a configuration's network as the plan states it (``network`` in plans.json),
the architectures a plan may name, and the checks a topology must pass before any network is built."""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError

# The architectures a plan may name (``NetworkTopology.architecture``, keys of ``autoseg.model.network.NETWORKS``)
# and the short names ``autoseg plan --architecture`` takes for them.
PLAIN_UNET = "plain_unet"
RESIDUAL_ENCODER_UNET = "residual_encoder_unet"
ARCHITECTURES = {"unet": PLAIN_UNET, "resenc": RESIDUAL_ENCODER_UNET}

# nnU-Net's ResEnc presets: residual blocks per encoder stage, the first stages' counts (a network of n stages
# takes the first n; stages past the table keep its last count). One conv block per decoder stage.
RESENC_BLOCKS_PER_STAGE = (1, 3, 4, 6, 6, 6)
RESENC_DECODER_CONVS = 1


def resenc_blocks_per_stage(num_stages: int) -> tuple[int, ...]:
    """Residual blocks per encoder stage of a ``num_stages``-stage ResEnc U-Net: (1, 3, 4, 6, 6, 6, 6, ...)[:n]."""
    table = RESENC_BLOCKS_PER_STAGE
    return tuple(table[min(s, len(table) - 1)] for s in range(num_stages))


def preset_fields(architecture: str, num_stages: int) -> dict:
    """The ``NetworkTopology`` fields besides the U-Net's shape that the planner sets for ``architecture``: nnU-Net's
    ResEnc block counts and one conv block per decoder stage for a residual encoder; the defaults for a plain U-Net."""
    if architecture == RESIDUAL_ENCODER_UNET:
        return {
            "architecture": architecture,
            "blocks_per_stage": resenc_blocks_per_stage(num_stages),
            "conv_per_stage": RESENC_DECODER_CONVS,
        }
    return {"architecture": architecture}


@dataclass(frozen=True)
class NetworkTopology:
    """The network of a configuration: ``architecture`` names a constructor in ``autoseg.model.network.NETWORKS``,
    built by ``autoseg.model.network.build_network``:

    - ``plain_unet`` (nnU-Net's PlainConvUNet shape): each encoder and each decoder stage holds
      ``conv_per_stage`` (conv -> InstanceNorm -> LeakyReLU) blocks; ``blocks_per_stage`` is empty.
    - ``residual_encoder_unet`` (nnU-Net's ResEnc family): a stem conv block, then encoder stage ``s`` holds
      ``blocks_per_stage[s]`` residual blocks (two convs and a skip); each decoder stage holds ``conv_per_stage``
      plain conv blocks (1 as planned).

    ``kernel_sizes[s]`` and ``strides[s]`` belong to encoder stage ``s``; ``strides[0]`` is all ones; the first
    conv of each encoder stage is the strided one.
    """

    dim: int  # 2 or 3 (number of spatial axes)
    in_channels: int
    num_outputs: int  # network output channels: LabelScheme.num_outputs (classes with background, or regions)
    features_per_stage: tuple[int, ...]
    kernel_sizes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]
    conv_per_stage: int = 2  # conv blocks per decoder stage (and per encoder stage of a plain_unet)
    deep_supervision: bool = True
    architecture: str = PLAIN_UNET
    blocks_per_stage: tuple[int, ...] = ()  # residual blocks per encoder stage (residual_encoder_unet only)

    @property
    def num_stages(self) -> int:
        return len(self.features_per_stage)

    def patch_divisor(self) -> tuple[int, ...]:
        """Patch sizes must be multiples of this (the product of strides per axis)."""
        div = [1] * self.dim
        for s in self.strides:
            div = [d * k for d, k in zip(div, s)]
        return tuple(div)

    def encoder_convs(self) -> tuple[int, ...]:
        """Convolutions with the stage's kernel per encoder stage (skip projections not counted): ``conv_per_stage``
        for a plain U-Net; 2 per residual block, + 1 for the stem at stage 0, for a residual encoder."""
        if self.architecture == RESIDUAL_ENCODER_UNET:
            return tuple(2 * b + (s == 0) for s, b in enumerate(self.blocks_per_stage))
        return (self.conv_per_stage,) * self.num_stages


def validate_topology(topology: NetworkTopology) -> None:
    """Raise ``InputError`` naming the field of the topology (``network`` in plans.json) that is wrong."""
    where = "NetworkTopology (the 'network' entry of a configuration in plans.json)"
    if topology.dim not in (2, 3):
        raise InputError(f"{where}: dim is {topology.dim}; expected 2 or 3")
    n = topology.num_stages
    if n < 2:
        raise InputError(f"{where}: features_per_stage has {n} stage(s); a U-Net needs at least 2")
    if len(topology.kernel_sizes) != n or len(topology.strides) != n:
        raise InputError(
            f"{where}: features_per_stage has {n} stages but kernel_sizes has "
            f"{len(topology.kernel_sizes)} and strides {len(topology.strides)}; "
            "give one per stage"
        )
    for name in ("kernel_sizes", "strides"):
        for s, values in enumerate(getattr(topology, name)):
            if len(values) != topology.dim or any(v < 1 for v in values):
                raise InputError(
                    f"{where}: {name}[{s}] is {tuple(values)}; expected {topology.dim} "
                    "positive integers (one per spatial axis)"
                )
    for s, kernel in enumerate(topology.kernel_sizes):
        if any(k % 2 == 0 for k in kernel):
            raise InputError(
                f"{where}: kernel_sizes[{s}] is {tuple(kernel)}; kernels must be odd so that "
                "padding k // 2 keeps the spatial size"
            )
    if any(v != 1 for v in topology.strides[0]):
        raise InputError(
            f"{where}: strides[0] is {tuple(topology.strides[0])}; the first stage works at "
            "full resolution, so its stride must be all ones"
        )
    if min(topology.features_per_stage) < 1 or topology.in_channels < 1 or topology.num_outputs < 1:
        raise InputError(
            f"{where}: features_per_stage {topology.features_per_stage}, in_channels "
            f"{topology.in_channels} and num_outputs {topology.num_outputs} must all be >= 1"
        )
    if topology.conv_per_stage < 1:
        raise InputError(f"{where}: conv_per_stage is {topology.conv_per_stage}; expected >= 1")
    _check_blocks(topology, where)


def _check_blocks(topology: NetworkTopology, where: str) -> None:
    blocks = tuple(topology.blocks_per_stage)
    if topology.architecture == RESIDUAL_ENCODER_UNET:
        if len(blocks) != topology.num_stages or min(blocks) < 1:
            raise InputError(
                f"{where}: blocks_per_stage is {list(blocks)}; a {RESIDUAL_ENCODER_UNET} needs one "
                f"count >= 1 per stage ({topology.num_stages}), e.g. nnU-Net's "
                f"{list(resenc_blocks_per_stage(topology.num_stages))}"
            )
    elif blocks:
        raise InputError(
            f"{where}: blocks_per_stage is {list(blocks)} but architecture {topology.architecture!r} "
            f"has no residual blocks; set it to [] (or the architecture to {RESIDUAL_ENCODER_UNET!r})"
        )
