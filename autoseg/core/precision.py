"""The precisions a plan may name, written once: the autocast dtype and the bytes of one activation element.

``fp32``: no autocast. ``bf16`` / ``fp16``: autocast on the training (or inference) device with fp32 master
weights; fp16 adds a ``GradScaler`` on CUDA. The table names torch's dtypes, so that a plan is checked and sized
without importing torch; ``autocast_dtype`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoseg.core.errors import InputError

if TYPE_CHECKING:
    import torch

PRECISIONS: dict[str, str | None] = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # autocast dtype in torch


def check_precision(precision: str) -> str:
    """``precision`` if it is a key of ``PRECISIONS``; an unknown name says what to use."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not known; use one of {sorted(PRECISIONS)}")
    return precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: fp32, no autocast); an unknown name says what to use."""
    name = PRECISIONS[check_precision(precision)]
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def element_bytes(precision: str) -> int:
    """Bytes of one activation element computed at ``precision`` (2 under autocast: bf16 and fp16, else 4)."""
    return 4 if PRECISIONS[check_precision(precision)] is None else 2


def effective_precision(precision: str, device_type: str) -> str:
    """The precision a planned ``precision`` runs at on ``device_type``: autocast (bf16/fp16) on CUDA only; CPU
    training and prediction run in fp32."""
    check_precision(precision)  # an unknown name fails here
    return precision if device_type == "cuda" else "fp32"
