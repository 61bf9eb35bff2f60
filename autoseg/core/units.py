"""Byte units and durations as people write them, written once."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def format_bytes(n: int | float) -> str:
    """``1.23 GiB`` from 1 GiB up, ``123.4 MiB`` from 1 MiB up, else ``12.3 KiB``."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if abs(n) >= MiB else f"{n / KiB:.1f} KiB"


def format_duration(seconds: float) -> str:
    """``seconds`` as a budget or an elapsed time is written (and ``--time-budget`` reads back): 45s, 8m33s, 15m,
    1h05m, 2h (rounded to the second; seconds dropped from an hour up)."""
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h" + (f"{minutes:02d}m" if minutes else "")
    if minutes:
        return f"{minutes}m" + (f"{s:02d}s" if s else "")
    return f"{s}s"
