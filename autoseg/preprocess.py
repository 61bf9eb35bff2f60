"""Preprocessing: crop to nonzero, normalize, resample; one patch-readable array set per case.

``preprocess_case`` is shared by training preprocessing and prediction, so both see the same
transform. ``preprocess`` runs it over a dataset in parallel processes and writes, per case,
``<case>_data.npy`` (float32 (C, Z, Y, X)), ``<case>_seg.npy`` (int8 (1, Z, Y, X), -1 outside the
body) and ``<case>.json`` (``CaseProperties``), the JSON last: a case without it is redone.
"""

from __future__ import annotations

import multiprocessing
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from autoseg.artifacts import Artifact, atomic_save_npy
from autoseg.cropping import crop_to_nonzero
from autoseg.dataset import Case, RawDataset, load_case
from autoseg.imageio import Geometry
from autoseg.normalization import normalize
from autoseg.plans import ConfigurationPlan, Plans
from autoseg.resampling import compute_new_shape, resample_image, resample_segmentation

LOCATIONS_PER_CLASS = 10_000


@dataclass(frozen=True)
class CaseProperties(Artifact):
    SCHEMA_VERSION = 1
    KIND = "case properties"

    case_id: str
    geometry: Geometry  # of the original image (written back exactly at prediction)
    spacing_mm: tuple[float, float, float]  # original (z, y, x)
    target_spacing_mm: tuple[float, float, float]
    shape_before_crop: tuple[int, int, int]
    crop_bbox: tuple[tuple[int, int], ...]  # (start, stop) per axis (z, y, x)
    shape_after_crop: tuple[int, int, int]
    shape_after_resample: tuple[int, int, int]
    class_voxels: tuple[int, ...] = ()  # per label value after resampling (training cases only)
    class_locations: dict[str, tuple[tuple[int, int, int], ...]] | None = None


def case_target_spacing(config: ConfigurationPlan, spacing_mm: tuple[float, float, float]) -> tuple[float, ...]:
    """The spacing a case is resampled to: the plan's, except that 2D configurations keep the slices."""
    if config.dim == 2:
        return (spacing_mm[0], *config.spacing_mm[1:])
    return tuple(config.spacing_mm)


def preprocess_case(data: np.ndarray, seg: np.ndarray | None, geometry: Geometry, plans: Plans,
                    config: ConfigurationPlan, case_id: str) -> tuple[np.ndarray, np.ndarray | None, CaseProperties]:
    """Crop, normalize and resample one case. ``data`` float32 (C, Z, Y, X); ``seg`` int (1, Z, Y, X)."""
    spacing = geometry.spacing_zyx
    shape_before = tuple(int(v) for v in data.shape[1:])
    cropped = crop_to_nonzero(data, seg)
    data, seg = cropped.data, cropped.seg
    for c in range(data.shape[0]):
        mask = cropped.mask if plans.use_nonzero_mask[c] else None
        data[c] = normalize(data[c], plans.normalization[c], mask, plans.intensity_properties[c])
    target = case_target_spacing(config, spacing)
    new_shape = compute_new_shape(data.shape[1:], spacing, target)
    shape_after_crop = tuple(int(v) for v in data.shape[1:])
    data = resample_image(data, new_shape, spacing, order=3, order_z=0)
    if seg is not None:
        seg = resample_segmentation(seg, new_shape, spacing, order=1, order_z=0)
    props = CaseProperties(
        case_id=case_id, geometry=geometry, spacing_mm=spacing, target_spacing_mm=tuple(target),
        shape_before_crop=shape_before, crop_bbox=tuple(tuple(int(v) for v in b) for b in cropped.bbox),
        shape_after_crop=shape_after_crop, shape_after_resample=tuple(int(v) for v in new_shape),
    )
    return data, seg, props


def class_locations(seg: np.ndarray, num_classes: int, rng: np.random.Generator) -> dict[str, tuple]:
    """Up to LOCATIONS_PER_CLASS sampled (z, y, x) voxels of each foreground class, for oversampling."""
    out = {}
    for c in range(1, num_classes):
        where = np.argwhere(seg[0] == c)  # (N, 3) int64; N = class voxels
        if len(where) > LOCATIONS_PER_CLASS:
            where = where[rng.choice(len(where), LOCATIONS_PER_CLASS, replace=False)]
        out[str(c)] = tuple(tuple(int(v) for v in row) for row in where)
    return out


def is_complete(out_dir: Path, case_id: str) -> bool:
    return all((out_dir / f"{case_id}{s}").is_file() for s in ("_data.npy", "_seg.npy", ".json"))


def _run_case(case: Case, plans: Plans, config: ConfigurationPlan, out_dir: Path, seed: int) -> str:
    data, seg, geometry = load_case(case)
    data, seg, props = preprocess_case(data, seg, geometry, plans, config, case.case_id)
    assert seg is not None
    seg_dtype = np.int8 if plans.num_classes <= 127 else np.int16
    seg = seg.astype(seg_dtype, copy=False)
    counts = np.bincount(np.clip(seg.ravel(), 0, None), minlength=plans.num_classes)[: plans.num_classes]
    rng = np.random.default_rng([seed, zlib.crc32(case.case_id.encode())])
    props = CaseProperties(**{**props.__dict__, "class_voxels": tuple(int(v) for v in counts),
                              "class_locations": class_locations(seg, plans.num_classes, rng)})
    atomic_save_npy(out_dir / f"{case.case_id}_data.npy", data.astype(np.float32, copy=False))
    atomic_save_npy(out_dir / f"{case.case_id}_seg.npy", seg)
    props.to_json(out_dir / f"{case.case_id}.json")  # last: marks the case complete
    return case.case_id


def preprocess(dataset: RawDataset, plans: Plans, config_name: str, out_dir: str | Path, processes: int = 1,
               seed: int = 0, progress: bool = True) -> Path:
    """Preprocess every training case of ``dataset`` for one configuration into ``out_dir``.

    Complete cases (all three files present) are skipped, so a rerun after a crash finishes the job.
    """
    config = plans.configuration(config_name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [c for c in dataset.cases if not is_complete(out_dir, c.case_id)]
    bar = tqdm(total=len(dataset.cases), initial=len(dataset.cases) - len(todo), desc=f"preprocess {config_name}",
               unit="case", disable=not progress)
    if processes <= 1:
        for case in todo:
            _run_case(case, plans, config, out_dir, seed)
            bar.update()
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            futures = {pool.submit(_run_case, c, plans, config, out_dir, seed): c for c in todo}
            try:
                for fut in as_completed(futures):
                    fut.result()
                    bar.update()
            except BrokenProcessPool as e:
                running = [futures[f].case_id for f in futures if not f.done()]
                raise RuntimeError(f"a preprocessing worker died (killed by the OS for lack of memory?) while "
                                   f"working on one of {running}; rerun with fewer --processes") from e
    bar.close()
    return out_dir
