"""Preprocessed storage: reading a random patch touches only that patch's pages of a memory-mapped case."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from factories import write_case

from autoseg.data.sampler import PatchSampler
from autoseg.plan.training_data import LoaderConfig
from autoseg.preprocess.store import case_files

PAGE = mmap.PAGESIZE
SHAPE = (1, 64, 256, 256)  # float32: 16 MiB, 256 KiB per z-slice


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore on a fresh mapping, which touches none)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    view = np.frombuffer(mapping, dtype=np.uint8)
    vec = (ctypes.c_ubyte * pages)()
    ok = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
    del view
    mapping.close()
    if ok != 0:
        pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
    return sum(b & 1 for b in vec) / pages


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_fraction(path) > 0.01:
        pytest.skip(f"{path.parent}'s file system keeps the file in memory (tmpfs?); cannot count reads")


@pytest.fixture()
def large_case(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    seg = np.zeros(SHAPE, dtype=np.int8)
    seg[0, 30:34, 100:110, 100:110] = 1
    write_case(tmp_path, "big", rng.standard_normal(SHAPE, dtype=np.float32), seg)
    return tmp_path


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_a_random_patch_reads_only_its_own_pages(large_case: Path) -> None:
    data_path, seg_path, _ = case_files(large_case, "big")
    for path in (data_path, seg_path):
        drop_from_page_cache(path)
    config = LoaderConfig(patch_size=(16, 32, 32), batch_size=1, augment=False, oversample_foreground=0.0)
    sampler = PatchSampler(large_case, ["big"], config, np.random.default_rng(1))
    batch = sampler.sample_batch()

    z, y, x = batch["origins"][0]
    expected = np.load(data_path, mmap_mode="r")[:, z : z + 16, y : y + 32, x : x + 32]
    np.testing.assert_array_equal(batch["data"][0], expected)
    # The patch is 16 slices x 32 rows of 128 bytes (64 KiB); each slice's rows lie in 8 pages: 128 of the
    # file's 4097 pages (3.1 %), plus the header's. (Without MADV_RANDOM the kernel's read-ahead around each
    # page fault, ``read_ahead_kb``, reads much of the file: docs/preprocessing.md.)
    assert 0 < resident_fraction(data_path) <= 0.04
    assert resident_fraction(seg_path) <= 0.06  # int8: 16 slices x 2-3 pages of 1025

    np.load(data_path)  # a full read, for contrast
    assert resident_fraction(data_path) > 0.99
