"""The network an nnU-Net v2 configuration names, as autoseg's ``NetworkTopology``: a PlainConvUNet that autoseg's
``plain_unet`` builds exactly, or a refusal naming the key that differs.

Two plans layouts name it: ``architecture`` (``network_class_name`` and ``arch_kwargs``, nnU-Net 2.4 on) and the
older ``UNet_class_name`` with ``UNet_base_num_features``, ``unet_max_num_features``, ``conv_kernel_sizes``,
``pool_op_kernel_sizes``, ``n_conv_per_stage_encoder`` and ``n_conv_per_stage_decoder`` (its convolutions, norm and
nonlinearity were fixed: those autoseg builds).
"""

from __future__ import annotations

from typing import Any

from autoseg.core.errors import InputError
from autoseg.model.topology import PLAIN_UNET, NetworkTopology

PLAIN_CONV_UNET = "PlainConvUNet"
NOT_YET = ("ResidualEncoderUNet", "ResidualUNet")  # nnU-Net's residual U-Nets: refused as not supported yet
INSTANCE_NORM = "torch.nn.modules.instancenorm.InstanceNorm{dim}d"
CONV = "torch.nn.modules.conv.Conv{dim}d"
LEAKY_RELU = ("torch.nn.LeakyReLU", "torch.nn.modules.activation.LeakyReLU")
NORM_EPS = 1e-5
LEAKY_SLOPE = 1e-2


def topology_of(config: dict[str, Any], dim: int, in_channels: int, num_outputs: int, where: str) -> NetworkTopology:
    """The ``plain_unet`` topology of nnU-Net's configuration ``config`` (``dim`` spatial axes)."""
    kwargs = _arch_kwargs(config, where)
    n = int(kwargs["n_stages"])
    encoder, decoder = list(kwargs["n_conv_per_stage"]), list(kwargs["n_conv_per_stage_decoder"])
    if len(set(encoder + decoder)) != 1 or len(encoder) != n or len(decoder) != n - 1:
        raise InputError(
            f"{where}: n_conv_per_stage {encoder} and n_conv_per_stage_decoder {decoder}: autoseg's plain U-Net "
            "has one conv count for every encoder and decoder stage; a network with different counts is not supported"
        )
    _check_layers(kwargs, dim, where)
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=tuple(int(f) for f in kwargs["features_per_stage"]),
        kernel_sizes=tuple(tuple(int(k) for k in ks) for ks in kwargs["kernel_sizes"]),
        strides=tuple(tuple(int(s) for s in st) for st in kwargs["strides"]),
        conv_per_stage=int(encoder[0]),
        deep_supervision=True,
        architecture=PLAIN_UNET,
    )


def _arch_kwargs(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``arch_kwargs`` of a PlainConvUNet in either layout; another network class is refused."""
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
            "n_conv_per_stage": config.get("n_conv_per_stage_encoder"),
            "n_conv_per_stage_decoder": config.get("n_conv_per_stage_decoder"),
        }
    short = name.rsplit(".", 1)[-1]
    if short != PLAIN_CONV_UNET:
        later = " yet" if short in NOT_YET else ""
        raise InputError(
            f"{where}: network class {name!r} is not supported{later}; autoseg imports nnU-Net's {PLAIN_CONV_UNET}"
        )
    missing = [
        k
        for k in ("n_stages", "features_per_stage", "kernel_sizes", "strides", "n_conv_per_stage")
        if kwargs.get(k) is None
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
