"""nnU-Net v2's ``fold_N/checkpoint_final.pth``: read with ``torch.load(weights_only=True)`` and its
``network_weights`` mapped onto autoseg's ``plain_unet`` (nnU-Net's PlainConvUNet) or ``residual_encoder_unet``
(nnU-Net's ResidualEncoderUNet).

nnU-Net pickles numpy scalars (its logged Dice and EMA) beside the tensors, which ``weights_only`` refuses unless
allowed: ``NUMPY_GLOBALS`` allows numpy's scalar constructor and its plain dtypes, nothing else, so a checkpoint that
pickles any other object (code) is refused, never run.

nnU-Net's PlainConvUNet (dynamic_network_architectures) against autoseg's ``plain_unet``, module for module::

    encoder.stages.{s}.0.convs.{k}.conv / .norm     encoder.{s}.{k}.0 / .1
    decoder.transpconvs.{i}                          decoder.{n-2-i}.upsample
    decoder.stages.{i}.convs.{k}.conv / .norm       decoder.{n-2-i}.convs.{k}.0 / .1
    decoder.seg_layers.{i}                           seg_heads.{n-2-i}

nnU-Net's ResidualEncoderUNet has the same decoder; its encoder (a stem, then stages of BasicBlockD) against
autoseg's ``residual_encoder_unet`` (the stem is the first module of autoseg's stage 0)::

    encoder.stem.convs.0.conv / .norm                       encoder.0.0.0 / .1
    encoder.stages.{s}.blocks.{b}.conv1|conv2.conv / .norm  encoder.{s}.{b'}.conv1|conv2.0 / .1   (b' = b + [s == 0])
    encoder.stages.{s}.blocks.{b}.skip.{j}.conv / .norm     encoder.{s}.{b'}.skip.{j} / .{j + 1}  (j = 1 after a pool)

The one difference: BasicBlockD's 1x1 skip conv has no bias, autoseg's has one. It is set to zero, which is exact:
the InstanceNorm right after it subtracts each channel's mean, a constant per channel included.

nnU-Net's decoder counts from the bottleneck up, autoseg's from full resolution down. Its state dict holds each conv
and norm twice more (``...convs.{k}.all_modules.{j}`` and, through the decoder's reference to the encoder,
``decoder.encoder.*``): aliases of the same tensors, checked equal to the ones mapped and otherwise left out.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoseg.core.errors import InputError

_NUMPY_CORE = getattr(np, "_core", None) or np.core
NUMPY_GLOBALS = [
    _NUMPY_CORE.multiarray.scalar,
    np.dtype,
    *(type(np.dtype(t)) for t in ("float64", "float32", "float16", "int64", "int32", "bool")),
]
_ALIASES = (re.compile(r"^decoder\.encoder\."), re.compile(r"\.all_modules\.\d+\."))
_ENCODER = re.compile(r"^encoder\.stages\.(\d+)\.0\.convs\.(\d+)\.(conv|norm)\.(\w+)$")
_DECODER = re.compile(r"^decoder\.stages\.(\d+)\.convs\.(\d+)\.(conv|norm)\.(\w+)$")
_UPSAMPLE = re.compile(r"^decoder\.transpconvs\.(\d+)\.(\w+)$")
_SEG = re.compile(r"^decoder\.seg_layers\.(\d+)\.(\w+)$")
_STEM = re.compile(r"^encoder\.stem\.convs\.0\.(conv|norm)\.(\w+)$")
_BLOCK = re.compile(r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.(conv1|conv2)\.(conv|norm)\.(\w+)$")
_SKIP = re.compile(r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.skip\.(\d+)\.(conv|norm)\.(\w+)$")
_SKIP_CONV_BIAS = re.compile(r"^encoder\.\d+\.\d+\.skip\.\d+\.bias$")  # autoseg's; conv or norm: see the weight
_LAYER = {"conv": 0, "norm": 1}


def read_nnunet_checkpoint(path: Path) -> dict[str, Any]:
    """The dict nnU-Net saved in ``path`` (``network_weights``, ``inference_allowed_mirroring_axes``, ...), on the
    CPU, read with ``weights_only=True`` allowing only ``NUMPY_GLOBALS`` beyond torch's own types."""
    if not path.is_file():
        raise InputError(
            f"{path}: no such checkpoint; the nnU-Net model folder must hold fold_N/checkpoint_final.pth for each "
            "fold imported (train it to the end with nnU-Net, or leave the fold out of --folds)"
        )
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), str(e))
        raise InputError(
            f"{path}: refused: it pickles objects other than tensors, numbers and numpy scalars ({reason[:300]}), "
            "which could run code when loaded; only checkpoints nnU-Net's trainer writes are imported"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise InputError(f"{path}: not a readable checkpoint, probably truncated or corrupt ({reason})") from e
    if not isinstance(state, dict) or not isinstance(state.get("network_weights"), dict):
        raise InputError(
            f"{path}: holds no 'network_weights' dict; this is not a checkpoint written by nnU-Net v2's trainer"
        )
    return state


def autoseg_key(key: str, num_stages: int, residual: bool = False) -> str | None:
    """The autoseg ``plain_unet`` (``residual``: ``residual_encoder_unet``) state-dict key of the nnU-Net
    PlainConvUNet's (ResidualEncoderUNet's) ``key``; None for a key no mapping names (an alias, or a module autoseg's
    network does not have)."""
    encoder = _residual_encoder_key(key) if residual else _plain_encoder_key(key)
    if encoder is not None:
        return encoder
    if m := _DECODER.match(key):
        i, k, layer, p = m.groups()
        return f"decoder.{num_stages - 2 - int(i)}.convs.{k}.{_LAYER[layer]}.{p}"
    if m := _UPSAMPLE.match(key):
        i, p = m.groups()
        return f"decoder.{num_stages - 2 - int(i)}.upsample.{p}"
    if m := _SEG.match(key):
        i, p = m.groups()
        return f"seg_heads.{num_stages - 2 - int(i)}.{p}"
    return None


def _plain_encoder_key(key: str) -> str | None:
    if m := _ENCODER.match(key):
        s, k, layer, p = m.groups()
        return f"encoder.{s}.{k}.{_LAYER[layer]}.{p}"
    return None


def _residual_encoder_key(key: str) -> str | None:
    if m := _STEM.match(key):
        layer, p = m.groups()
        return f"encoder.0.0.{_LAYER[layer]}.{p}"
    if m := _BLOCK.match(key):
        s, b, conv, layer, p = m.groups()
        return f"encoder.{s}.{int(b) + (s == '0')}.{conv}.{_LAYER[layer]}.{p}"
    if m := _SKIP.match(key):
        s, b, j, layer, p = m.groups()
        return f"encoder.{s}.{int(b) + (s == '0')}.skip.{int(j) + _LAYER[layer]}.{p}"
    return None


def _zero_skip_biases(expected: dict[str, torch.Tensor], mapped: dict[str, tuple[str, torch.Tensor]]) -> None:
    """The biases of autoseg's skip convs, which BasicBlockD's lack, as zeros (exact before InstanceNorm)."""
    for key, tensor in expected.items():
        is_conv = _SKIP_CONV_BIAS.match(key) and expected[key.removesuffix("bias") + "weight"].dim() > 2
        if is_conv and key not in mapped:
            mapped[key] = ("(zero: BasicBlockD's skip conv has no bias)", torch.zeros_like(tensor))


def _is_alias(key: str) -> bool:
    return any(pattern.search(key) for pattern in _ALIASES)


def map_state_dict(
    weights: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    num_stages: int,
    path: Path,
    network_class: str = "PlainConvUNet",
) -> dict[str, torch.Tensor]:
    """nnU-Net's ``weights`` of a ``network_class`` (PlainConvUNet or ResidualEncoderUNet) as the state dict of
    autoseg's network whose own state dict is ``expected`` (its keys and shapes). Refused, naming the keys: a weight
    no mapping names that is not an alias, a weight of autoseg's network that nnU-Net's lacks, a shape that
    differs."""
    weights = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}  # a torch.compile'd network's names
    residual = network_class == "ResidualEncoderUNet"
    mapped, unknown = {}, []
    for key, tensor in weights.items():
        target = autoseg_key(key, num_stages, residual)
        if target is None and not _is_alias(key):
            unknown.append(key)
        elif target is not None:
            mapped[target] = (key, tensor)
    where = f"{path}: its network_weights do not fit the {network_class} that plans.json describes"
    if unknown:
        raise InputError(
            f"{where}: weight(s) {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''} belong to no module of a "
            f"{network_class} with convolutional downsampling (another architecture, pooling or extra layers are "
            "not supported)"
        )
    if residual:
        _zero_skip_biases(expected, mapped)
    missing = [k for k in expected if k not in mapped]
    if missing:
        raise InputError(f"{where}: no weight for {', '.join(missing[:4])} (plans.json names more stages or convs)")
    wrong = [
        f"{mapped[k][0]} {tuple(mapped[k][1].shape)} (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if tuple(mapped[k][1].shape) != tuple(v.shape)
    ]
    extra = sorted(set(mapped) - set(expected))
    if wrong or extra:
        detail = ", ".join(wrong[:3]) or f"{', '.join(mapped[k][0] for k in extra[:4])} beyond the planned stages"
        raise InputError(f"{where}: {detail}; the checkpoint and plans.json disagree")
    _check_aliases(weights, mapped, path)
    return {k: mapped[k][1].detach().clone() for k in expected}


def _check_aliases(weights: dict[str, torch.Tensor], mapped: dict[str, tuple[str, torch.Tensor]], path: Path) -> None:
    """Each alias holds the tensor of the key it aliases (so leaving it out loses nothing)."""
    canonical = {source: tensor for source, tensor in mapped.values()}
    for key, tensor in weights.items():
        if not _is_alias(key):
            continue
        plain = _ALIASES[0].sub("encoder.", key)
        # all_modules.0 is the conv; the only other module with weights is the norm (dropout and nonlinearity have none)
        plain = re.sub(r"\.all_modules\.(\d+)\.", lambda m: ".conv." if m.group(1) == "0" else ".norm.", plain)
        if plain in canonical and not torch.equal(canonical[plain], tensor):
            raise InputError(
                f"{path}: weight {key} differs from {plain}, which it should alias; the checkpoint is corrupt"
            )
