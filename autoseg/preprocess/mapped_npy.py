"""Read-only memory maps of ``.npy`` files for patch reads: ``open_npy_for_patches`` maps a file advised for random
access, ``prefetch_pages`` asks the kernel for a box's pages together. ``autoseg.preprocess.store`` opens a case's
arrays with them; the sampler (``autoseg.data.sampler``) prefetches each box it reads. docs/preprocessing.md.
"""

from __future__ import annotations

import itertools
import math
import mmap
from pathlib import Path

import numpy as np


def open_npy_for_patches(path: str | Path) -> np.ndarray:
    """A read-only memory map of the .npy file at ``path``, advised for random access.

    Slicing it reads only the pages of the slice. ``np.load(mmap_mode="r")`` maps the file too, but the
    kernel then reads ahead around every page fault (``read_ahead_kb``), so one patch pulls much of its case
    from disk; ``MADV_RANDOM`` turns that off (the patch's own pages are read), and ``prefetch_pages`` requests a
    box's pages together, so that they are read in parallel rather than one page fault at a time
    (docs/preprocessing.md, "What the loader changed").
    """
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f)
        offset = f.tell()
        if math.prod(shape) * dtype.itemsize == 0:
            return np.zeros(shape, dtype)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return np.ndarray(shape, dtype, buffer=mapping, offset=offset, order="F" if fortran_order else "C")


def prefetch_pages(array: np.ndarray, box: tuple[slice | int, ...]) -> None:
    """Ask the kernel to read the pages of ``array[box]`` now (``MADV_WILLNEED``, asynchronous).

    ``array`` from ``open_npy_for_patches`` (C order); ``box``: an int or a step-1 slice per axis. Each run
    of the last two axes is one contiguous byte range. Without this, a box on a cold ``MADV_RANDOM`` map
    is read one page fault at a time, slower than with it and than ``np.load(mmap_mode="r")``, which reads
    ahead around each fault (docs/preprocessing.md, "What the loader changed"). Does nothing for other arrays.
    """
    mapping = array.base
    if not (isinstance(mapping, mmap.mmap) and array.flags.c_contiguous and hasattr(mmap, "MADV_WILLNEED")):
        return
    bounds = [(b, b + 1) if isinstance(b, int) else b.indices(n)[:2] for b, n in zip(box, array.shape)]
    if any(hi <= lo for lo, hi in bounds):
        return
    offset = array.ctypes.data - np.frombuffer(mapping, np.uint8, count=1).ctypes.data  # the .npy header
    strides = array.strides
    (y0, y1), (x0, x1) = bounds[-2:]
    for lead in itertools.product(*(range(lo, hi) for lo, hi in bounds[:-2])):
        first = offset + sum(i * st for i, st in zip(lead, strides)) + y0 * strides[-2] + x0 * strides[-1]
        end = first + (y1 - 1 - y0) * strides[-2] + (x1 - x0) * strides[-1]
        start = first - first % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_WILLNEED, start, end - start)
