"""PNG files from RGB arrays with numpy and zlib only: the plain install has no image library to spare for a
picture (matplotlib would be imported, about 0.5 s and 40 MiB, in every export thread that draws one)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import atomic_path

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_bytes(rgb: np.ndarray) -> bytes:
    """(H, W, 3) uint8 -> the bytes of a PNG file (8-bit RGB, no filter, zlib level 6)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 array, found {rgb.shape} {rgb.dtype}")
    height, width = rgb.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), dtype=np.uint8)  # each row: filter type 0, then its pixels
    rows[:, 1:] = rgb.reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    return (
        SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write (H, W, 3) uint8 as a PNG file, under a temporary name renamed into place (``atomic_path``)."""
    data = png_bytes(rgb)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
