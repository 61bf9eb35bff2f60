"""Fingerprint: what the planner needs to know about a dataset (spacings, shapes, intensities, classes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from autoseg.core.artifacts import Artifact
from autoseg.core.workers import run_in_processes
from autoseg.dataset.cropping import crop_to_nonzero
from autoseg.dataset.labels import LabelValue
from autoseg.dataset.raw import DatasetError, RawDataset, load_training_case, raise_problems
from autoseg.plan.plans import IntensityProperties

# Foreground voxels sampled per case and channel for the intensity statistics (as nnU-Net: 10,000).
SAMPLES_PER_CASE = 10_000


@dataclass(frozen=True)
class CaseFingerprint:
    case_id: str
    spacing_mm: tuple[float, float, float]  # (z, y, x)
    shape_zyx: tuple[int, int, int]  # before cropping
    cropped_shape_zyx: tuple[int, int, int]  # after crop to nonzero
    class_voxels: tuple[int, ...]  # voxel count per label value 0..K-1, ignore included (after cropping)


@dataclass(frozen=True)
class Fingerprint(Artifact):
    SCHEMA_VERSION = 1
    KIND = "fingerprint"

    dataset_name: str
    channel_names: tuple[str, ...]
    labels: dict[str, LabelValue]  # as in dataset.json; a region's values as a tuple
    file_ending: str
    image_dim: int  # 2 or 3: the dimension of the image files
    cases: tuple[CaseFingerprint, ...]
    foreground_intensity: tuple[IntensityProperties, ...]  # per channel, over all cases' foreground voxels
    median_relative_crop_volume: float  # median of cropped volume / original volume
    regions_class_order: tuple[int, ...] = ()  # region-based labels only

    @property
    def spacings(self) -> np.ndarray:
        return np.array([c.spacing_mm for c in self.cases], dtype=np.float64)

    @property
    def cropped_shapes(self) -> np.ndarray:
        return np.array([c.cropped_shape_zyx for c in self.cases], dtype=np.int64)


def fingerprint(dataset: RawDataset, seed: int = 0, progress: bool = True, processes: int = 1) -> Fingerprint:
    """Read every training case once and summarise it, in ``processes`` worker processes (each holds one
    case at a time). The result does not depend on ``processes``: each case samples its intensities from
    its own generator, seeded by (seed, case index)."""
    ignore = dataset.label_scheme.ignore_value
    tasks = [(case, dataset.label_values, ignore, seed, index) for index, case in enumerate(dataset.cases)]
    with tqdm(total=len(tasks), desc="fingerprint", unit="case", disable=not progress) as bar:
        if processes <= 1:
            results = []
            for task in tasks:
                results.append(_summarise_case(task))
                bar.update()
        else:
            results = run_in_processes(
                _summarise_case,
                tasks,
                [c.case_id for c in dataset.cases],
                processes,
                on_result=lambda _: bar.update(),
                describe_death=lambda in_flight: (
                    f"a fingerprint worker died (killed by the OS for lack of memory?) "
                    f"while reading {sorted(in_flight)}; rerun with fewer --processes"
                ),
            )
    results.sort(key=lambda r: r[0])  # completion order -> case order
    raise_problems(dataset, [p for r in results for p in r[4]])  # the voxels of every case are checked here
    cases = tuple(r[1] for r in results)
    _require_foreground(dataset, cases)
    samples = [[r[2][c] for r in results if r[2][c].size] for c in range(dataset.num_channels)]
    rel = [np.prod(c.cropped_shape_zyx) / np.prod(c.shape_zyx) for c in cases]
    return Fingerprint(
        dataset_name=dataset.name,
        channel_names=dataset.channel_names,
        labels=dict(dataset.labels),
        regions_class_order=dataset.regions_class_order,
        file_ending=dataset.file_ending,
        image_dim=results[0][3] if results else 3,
        cases=cases,
        foreground_intensity=tuple(_intensity_properties(s) for s in samples),
        median_relative_crop_volume=float(np.median(rel)),
    )


def _summarise_case(task: tuple) -> tuple[int, CaseFingerprint | None, list[np.ndarray], int, list[str]]:
    """(index, fingerprint of the case, up to SAMPLES_PER_CASE foreground intensities per channel, image dim,
    problems with its voxels (``autoseg.dataset.raw.voxel_problems``; then nothing else is computed)).
    Foreground: labelled voxels other than background, -1 and the ignore label (unlabelled, not sampled)."""
    case, label_values, ignore, seed, index = task
    num_label_values = max(label_values) + 1
    rng = np.random.default_rng([seed, index])
    data, seg, geometry, problems = load_training_case(case, label_values)  # float32 (C, Z, Y, X), int16
    if problems:
        return index, None, [], geometry.ndim if geometry is not None else 0, problems
    cropped = crop_to_nonzero(data, seg)
    fg = cropped.seg[0] > 0
    if ignore is not None:
        fg &= cropped.seg[0] != ignore
    samples = []
    for c in range(data.shape[0]):
        values = cropped.data[c][fg]
        take = min(SAMPLES_PER_CASE, values.size)
        samples.append(rng.choice(values, take, replace=False) if take else values)
    counts = np.bincount(np.clip(cropped.seg.ravel(), 0, None), minlength=num_label_values)[:num_label_values]
    summary = CaseFingerprint(
        case_id=case.case_id,
        spacing_mm=geometry.spacing_zyx,
        shape_zyx=tuple(int(v) for v in data.shape[1:]),
        cropped_shape_zyx=tuple(int(v) for v in cropped.data.shape[1:]),
        class_voxels=tuple(int(v) for v in counts),
    )
    return index, summary, samples, geometry.ndim, []


def _require_foreground(dataset: RawDataset, cases: tuple[CaseFingerprint, ...]) -> None:
    """A dataset needs a foreground voxel (a label value other than background and ignore) in some case:
    without one the network only learns to answer background (nnU-Net refuses such a dataset too)."""
    scheme = dataset.label_scheme
    foreground = [v for v in scheme.label_values if v not in (0, scheme.ignore_value)]
    if not any(c.class_voxels[v] for c in cases for v in foreground if v < len(c.class_voxels)):
        raise DatasetError(
            f"{dataset.root / 'labelsTr'}: none of the {len(cases)} label files holds a foreground "
            f"voxel (values {foreground} declared in dataset.json); every voxel is background or "
            "ignore. Check that the labels were exported with their values, not as empty masks"
        )


def _intensity_properties(samples: list[np.ndarray]) -> IntensityProperties:
    if not samples:
        return IntensityProperties(mean=0.0, std=1.0, percentile_00_5=0.0, percentile_99_5=0.0)
    values = np.concatenate(samples).astype(np.float64)
    p005, p995 = np.percentile(values, [0.5, 99.5])
    return IntensityProperties(
        mean=float(values.mean()), std=float(values.std()), percentile_00_5=float(p005), percentile_99_5=float(p995)
    )
