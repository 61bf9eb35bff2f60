"""Byte units, written once."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3
