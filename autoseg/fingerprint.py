"""Fingerprint: what the planner needs to know about a dataset (spacings, shapes, intensities, classes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from autoseg.artifacts import Artifact
from autoseg.cropping import crop_to_nonzero
from autoseg.dataset import RawDataset, load_case
from autoseg.plans import IntensityProperties

# Foreground voxels sampled per case and channel for the intensity statistics (as nnU-Net: 10,000).
SAMPLES_PER_CASE = 10_000


@dataclass(frozen=True)
class CaseFingerprint:
    case_id: str
    spacing_mm: tuple[float, float, float]  # (z, y, x)
    shape_zyx: tuple[int, int, int]  # before cropping
    cropped_shape_zyx: tuple[int, int, int]  # after crop to nonzero
    class_voxels: tuple[int, ...]  # voxel count per label value 0..K-1 (after cropping)


@dataclass(frozen=True)
class Fingerprint(Artifact):
    SCHEMA_VERSION = 1
    KIND = "fingerprint"

    dataset_name: str
    channel_names: tuple[str, ...]
    labels: dict[str, int]
    file_ending: str
    image_dim: int  # 2 or 3: the dimension of the image files
    cases: tuple[CaseFingerprint, ...]
    foreground_intensity: tuple[IntensityProperties, ...]  # per channel, over all cases' foreground voxels
    median_relative_crop_volume: float  # median of cropped volume / original volume

    @property
    def spacings(self) -> np.ndarray:
        return np.array([c.spacing_mm for c in self.cases], dtype=np.float64)

    @property
    def cropped_shapes(self) -> np.ndarray:
        return np.array([c.cropped_shape_zyx for c in self.cases], dtype=np.int64)


def fingerprint(dataset: RawDataset, seed: int = 0, progress: bool = True) -> Fingerprint:
    """Read every training case once and summarise it. Holds one case in memory at a time."""
    rng = np.random.default_rng(seed)
    samples: list[list[np.ndarray]] = [[] for _ in dataset.channel_names]
    cases = []
    image_dim = 3
    num_classes = dataset.num_classes
    for case in tqdm(dataset.cases, desc="fingerprint", unit="case", disable=not progress):
        data, seg, geometry = load_case(case)  # (C, Z, Y, X) float32, (1, Z, Y, X) int16
        image_dim = geometry.ndim
        cropped = crop_to_nonzero(data, seg)
        fg = cropped.seg[0] > 0
        for c in range(data.shape[0]):
            values = cropped.data[c][fg]
            if values.size:
                take = min(SAMPLES_PER_CASE, values.size)
                samples[c].append(rng.choice(values, take, replace=False))
        counts = np.bincount(np.clip(cropped.seg.ravel(), 0, None), minlength=num_classes)[:num_classes]
        cases.append(CaseFingerprint(
            case_id=case.case_id,
            spacing_mm=geometry.spacing_zyx,
            shape_zyx=tuple(int(v) for v in data.shape[1:]),
            cropped_shape_zyx=tuple(int(v) for v in cropped.data.shape[1:]),
            class_voxels=tuple(int(v) for v in counts),
        ))
    intensity = tuple(_intensity_properties(s) for s in samples)
    rel = [np.prod(c.cropped_shape_zyx) / np.prod(c.shape_zyx) for c in cases]
    return Fingerprint(
        dataset_name=dataset.name,
        channel_names=dataset.channel_names,
        labels=dict(dataset.labels),
        file_ending=dataset.file_ending,
        image_dim=image_dim,
        cases=tuple(cases),
        foreground_intensity=intensity,
        median_relative_crop_volume=float(np.median(rel)),
    )


def _intensity_properties(samples: list[np.ndarray]) -> IntensityProperties:
    if not samples:
        return IntensityProperties(mean=0.0, std=1.0, percentile_00_5=0.0, percentile_99_5=0.0)
    values = np.concatenate(samples).astype(np.float64)
    p005, p995 = np.percentile(values, [0.5, 99.5])
    return IntensityProperties(mean=float(values.mean()), std=float(values.std()),
                               percentile_00_5=float(p005), percentile_99_5=float(p995))
