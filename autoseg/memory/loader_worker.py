"""Host RAM of one training loader worker, as plain formulas over shapes (bytes; no simulation).

A loader worker (``autoseg.data.loader``) is forked from the trainer and shares its pages: its own pages are
``LOADER_WORKER_RUNTIME_BYTES``. Beside them it holds the batch it builds (``batch_bytes``, by buffer
``batch_bytes_terms``: one sample's read box at a time, ``autoseg.data.sampler``), freed buffers the allocator
keeps (``heap_retention_bytes``), its shared-memory batch slots (``output_batch_bytes`` each) and the
low-resolution transform's caches (``low_resolution_cache_bytes``); ``worker_bytes`` adds them up. The
augmentation's constants the formulas follow (``LABELS_PER_CALL``, ``LOW_RESOLUTION_ZOOM``,
``RESIZE_CACHE_ENTRIES``) are written here and read by ``autoseg.data``.

``worker_bytes`` is held against the real worker by ``benchmarks/host_memory.py`` and
``tests/data/test_worker_memory.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoseg.core.units import MiB
from autoseg.memory.glibc_heap import GLIBC_MMAP_THRESHOLD_MAX

# A loader worker is forked and shares the trainer's pages until it writes them: its own pages are few, and a full
# garbage collection (rare in a worker) copies inherited objects. Twice the measured figure (docs/memory.md
# section 3, benchmarks/host_memory.py).
LOADER_WORKER_RUNTIME_BYTES = 32 * MiB
_F32, _I64 = 4, 8  # bytes of a float32, an int64
# autoseg.data.augment_spatial's label indicator planes interpolated per call with the image: (C + 2) x E float32
LABELS_PER_CALL = 2
# autoseg.data.augment's simulated low resolution: the target size's zoom range (round(n * zoom) per axis) and
# the entries of its caches of resize matrices and nearest indices (``low_resolution_cache_bytes``)
LOW_RESOLUTION_ZOOM = (0.5, 1.0)
RESIZE_CACHE_ENTRIES = 256
_CACHE_ENTRY_OVERHEAD_BYTES = 512  # an ndarray object, its key and lru_cache's link (tracemalloc: 470-590 B)


def _sample_buffers(
    patch_size: Sequence[int], enlarged_patch_size: Sequence[int], num_channels: int, seg_itemsize: int, dummy_2d: bool
) -> dict[str, list[int]]:
    """The buffers one sample allocates in a worker at the largest read box, in bytes, by phase.

    ``read`` (``PatchSampler.sample_patches``): its box, float32 (C, *E), and labels (1, *E), alive through the
    spatial step. ``spatial`` (``autoseg.data.augment_spatial.spatial_transform``): its label box copied, the sample
    positions and grid_sample's grid (d x P_sp float32 each), the image and LABELS_PER_CALL label indicators as
    float32 planes (C + 2) x E and their interpolation (C + 2) x P, the label vote's best and rest scores (float32)
    and a mask. ``intensity`` (the Augmenter, after the batch's spatial step): the noise (C x P float32), or per
    channel up to three float32 temporaries (low resolution, contrast, blur)."""
    p, e, c = math.prod(patch_size), math.prod(enlarged_patch_size), num_channels
    d = 2 if (len(patch_size) == 2 or dummy_2d) else 3  # dimensions of the rotation
    p_sp = math.prod(patch_size[-d:])
    planes = c + LABELS_PER_CALL
    return {
        "read": [c * e * _F32, e * seg_itemsize],
        "spatial": [
            e * seg_itemsize,
            d * p_sp * _F32,
            d * p_sp * _F32,
            planes * e * _F32,
            planes * p * _F32,
            p * _F32,
            p * _F32,
            p,
        ],
        "intensity": [p * _F32] * max(c, 3),
    }


def batch_bytes_terms(
    patch_size: Sequence[int],
    enlarged_patch_size: Sequence[int],
    batch_size: int,
    num_channels: int,
    *,
    seg_itemsize: int = 1,
    dummy_2d: bool = False,
) -> dict[str, int]:
    """Host bytes of one batch in flight in a worker, by buffer (see ``batch_bytes``), as
    ``PatchSampler.sample_patches`` builds it: one sample's box at a time (``_sample_buffers``).

    ``enlarged_patch_size``: the largest box a sample reads (``LoaderConfig.enlarged_patch_size``); a sample
    that is not rotated or scaled reads only the patch."""
    p, b, c = math.prod(patch_size), batch_size, num_channels
    buffers = _sample_buffers(patch_size, enlarged_patch_size, c, seg_itemsize, dummy_2d)
    return {
        "enlarged_data": buffers["read"][0],  # float32 (C, *E): one sample's box, read from the memmap
        "enlarged_seg": buffers["read"][1],  # int8 (1, *E)
        "augmented_data": b * c * p * 4,  # float32 (B, C, *P), PatchSpatialTransform output
        "augmented_seg": b * p * seg_itemsize,  # int8 (B, 1, *P): the target
        "scratch": max(sum(buffers["spatial"]), sum(buffers["intensity"])),  # transient, one sample at a time
    }


def heap_retention_bytes(
    patch_size: Sequence[int],
    enlarged_patch_size: Sequence[int],
    num_channels: int,
    *,
    seg_itemsize: int = 1,
    dummy_2d: bool = False,
) -> int:
    """Freed memory a loader worker keeps resident: glibc serves a block under its mmap threshold from the heap and
    keeps it there when freed, for reuse (the threshold rises to the size of each mapped block freed, up to
    ``GLIBC_MMAP_THRESHOLD_MAX``); so the heap holds one sample's such buffers beside the next sample's live ones.
    Those of the read and spatial phases and those of the intensity phase are counted both: their sizes differ,
    so one phase's freed blocks rarely serve the other's.

    Held against a worker's private memory with glibc's defaults minus with ``MALLOC_MMAP_THRESHOLD_=131072`` (fixed:
    every such block mapped and returned when freed, at slower batches), at the largest read box
    (benchmarks/host_memory.py; docs/benchmarks.md, "Host RAM of a loader worker")."""
    buffers = _sample_buffers(patch_size, enlarged_patch_size, num_channels, seg_itemsize, dummy_2d)
    return sum(n for phase in ("read", "spatial", "intensity") for n in buffers[phase] if n < GLIBC_MMAP_THRESHOLD_MAX)


def batch_bytes(
    patch_size: Sequence[int],
    enlarged_patch_size: Sequence[int],
    batch_size: int,
    num_channels: int,
    *,
    seg_itemsize: int = 1,
    dummy_2d: bool = False,
) -> int:
    """Pure estimate (an upper bound) of the host bytes one batch holds in a worker while it is built.

    One sample's read box float32 + labels (``seg_itemsize``: 1 for int8, 2 for int16) at the worst case,
    the batch's augmented data (float32) and labels (the target) + the largest per-sample scratch of the
    augmentation. E.g. patch (128, 128, 128), enlarged (302, 308, 302), B=2, C=1: about 0.62 GB; patch
    (512, 512) 2D, enlarged (1014, 1014), B=12, C=1: about 0.04 GB; dummy 2D (56, 192, 192), enlarged
    (56, 386, 376), B=2, C=1: about 0.21 GB; (160, 192, 160), enlarged (302, 340, 302), B=12, C=4: 2.6 GB
    (one sample's box at a time: the sampler transforms each box before it reads the next).
    """
    terms = batch_bytes_terms(
        patch_size, enlarged_patch_size, batch_size, num_channels, seg_itemsize=seg_itemsize, dummy_2d=dummy_2d
    )
    return sum(terms.values())


def output_batch_bytes(patch_size: Sequence[int], batch_size: int, num_channels: int, seg_itemsize: int = 1) -> int:
    """Bytes of one finished batch (float32 data + target in the seg dtype), as it waits in the prefetch queue."""
    return batch_size * math.prod(patch_size) * (num_channels * 4 + seg_itemsize)


def low_resolution_cache_bytes(patch_size: Sequence[int], dummy_2d: bool = False) -> int:
    """Bytes the simulated low resolution's caches reach in a worker that has drawn every target size
    (``autoseg.data.augment._resize_matrix`` and ``_nearest_indices``; a long training run does): per patch
    length n along a resampled axis (not z in dummy 2D) and target length m = round(n x ``LOW_RESOLUTION_ZOOM``)
    other than n, an (n, m) float32 matrix and m intp indices, the ``RESIZE_CACHE_ENTRIES`` largest of each. E.g.
    patch (512, 512): 256 matrices, 192 MiB; (56, 192, 192) dummy 2D: 10 MiB; (128, 128, 128): 3 MiB."""
    lengths = {int(n) for n in (patch_size[1:] if dummy_2d else patch_size)}
    low, high = LOW_RESOLUTION_ZOOM
    keys = [(n, m) for n in lengths for m in range(math.floor(n * low), min(n, math.ceil(n * high)) + 1) if m != n]
    largest = sorted(keys, key=lambda k: k[0] * k[1], reverse=True)[:RESIZE_CACHE_ENTRIES]
    indices = sorted((m for _, m in keys), reverse=True)[:RESIZE_CACHE_ENTRIES]
    arrays = sum(n * m * _F32 for n, m in largest) + sum(m * _I64 for m in indices)
    return arrays + (len(largest) + len(indices)) * _CACHE_ENTRY_OVERHEAD_BYTES


def worker_bytes(
    patch_size: Sequence[int],
    enlarged_patch_size: Sequence[int],
    batch_size: int,
    num_channels: int,
    queue_depth: int,
    *,
    seg_itemsize: int = 1,
    dummy_2d: bool = False,
) -> dict[str, int]:
    """Host bytes of one loader worker, by term, and their ``total``: what it adds to the trainer's RAM.

    ``runtime``: the forked process's own pages (``LOADER_WORKER_RUNTIME_BYTES``); ``in_flight``: the batch it
    builds (``batch_bytes``, an upper bound at ``enlarged_patch_size``); ``heap``: freed buffers the allocator
    keeps (``heap_retention_bytes``); ``slots``: its ``queue_depth + 1`` shared-memory batches
    (``output_batch_bytes`` each), which the trainer's process maps too; ``caches``: the low-resolution transform's
    matrices (``low_resolution_cache_bytes``). Not counted: the trainer's pages it shares, and the pages of the
    preprocessed cases it maps (page cache, shared by the workers and reclaimable). E.g. patch (56, 192, 192),
    read box (56, 380, 380), B=2, C=1, queue depth 2, dummy 2D: 32 + 200 + 112 + 3 x 19.7 + 10 MiB = 413 MiB
    (held against measured workers: benchmarks/host_memory.py; docs/benchmarks.md, "Host RAM of a loader worker")."""
    if queue_depth < 1 or batch_size < 1 or num_channels < 1:
        raise ValueError(
            f"batch_size ({batch_size}), num_channels ({num_channels}) and queue_depth ({queue_depth}) must be >= 1"
        )
    terms = {
        "runtime": LOADER_WORKER_RUNTIME_BYTES,
        "in_flight": batch_bytes(
            patch_size, enlarged_patch_size, batch_size, num_channels, seg_itemsize=seg_itemsize, dummy_2d=dummy_2d
        ),
        "heap": heap_retention_bytes(
            patch_size, enlarged_patch_size, num_channels, seg_itemsize=seg_itemsize, dummy_2d=dummy_2d
        ),
        "slots": (queue_depth + 1) * output_batch_bytes(patch_size, batch_size, num_channels, seg_itemsize),
        "caches": low_resolution_cache_bytes(patch_size, dummy_2d),
    }
    terms["total"] = sum(terms.values())
    return terms
