"""The network an nnU-Net v2 configuration names, as autoseg's ``NetworkTopology``: a PlainConvUNet that autoseg's
``plain_unet`` builds exactly, a ResidualEncoderUNet (BasicBlockD, nnU-Net's ResEnc presets) that autoseg's
``residual_encoder_unet`` builds exactly (``autoseg.nnunet.checkpoint`` maps the weights), or a refusal naming the
key that differs.

Two plans layouts name it: ``architecture`` (``network_class_name`` and ``arch_kwargs``, nnU-Net 2.4 on) and the
older ``UNet_class_name`` with ``UNet_base_num_features``, ``unet_max_num_features``, ``conv_kernel_sizes``,
``pool_op_kernel_sizes``, ``n_conv_per_stage_encoder`` (a ResidualEncoderUNet's blocks per stage) and
``n_conv_per_stage_decoder`` (its convolutions, norm and nonlinearity were fixed: those autoseg builds).
"""

from __future__ import annotations

from typing import Any

from autoseg.core.errors import InputError
from autoseg.model.topology import PLAIN_UNET, RESIDUAL_ENCODER_UNET, NetworkTopology

PLAIN_CONV_UNET = "PlainConvUNet"
RESIDUAL_ENCODER = "ResidualEncoderUNet"
ARCHITECTURE_OF = {PLAIN_CONV_UNET: PLAIN_UNET, RESIDUAL_ENCODER: RESIDUAL_ENCODER_UNET}  # nnU-Net's -> autoseg's
NNUNET_CLASS_OF = {v: k for k, v in ARCHITECTURE_OF.items()}
BASIC_BLOCK = "BasicBlockD"
INSTANCE_NORM = "torch.nn.modules.instancenorm.InstanceNorm{dim}d"
CONV = "torch.nn.modules.conv.Conv{dim}d"
LEAKY_RELU = ("torch.nn.LeakyReLU", "torch.nn.modules.activation.LeakyReLU")
NORM_EPS = 1e-5
LEAKY_SLOPE = 1e-2


def network_class(config: dict[str, Any]) -> str:
    """The short name of the network class nnU-Net's configuration ``config`` names (either plans layout)."""
    name = config["architecture"].get("network_class_name", "") if "architecture" in config else None
    return str(name if name is not None else config.get("UNet_class_name", "")).rsplit(".", 1)[-1]


def topology_of(config: dict[str, Any], dim: int, in_channels: int, num_outputs: int, where: str) -> NetworkTopology:
    """The ``plain_unet`` or ``residual_encoder_unet`` topology of nnU-Net's configuration ``config`` (``dim``
    spatial axes)."""
    kwargs = _arch_kwargs(config, where)
    n = int(kwargs["n_stages"])
    residual = network_class(config) == RESIDUAL_ENCODER
    encoder, decoder = (
        list(kwargs["n_blocks_per_stage" if residual else "n_conv_per_stage"]),
        list(kwargs["n_conv_per_stage_decoder"]),
    )
    counts = decoder if residual else encoder + decoder
    if len(set(counts)) != 1 or len(encoder) != n or len(decoder) != n - 1 or min(encoder) < 1:
        raise InputError(
            f"{where}: {'n_blocks_per_stage' if residual else 'n_conv_per_stage'} {encoder} and "
            f"n_conv_per_stage_decoder {decoder}: autoseg's U-Nets have one conv count for every decoder stage"
            f"{'' if residual else ' and encoder stage'} (one per stage, {n} stages); other counts are not supported"
        )
    _check_layers(kwargs, dim, where)
    if residual:
        _check_residual(kwargs, where)
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=tuple(int(f) for f in kwargs["features_per_stage"]),
        kernel_sizes=tuple(tuple(int(k) for k in ks) for ks in kwargs["kernel_sizes"]),
        strides=tuple(tuple(int(s) for s in st) for st in kwargs["strides"]),
        conv_per_stage=int(decoder[0]),
        deep_supervision=True,
        architecture=ARCHITECTURE_OF[network_class(config)],
        blocks_per_stage=tuple(int(b) for b in encoder) if residual else (),
    )


def _arch_kwargs(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``arch_kwargs`` of a PlainConvUNet or ResidualEncoderUNet in either layout; another network class is
    refused."""
    short = network_class(config)
    if "architecture" in config:
        name = str(config["architecture"].get("network_class_name", ""))
        kwargs = config["architecture"].get("arch_kwargs", {})
    else:  # the older layout: the sizes, with the layers nnU-Net then fixed
        name = str(config.get("UNet_class_name", ""))
        n = len(config.get("conv_kernel_sizes", []))
        base, most = config.get("UNet_base_num_features", 32), config.get("unet_max_num_features", 320)
        kwargs = {
            "n_stages": n,
            "features_per_stage": [min(base * 2**s, most) for s in range(n)],
            "kernel_sizes": config.get("conv_kernel_sizes"),
            "strides": config.get("pool_op_kernel_sizes"),
            "n_blocks_per_stage" if short == RESIDUAL_ENCODER else "n_conv_per_stage": config.get(
                "n_conv_per_stage_encoder"
            ),
            "n_conv_per_stage_decoder": config.get("n_conv_per_stage_decoder"),
        }
    if short not in ARCHITECTURE_OF:
        raise InputError(
            f"{where}: network class {name!r} is not supported; autoseg imports nnU-Net's "
            f"{' and '.join(ARCHITECTURE_OF)}"
        )
    per_stage = "n_blocks_per_stage" if short == RESIDUAL_ENCODER else "n_conv_per_stage"
    missing = [
        k for k in ("n_stages", "features_per_stage", "kernel_sizes", "strides", per_stage) if kwargs.get(k) is None
    ]
    if missing or kwargs.get("n_conv_per_stage_decoder") is None:
        raise InputError(f"{where}: the network's {', '.join(missing) or 'n_conv_per_stage_decoder'} is missing")
    return kwargs


def _check_layers(kwargs: dict[str, Any], dim: int, where: str) -> None:
    """The layers a PlainConvUNet is built of are autoseg's: conv with bias, affine InstanceNorm with eps 1e-5,
    LeakyReLU of slope 0.01 after the norm. Keys of the older layout are absent: it fixed these."""
    differences = []
    if kwargs.get("conv_op", CONV.format(dim=dim)) != CONV.format(dim=dim):
        differences.append(f"conv_op {kwargs['conv_op']} (expected {CONV.format(dim=dim)})")
    if not kwargs.get("conv_bias", True):
        differences.append("conv_bias false")
    if kwargs.get("norm_op", INSTANCE_NORM.format(dim=dim)) != INSTANCE_NORM.format(dim=dim):
        differences.append(f"norm_op {kwargs['norm_op']} (autoseg: InstanceNorm)")
    norm = kwargs.get("norm_op_kwargs") or {"eps": NORM_EPS, "affine": True}
    if abs(float(norm.get("eps", NORM_EPS)) - NORM_EPS) > 1e-12 or not norm.get("affine", False):
        differences.append(f"norm_op_kwargs {norm} (autoseg: eps 1e-05, affine)")
    if kwargs.get("nonlin", LEAKY_RELU[0]) not in LEAKY_RELU:
        differences.append(f"nonlin {kwargs['nonlin']} (autoseg: LeakyReLU)")
    slope = float((kwargs.get("nonlin_kwargs") or {}).get("negative_slope", LEAKY_SLOPE))
    if abs(slope - LEAKY_SLOPE) > 1e-12:
        differences.append(f"LeakyReLU negative_slope {slope} (autoseg: 0.01)")
    if kwargs.get("nonlin_first"):
        differences.append("nonlin_first true (autoseg: norm, then nonlinearity)")
    if differences:
        raise InputError(f"{where}: the network's {'; '.join(differences)}: not supported")


def _check_residual(kwargs: dict[str, Any], where: str) -> None:
    """A ResidualEncoderUNet is autoseg's when its blocks are BasicBlockD and its stem has the first stage's
    features: the arch_kwargs beyond the U-Net's shape at their defaults (BottleneckD, another stem, refused)."""
    block = str(kwargs.get("block") or BASIC_BLOCK).rsplit(".", 1)[-1]
    stem = kwargs.get("stem_channels")
    differences = [f"block {kwargs['block']} (autoseg: {BASIC_BLOCK})"] if block != BASIC_BLOCK else []
    if kwargs.get("bottleneck_channels") is not None:
        differences.append(f"bottleneck_channels {kwargs['bottleneck_channels']} (autoseg: none)")
    if stem is not None and int(stem) != int(kwargs["features_per_stage"][0]):
        differences.append(f"stem_channels {stem} (autoseg: the first stage's {kwargs['features_per_stage'][0]})")
    if differences:
        raise InputError(f"{where}: the {RESIDUAL_ENCODER}'s {'; '.join(differences)}: not supported")
