"""The precisions a plan may name, written once: the autocast dtype and the bytes of one activation element.

``fp32``: no autocast. ``bf16`` / ``fp16``: autocast on the training (or inference) device with fp32 master
weights; fp16 adds a ``GradScaler`` on CUDA. Prediction on the CPU may ask for bf16 where the CPU computes it
natively (``check_cpu_precision``: AVX-512 BF16 or AMX, from /proc/cpuinfo's flags). The table names torch's
dtypes, so that a plan is checked and sized without importing torch; ``autocast_dtype`` imports it.
"""

from __future__ import annotations

from pathlib import Path
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


CPUINFO = Path("/proc/cpuinfo")  # where Linux lists the CPU's instruction-set flags
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # either gives the CPU bf16 arithmetic in hardware


def native_bf16_flag(cpuinfo: Path | None = None) -> str | None:
    """The first of ``NATIVE_BF16_FLAGS`` that ``cpuinfo`` (default ``CPUINFO``) lists; None when it lists neither or
    cannot be read (not Linux)."""
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return None
    flags = {word for line in text.splitlines() if line.startswith("flags") for word in line.split()}
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def check_cpu_precision(precision: str, cpuinfo: Path | None = None) -> str:
    """``precision`` if the CPU computes in it: fp32 always, bf16 where ``native_bf16_flag`` finds a flag; fp16 and
    bf16 without the flags are refused, saying so."""
    check_precision(precision)
    if precision == "fp16":
        raise InputError("--precision fp16 runs on CUDA only; on the CPU use fp32, or bf16 where the CPU has it")
    if precision == "bf16" and native_bf16_flag(cpuinfo) is None:
        raise InputError(
            f"--precision bf16 needs a CPU with native bf16 ({' or '.join(NATIVE_BF16_FLAGS)} in "
            f"{cpuinfo or CPUINFO}'s flags), which this one lacks; predict with --precision fp32"
        )
    return precision
