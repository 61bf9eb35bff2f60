"""``NetworkTopology``: the shape of a configuration's network as the plan states it (``network`` in plans.json)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NetworkTopology:
    """The network of a configuration: ``architecture`` names a constructor in ``autoseg.model.network.NETWORKS``
    (``plain_unet``: nnU-Net's PlainConvUNet shape), built by ``autoseg.model.network.build_network``.

    ``kernel_sizes[s]`` and ``strides[s]`` belong to encoder stage ``s``; ``strides[0]`` is all ones.
    Each stage holds ``conv_per_stage`` (conv -> InstanceNorm -> LeakyReLU) blocks, the first one strided.
    """

    dim: int  # 2 or 3 (number of spatial axes)
    in_channels: int
    num_outputs: int  # network output channels: LabelScheme.num_outputs (classes with background, or regions)
    features_per_stage: tuple[int, ...]
    kernel_sizes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]
    conv_per_stage: int = 2
    deep_supervision: bool = True
    architecture: str = "plain_unet"

    @property
    def num_stages(self) -> int:
        return len(self.features_per_stage)

    def patch_divisor(self) -> tuple[int, ...]:
        """Patch sizes must be multiples of this (the product of strides per axis)."""
        div = [1] * self.dim
        for s in self.strides:
            div = [d * k for d, k in zip(div, s)]
        return tuple(div)
