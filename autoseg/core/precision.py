"""The precisions a plan may name, written once: the autocast dtype and the bytes of one activation element.

``fp32``: no autocast. ``bf16`` / ``fp16``: autocast on the training (or inference) device with fp32 master
weights; fp16 adds a ``GradScaler`` on CUDA.
"""

from __future__ import annotations

import torch

from autoseg.core.errors import InputError

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: fp32, no autocast); an unknown name says what to use."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not known; use one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def element_bytes(precision: str) -> int:
    """Bytes of one activation element computed at ``precision`` (2 under autocast, else 4)."""
    dtype = autocast_dtype(precision)
    return 4 if dtype is None else dtype.itemsize


def effective_precision(precision: str, device_type: str) -> str:
    """The precision a planned ``precision`` runs at on ``device_type``: autocast (bf16/fp16) on CUDA only; CPU
    training and prediction run in fp32."""
    autocast_dtype(precision)  # an unknown name fails here
    return precision if device_type == "cuda" else "fp32"
