"""Training data pipeline: preprocessed cases -> patches (foreground oversampling) -> augmented batches.

Stages, each usable alone:

- ``PatchSampler.sample_batch()``: per sample a location and a spatial transform
  (``autoseg.data.augment_spatial.draw_patch_transform``), then B boxes around the patches, as large as the batch's
  largest transform needs (``read_size``; the patch itself when no sample is rotated or scaled), read from
  the case's memory-mapped data and seg (``autoseg.preprocess.store``; only the box's pages are read:
  ``open_npy_for_patches``), padded with 0 (data) / -1 (seg) outside the image; with ``use_precomputed``,
  at the patch size from the case or one of its augmented copies. A cascade stage (``previous_labels``) also reads
  the box of the case's previous-stage label map and appends its one-hot as the last data channels (0 outside).
- ``PatchSampler.sample_patches()``: the same draws, each sample's box read and rotated/scaled into the
  patch before the next is read (what the workers run: one box in memory at a time).
- ``Augmenter(batch, seed)`` (``autoseg.data.augment``): nnU-Net's default augmentation, cropping to the patch.
- ``autoseg.data.loader.BatchLoader``: an endless iterator of torch batches, in-process or in worker
  processes.

Randomness: a stream (seed, worker_id) owns one ``np.random.Generator``. Per batch it draws the patches
and their spatial transforms, then a batch seed for the other transforms; so every batch replays from
(stream seed, batch index), and its augmentation from (sampled batch, batch seed). ``num_workers=0`` and
``num_workers=1`` yield the same batches; with N workers the batches of streams 0..N-1 interleave in order.

Host memory: one batch in flight (``batch_bytes``) per process that builds batches, plus the finished
batches (``output_batch_bytes`` each) that wait for the trainer (``autoseg.memory.loader_worker.worker_bytes``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoseg.data.augment_spatial import PatchTransform, draw_patch_transform, read_size, spatial_transform
from autoseg.dataset.labels import one_hot
from autoseg.plan.training_data import LoaderConfig
from autoseg.preprocess.mapped_npy import prefetch_pages
from autoseg.preprocess.store import StoredCase, open_case, open_previous_stage

__all__ = ["PatchSampler"]


@dataclass(frozen=True)
class _Draw:
    """One sample's random choices: where its patch lies and how it is rotated / scaled."""

    case_id: str
    copy: int  # -1: the case itself, else its augmented copy
    data: np.ndarray  # (C, Z, Y, X) memory map
    seg: np.ndarray  # (1, Z, Y, X) memory map
    lead: tuple[int, ...]  # 2D: the z-slice; 3D: ()
    lower: tuple[int, ...]  # first voxel of the patch window per patch axis (may be < 0)
    transform: PatchTransform | None
    previous: np.ndarray | None = None  # (1, Z, Y, X) memory map of a cascade stage's previous-stage labels


class PatchSampler:
    """Draws batches of patches, with the margin their spatial transforms need, from cases in ``folder``.

    Per sample: a case uniformly at random; with probability ``oversample_foreground`` a foreground class
    present in the case (its stored foreground locations), one of its voxels, and a patch that contains it
    at a random position (and stays inside the image where the image is larger than the patch); otherwise
    a uniformly placed patch. A 2D configuration draws one z-slice (the voxel's slice when forced). Then,
    when augmenting on the fly, the sample's rotation and scaling (``draw_patch_transform``).

    The cases' properties (their copy lists) are kept after the first read, and the foreground voxels of
    the last ``LOCATIONS_CACHE`` cases or copies read (at most 10,000 x 12 bytes per class each).

    ``previous_folder``: where a cascade stage's previous-stage label maps are (``config.previous_labels``);
    ``num_channels`` counts their one-hot channels after the image's ``image_channels``.
    """

    LOCATIONS_CACHE = 64

    def __init__(
        self,
        folder: str | Path,
        case_ids: Sequence[str],
        config: LoaderConfig,
        rng: np.random.Generator,
        previous_folder: str | Path | None = None,
    ) -> None:
        if config.previous_labels and previous_folder is None:
            raise ValueError("a loader of previous-stage labels (a cascade stage) needs their folder")
        self.previous_folder = Path(previous_folder) if config.previous_labels else None
        self.folder = Path(folder)
        self.case_ids = tuple(case_ids)
        self.config = config
        self.rng = rng
        if not self.case_ids:
            raise ValueError(f"no case ids given for the loader over {self.folder}")
        self._cases: dict[str, StoredCase] = {c: open_case(self.folder, c) for c in self.case_ids}
        first_data, first_seg = self._cases[self.case_ids[0]].arrays()
        self.image_channels = int(first_data.shape[0])
        self.num_channels = self.image_channels + len(config.previous_labels)
        self.seg_dtype = first_seg.dtype
        self.enlarged_patch_size = config.enlarged_patch_size
        self._locations: OrderedDict[tuple[str, int], dict[str, np.ndarray]] = OrderedDict()

    def _class_locations(self, case_id: str, copy: int) -> dict[str, np.ndarray]:
        """Foreground voxels of the case or copy: class -> (N, 3) int32 (z, y, x), from its (N, 4) file."""
        key = (case_id, copy)
        if key not in self._locations:
            self._locations[key] = self._cases[case_id].class_locations(copy)
            while len(self._locations) > self.LOCATIONS_CACHE:
                self._locations.popitem(last=False)
        self._locations.move_to_end(key)
        return self._locations[key]

    def sample_batch(self) -> dict[str, Any]:
        """One batch: ``data`` float32 (B, C, *E), ``seg`` (B, 1, *E) in the cases' seg dtype (int8),
        ``case_ids`` list[str], ``origins`` int64 (B, 3): the (z, y, x) of the box's first voxel in the case
        (2D: z is the slice), ``copies`` list[int]: the augmented copy each sample was read from (-1: the
        case itself), ``transforms``: each sample's ``PatchTransform`` or None. E: the largest ``read_size``
        of the batch's transforms (the patch if none), at most ``enlarged_patch_size``; each sample holds the
        case in the centred part its own transform needs, 0 / -1 around it."""
        config, b = self.config, self.config.batch_size
        draws = [self._draw() for _ in range(b)]
        needs = [read_size(config.patch_size, d.transform, config.dummy_2d) for d in draws]
        box = tuple(max(sizes) for sizes in zip(*needs, strict=True))
        data = np.zeros((b, self.num_channels, *box), dtype=np.float32)  # pages untouched outside the reads
        seg = np.full((b, 1, *box), -1, dtype=self.seg_dtype)
        origins = [self._read_box(d, box, need, data[i], seg[i]) for i, (d, need) in enumerate(zip(draws, needs))]
        return {
            "data": data,
            "seg": seg,
            "case_ids": [d.case_id for d in draws],
            "origins": np.array(origins, dtype=np.int64).reshape(b, 3),
            "copies": [d.copy for d in draws],
            "transforms": [d.transform for d in draws],
        }

    def sample_patches(self, out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """``sample_batch`` with each sample's spatial transform applied as soon as it is read: its box is
        read, rotated and scaled into the patch (``spatial_transform``) and dropped before the next sample
        is read, so one sample's box is in memory instead of the batch's (``batch_bytes``). The same draws
        and patches as ``sample_batch`` followed by ``PatchSpatialTransform``.

        Returns ``data`` float32 (B, C, *P) and ``seg`` (B, 1, *P), written into ``out`` ("data", "seg") if
        given, ``transforms`` None per sample (applied), ``case_ids``, ``copies``, ``origins`` (of each
        sample's own box)."""
        config, b = self.config, self.config.batch_size
        draws = [self._draw() for _ in range(b)]
        if out is None:
            out = {
                "data": np.empty((b, self.num_channels, *config.patch_size), np.float32),
                "seg": np.empty((b, 1, *config.patch_size), self.seg_dtype),
            }
        origins = []
        for i, draw in enumerate(draws):
            need = read_size(config.patch_size, draw.transform, config.dummy_2d)
            data = np.zeros((self.num_channels, *need), dtype=np.float32)
            seg = np.full((1, *need), -1, dtype=self.seg_dtype)
            origins.append(self._read_box(draw, need, need, data, seg))
            spatial_transform(data, seg, draw.transform, config, out["data"][i], out["seg"][i])
        return {
            "data": out["data"],
            "seg": out["seg"],
            "case_ids": [d.case_id for d in draws],
            "origins": np.array(origins, dtype=np.int64).reshape(b, 3),
            "copies": [d.copy for d in draws],
            "transforms": [None] * b,
        }

    def _draw(self) -> _Draw:
        """Case, copy (``use_precomputed``), patch window and spatial transform of one sample."""
        config, rng = self.config, self.rng
        case_id = self.case_ids[int(rng.integers(len(self.case_ids)))]
        copy = -1
        if config.use_precomputed and config.augment:  # validation (augment=False): the case only
            copies = self._cases[case_id].copies
            pick = int(rng.integers(len(copies) + 1)) - 1  # -1: the case itself
            copy = copies[pick] if pick >= 0 else -1
        data, seg = self._cases[case_id].arrays(copy)
        if data.shape[0] != self.image_channels or seg.dtype != self.seg_dtype:
            raise ValueError(
                f"case {case_id!r} has {data.shape[0]} channels / seg {seg.dtype}, but "
                f"{self.case_ids[0]!r} has {self.image_channels} / {self.seg_dtype}; "
                "re-run preprocessing"
            )
        previous = None if self.previous_folder is None else open_previous_stage(self.previous_folder, case_id)
        if previous is not None and previous.shape[1:] != data.shape[1:]:
            raise ValueError(
                f"{self.previous_folder}: case {case_id!r}'s previous-stage labels are "
                f"{previous.shape[1:]}, its image {data.shape[1:]}; train the cascade stage again"
            )
        shape_zyx = data.shape[1:]
        voxel = None
        if rng.random() < config.oversample_foreground:
            voxel = self._foreground_voxel(
                self._class_locations(case_id, copy), self._cases[case_id].files(copy).locations, shape_zyx
            )
        dim = config.dim
        lower = tuple(
            self._window_start(s, p, None if voxel is None else voxel[-dim + a])
            for a, (s, p) in enumerate(zip(shape_zyx[-dim:], config.patch_size, strict=True))
        )
        lead: tuple[int, ...] = ()
        if dim == 2:  # one z-slice
            lead = (int(voxel[0]) if voxel is not None else int(rng.integers(shape_zyx[0])),)
        spatial = config.augment and not config.use_precomputed
        transform = draw_patch_transform(rng, config) if spatial else None
        return _Draw(case_id, copy, data, seg, lead, lower, transform, previous)

    def _read_box(
        self, draw: _Draw, box: tuple[int, ...], need: tuple[int, ...], out_data: np.ndarray, out_seg: np.ndarray
    ) -> tuple[int, ...]:
        """Fill the centred ``need`` part of out_data (C, *box) / out_seg (1, *box) with the case around the
        draw's patch (the rest stays 0 / -1: the sample's transform never reaches it); returns the origin
        (z, y, x) of ``box`` in the case."""
        patch = self.config.patch_size
        lower = [lo - (n - p) // 2 for lo, n, p in zip(draw.lower, need, patch, strict=True)]
        offset = [(e - n) // 2 for e, n in zip(box, need, strict=True)]
        src, dst = [], []
        for lo, n, s, o in zip(lower, need, draw.data.shape[-len(box) :], offset, strict=True):
            a, b = max(lo, 0), min(lo + n, s)
            src.append(slice(a, b))
            dst.append(slice(o + a - lo, o + b - lo))
        # Only the box's pages are read from disk: requested at once (prefetch_pages), then copied.
        source = (slice(None), *draw.lead, *src)
        prefetch_pages(draw.data, source)
        prefetch_pages(draw.seg, source)
        c = self.image_channels
        out_data[(slice(None, c), *dst)] = draw.data[source]
        out_seg[(slice(None), *dst)] = draw.seg[source]
        if draw.previous is not None:  # one-hot of the previous stage, read like the seg: K x box float32
            prefetch_pages(draw.previous, source)
            one_hot(draw.previous[source][0], self.config.previous_labels, out=out_data[(slice(c, None), *dst)])
        return tuple(int(v) for v in (*draw.lead, *(lo - o for lo, o in zip(lower, offset, strict=True))))

    def _window_start(self, size: int, patch: int, voxel: int | None) -> int:
        """First index of the patch window along one axis (may be < 0 where the image is smaller)."""
        lo, hi = min(0, size - patch), max(0, size - patch)
        if voxel is not None:  # the voxel must fall inside [start, start + patch)
            lo, hi = max(lo, voxel - patch + 1), min(hi, voxel)
        return int(self.rng.integers(lo, hi + 1))

    def _foreground_voxel(
        self, locations: dict[str, np.ndarray], path: Path, shape_zyx: tuple[int, ...]
    ) -> tuple[int, int, int] | None:
        """A random voxel of a random class in ``locations`` (class -> voxels, read from ``path``), or None if
        it has none."""
        present = sorted((k for k, v in locations.items() if len(v) > 0), key=int)
        if not present:
            return None
        voxels = locations[present[int(self.rng.integers(len(present)))]]
        voxel = tuple(int(v) for v in voxels[int(self.rng.integers(len(voxels)))])
        if len(voxel) != 3 or any(not 0 <= v < s for v, s in zip(voxel, shape_zyx, strict=True)):
            raise ValueError(
                f"{path}: class location {voxel} is not a (z, y, x) inside {shape_zyx}; re-run preprocessing"
            )
        return voxel  # type: ignore[return-value]
