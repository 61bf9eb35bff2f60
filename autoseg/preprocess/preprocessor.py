"""Preprocessing: crop to nonzero, normalize, resample; one patch-readable array set per case.

``preprocess_case`` is shared by training preprocessing and prediction, so both see the same
transform. ``run_case`` preprocesses one training case and stores (``autoseg.preprocess.store``, the owner of
the files' names and layout) the float32 (C, Z, Y, X) data,
the label map (int8 (1, Z, Y, X), int16 beyond 127 classes; -1 outside the body), sampled foreground
voxels per class, optionally K spatially augmented copies of all three (``autoseg.preprocess.precompute``),
and the ``CaseProperties``; ``autoseg.preprocess.parallel.preprocess`` runs it over a dataset in parallel
processes.

Every file is written under a temporary name and renamed when complete, the properties last: a case
without them is redone by the next run, temporary files a killed run left behind are removed, and since
every case is a deterministic function of its input and the seed, a rerun after a kill writes what an
uninterrupted run writes.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.resources import peak_rss_bytes, reset_peak_rss
from autoseg.core.spacing import out_of_plane_axis
from autoseg.dataset.cropping import crop_to_nonzero
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.labels import LabelScheme, label_map_dtype
from autoseg.dataset.raw import Case, load_case
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.preprocess.normalization import normalize
from autoseg.preprocess.precompute import (
    PrecomputeConfig,
    augment_case,
    draw_spatial_params,
)
from autoseg.preprocess.resampling import resample_image, resample_segmentation
from autoseg.preprocess.store import AugmentedCopy, CaseProperties, CaseWriter

LOCATIONS_PER_CLASS = 10_000


def preprocess_case(
    data: np.ndarray,
    seg: np.ndarray | None,
    geometry: Geometry,
    plans: Plans,
    config: ConfigurationPlan,
    case_id: str,
) -> tuple[np.ndarray, np.ndarray | None, CaseProperties]:
    """Crop, normalize and resample one case. ``data`` float32 (C, Z, Y, X); ``seg`` int (1, Z, Y, X)."""
    spacing = geometry.spacing_zyx
    shape_before = tuple(int(v) for v in data.shape[1:])
    cropped = crop_to_nonzero(data, seg)
    data, seg = cropped.data, cropped.seg
    for c in range(data.shape[0]):
        mask = cropped.mask if plans.use_nonzero_mask[c] else None
        data[c] = normalize(data[c], plans.normalization[c], mask, plans.intensity_properties[c])
    target = config.case_spacing_mm(spacing)
    new_shape = config.resampled_shape(data.shape[1:], spacing)
    shape_after_crop = tuple(int(v) for v in data.shape[1:])
    data = resample_image(data, new_shape, spacing, order=3, order_z=0, style=plans.image_resampling)
    if seg is not None:
        seg = resample_segmentation(seg, new_shape, spacing, order=1, order_z=0)
    props = CaseProperties(
        case_id=case_id,
        geometry=geometry,
        spacing_mm=spacing,
        target_spacing_mm=tuple(target),
        shape_before_crop=shape_before,
        crop_bbox=tuple(tuple(int(v) for v in b) for b in cropped.bbox),
        shape_after_crop=shape_after_crop,
        shape_after_resample=tuple(int(v) for v in new_shape),
    )
    return data, seg, props


def labels_on_grid(labels: np.ndarray, props: CaseProperties) -> np.ndarray:
    """A label map (Z, Y, X) in a case's original grid (a previous stage's prediction) on the grid ``preprocess_case``
    made of it (``props``): cropped to its box and resampled as its labels are (each label linearly, then the
    largest). int (1, Z', Y', X'), the input's dtype; unlike a training label, no -1 outside the body."""
    if tuple(labels.shape) != tuple(props.shape_before_crop):
        raise InputError(
            f"case {props.case_id!r}: label map of shape {labels.shape} for an image of shape "
            f"{props.shape_before_crop}; it was predicted for another image"
        )
    box = tuple(slice(lo, hi) for lo, hi in props.crop_bbox)
    cropped = np.ascontiguousarray(labels[box])[None]
    return resample_segmentation(cropped, props.shape_after_resample, props.spacing_mm, order=1, order_z=0)


def class_voxels_per_slice(seg: np.ndarray, num_label_values: int) -> np.ndarray:
    """int64 (Z, K): voxels of each label value per z-slice of ``seg`` (1, Z, Y, X); -1 counts as 0."""
    counts = np.zeros((seg.shape[1], num_label_values), dtype=np.int64)
    for k in range(seg.shape[1]):
        counts[k] = np.bincount(np.maximum(seg[0, k], 0).ravel(), minlength=num_label_values)[:num_label_values]
    return counts


def class_locations(
    seg: np.ndarray, per_slice: np.ndarray, rng: np.random.Generator, scheme: LabelScheme | None = None
) -> dict[str, tuple]:
    """Up to LOCATIONS_PER_CLASS (z, y, x) voxels of each foreground class or region, drawn uniformly
    without replacement, in array order. ``per_slice``: ``class_voxels_per_slice(seg)``. Works a slice at
    a time.

    Keys are the network output channel of the class or region (``scheme.foreground_channels``): the label
    value for plain classes, the region's index for region-based labels (a region's voxels: any of its
    values). The ignore label is no key, so the loader never centres a patch on an ignored voxel.
    ``scheme`` None: plain classes ``1 .. K-1``, K = ``per_slice.shape[1]``.
    """
    scheme = scheme or LabelScheme.plain(per_slice.shape[1])
    out = {}
    for key, values in zip(scheme.foreground_channels, scheme.foreground_values, strict=True):
        values = [v for v in values if v < per_slice.shape[1]]
        counts = per_slice[:, values].sum(1)  # (Z,) voxels of the class or region per slice
        total = int(counts.sum())
        ranks = (
            np.arange(total)
            if total <= LOCATIONS_PER_CLASS
            else np.sort(rng.choice(total, LOCATIONS_PER_CLASS, replace=False))
        )
        ends = np.cumsum(counts)
        slice_of_rank = np.searchsorted(ends, ranks, side="right")
        found = []
        for k in np.unique(slice_of_rank):
            local = ranks[slice_of_rank == k] - (ends[k] - counts[k])
            member = seg[0, k] == values[0] if len(values) == 1 else np.isin(seg[0, k], values)
            flat = np.flatnonzero(member)[local]
            y, x = np.unravel_index(flat, seg.shape[2:])
            found += [(int(k), int(a), int(b)) for a, b in zip(y, x, strict=True)]
        out[str(key)] = tuple(found)
    return out


def in_plane_only(config: ConfigurationPlan, target_spacing_mm: tuple[float, ...]) -> bool:
    """Augment slices in-plane only: 2D configurations, and data whose z spacing is the out-of-plane one."""
    return config.dim == 2 or out_of_plane_axis(target_spacing_mm) == 0


@dataclass(frozen=True)
class CaseTask:
    """What a worker needs to preprocess one case (picklable)."""

    case: Case
    plans: Plans
    config: ConfigurationPlan
    out_dir: Path
    seed: int = 0
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)


@dataclass(frozen=True)
class CaseResult:
    case_id: str
    seconds: float
    peak_rss_bytes: int | None  # the worker's peak resident memory during this case (Linux), else None
    disk_bytes: int
    augmented_disk_bytes: int = 0


def run_case(task: CaseTask) -> CaseResult:
    """Preprocess one case and write its files (the JSON last); ``autoseg.preprocess.parallel`` runs it per case."""
    t0 = time.perf_counter()
    reset_peak_rss()
    case, plans, out_dir = task.case, task.plans, task.out_dir
    data, seg, geometry = load_case(case)
    data, seg, props = preprocess_case(data, seg, geometry, plans, task.config, case.case_id)
    if seg is None:
        raise InputError(f"case {case.case_id!r} has no label file; training cases need one in labelsTr/")
    seg = seg.astype(label_map_dtype(plans.num_label_values), copy=False)
    crc = zlib.crc32(case.case_id.encode())
    per_slice = class_voxels_per_slice(seg, plans.num_label_values)
    scheme = plans.label_scheme
    props = replace(props, class_voxels=tuple(int(v) for v in per_slice.sum(0)))
    writer = CaseWriter(out_dir, case.case_id)
    writer.write_arrays(data, seg, class_locations(seg, per_slice, np.random.default_rng([task.seed, crc]), scheme))
    copies = []
    rng = np.random.default_rng([task.seed, crc, 1])
    for k in range(task.precompute.num_copies):
        in_plane = in_plane_only(task.config, props.target_spacing_mm)
        params = draw_spatial_params(rng, task.precompute, in_plane)
        aug_data, aug_seg = augment_case(data, seg, params)
        counts = class_voxels_per_slice(aug_seg, plans.num_label_values)
        locations = class_locations(aug_seg, counts, np.random.default_rng([task.seed, crc, 2, k]), scheme)
        writer.write_arrays(aug_data, aug_seg, locations, copy=k)
        copies.append(AugmentedCopy(k, params, tuple(int(v) for v in counts.sum(0))))
        del aug_data, aug_seg
    writer.commit(replace(props, augmentations=tuple(copies)))  # last: marks the case complete
    return CaseResult(
        case.case_id,
        time.perf_counter() - t0,
        peak_rss_bytes(),
        writer.case_bytes + writer.copy_bytes,
        writer.copy_bytes,
    )
