"""Byte units, written once."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def format_bytes(n: int | float) -> str:
    """``1.23 GiB`` from 1 GiB up, ``123.4 MiB`` from 1 MiB up, else ``12.3 KiB``."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if abs(n) >= MiB else f"{n / KiB:.1f} KiB"
