"""Statistics of segmentations, per case and structure: voxels, volume in mL (area in mm^2 for a 2D image) from the
spacing, connected components (26-connected in 3D, 8-connected in 2D) and, for each image channel, the mean, the
standard deviation (of the voxels themselves: ddof 0) and the 5th and 95th percentiles (numpy's linear
interpolation) of its voxels inside the structure. A structure is a class (its label value) or a region (the union
of its label values), named as the dataset's labels name it; one absent from a case has 0 voxels, 0 components and
no intensities (null).

Files: each case's ``CaseStatistics`` is a row file ``statistics/{case}.json`` (``write_case_row``: written
atomically, its content the case's alone), and the cohort's ``statistics.csv`` and ``statistics.json`` are assembled
from every row file in the folder (``assemble_statistics``), so that the parts of ``predict --part I/N`` writing
into one folder together write what one run writes, whichever ends last.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import ndimage

from autoseg.core.artifacts import Artifact, atomic_write_text
from autoseg.dataset.imageio import Geometry

log = logging.getLogger("autoseg")

ROWS = "statistics"  # the folder of the per-case row files, in the output folder
CSV_NAME, JSON_NAME = "statistics.csv", "statistics.json"
ASSEMBLY_TRIES = 20  # assemblies while other writers keep adding rows (each sees more of them)
SUM_CHUNK = 1 << 20  # values summed at a time in float64 (8 MiB of temporaries)


@dataclass(frozen=True)
class ChannelStatistics:
    """One image channel's voxels inside one structure."""

    mean: float
    std: float  # of the voxels (ddof 0)
    p5: float  # 5th percentile (numpy's linear interpolation)
    p95: float


@dataclass(frozen=True)
class StructureStatistics:
    name: str
    values: tuple[int, ...]  # its label value, or a region's values
    voxels: int
    volume_ml: float | None  # 3D images; None for 2D
    area_mm2: float | None  # 2D images; None for 3D
    components: int  # 26-connected (3D), 8-connected (2D)
    channels: dict[str, ChannelStatistics | None]  # channel name -> statistics; None: no voxel (or no image)


@dataclass(frozen=True)
class CaseStatistics(Artifact):
    SCHEMA_VERSION = 1
    KIND = "case statistics"

    case_id: str
    image_dim: int  # 2 or 3
    spacing_mm: tuple[float, ...]  # array order: (z, y, x), or (y, x) for 2D
    channel_names: tuple[str, ...]  # () without images
    structures: tuple[StructureStatistics, ...]


@dataclass(frozen=True)
class CohortStatistics(Artifact):
    SCHEMA_VERSION = 1
    KIND = "statistics"

    cases: tuple[CaseStatistics, ...]  # in case id order


def case_statistics(
    case_id: str,
    labels: np.ndarray,
    geometry: Geometry,
    structures: Mapping[str, tuple[int, ...]],
    images: np.ndarray | None = None,
    channel_names: Sequence[str] = (),
) -> CaseStatistics:
    """The statistics of ``labels`` (Z, Y, X) integer label values in ``geometry``, for each of ``structures`` (name
    -> label values), with the intensities of ``images`` (C, Z, Y, X) named ``channel_names`` when given. Each
    structure is measured inside the bounding box of its values (``ndimage.find_objects``: one pass over the label
    map): temporaries of its box's size (a bool mask, the int32 components, its voxels' intensities)."""
    if images is not None and len(channel_names) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} image channels but {len(channel_names)} channel names")
    boxes = ndimage.find_objects(labels) if labels.size and labels.max() > 0 else []
    ndim = geometry.ndim
    spacing = geometry.spacing_zyx[3 - ndim :]
    voxel_mm = float(np.prod(spacing))
    out = []
    for name, values in structures.items():
        box = _union([boxes[v - 1] for v in values if 0 < v <= len(boxes) and boxes[v - 1] is not None])
        mask = _mask(labels[box], values) if box is not None else np.zeros((0, 0, 0), dtype=bool)
        voxels = int(np.count_nonzero(mask))
        components = ndimage.label(mask, structure=np.ones((3, 3, 3), dtype=bool))[1] if voxels else 0
        channels = {
            channel: _channel_statistics(images[c][box][mask]) if voxels and images is not None else None
            for c, channel in enumerate(channel_names)
        }
        del mask
        out.append(
            StructureStatistics(
                name=name,
                values=tuple(int(v) for v in values),
                voxels=voxels,
                volume_ml=voxels * voxel_mm / 1000 if ndim == 3 else None,
                area_mm2=voxels * voxel_mm if ndim == 2 else None,
                components=int(components),
                channels=channels,
            )
        )
    return CaseStatistics(case_id, ndim, tuple(float(s) for s in spacing), tuple(channel_names), tuple(out))


def _mask(labels: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    """Where ``labels`` holds any of ``values``: one comparison beside the mask at a time (``np.isin`` holds several
    voxel-sized temporaries at once)."""
    mask = labels == values[0]
    for value in values[1:]:
        mask |= labels == value
    return mask


def _union(boxes: list[tuple[slice, ...]]) -> tuple[slice, ...] | None:
    if not boxes:
        return None
    return tuple(slice(min(b[a].start for b in boxes), max(b[a].stop for b in boxes)) for a in range(3))


def _channel_statistics(values: np.ndarray) -> ChannelStatistics:
    """``values`` (N,) float32 of one channel inside a structure (N > 0; a copy of the caller's, reordered here).
    The mean and the deviations' squares are summed in float64 ``SUM_CHUNK`` values at a time, and the percentiles
    partition ``values`` in place, so nothing of N values is held beside it."""
    chunks = range(0, values.size, SUM_CHUNK)
    mean = sum(float(values[i : i + SUM_CHUNK].sum(dtype=np.float64)) for i in chunks) / values.size
    squares = 0.0
    for i in chunks:
        deviations = values[i : i + SUM_CHUNK].astype(np.float64)
        deviations -= mean
        squares += float(np.dot(deviations, deviations))
    p5, p95 = np.percentile(values, (5, 95), overwrite_input=True)
    return ChannelStatistics(mean=mean, std=math.sqrt(squares / values.size), p5=float(p5), p95=float(p95))


def statistics_bytes(shape_zyx: Sequence[int], channels: int) -> int:
    """Peak bytes of ``case_statistics`` with its images read (``load_case``) beside a label map the caller holds: the
    read holds the channels twice (each read, then ``np.stack``'s copy: 8 bytes a voxel a channel, and a channel's
    own read of an integer file as much), then the images (float32) beside a structure's box at most the image: its
    bool mask, then its int32 components or its voxels' float32 values."""
    voxels = math.prod(shape_zyx)
    return voxels * max(8 * channels, 4 * channels + 1 + 4)


def row_path(output_dir: Path, case_id: str) -> Path:
    """Where ``write_case_row`` writes the statistics of ``case_id``."""
    return Path(output_dir) / ROWS / f"{case_id}.json"


def write_case_row(output_dir: Path, statistics: CaseStatistics) -> Path:
    """Write one case's row file (atomically); its path."""
    path = row_path(output_dir, statistics.case_id)
    statistics.to_json(path)
    return path


def assemble_statistics(output_dir: Path) -> int:
    """Write ``statistics.csv`` and ``statistics.json`` in ``output_dir`` from every row file in its ``statistics/``
    folder (case id order); the number of cases. Lock-free with other writers of rows and of these files (other
    ``--part``s): after writing, the rows are listed again and the files rewritten while they changed, so the last
    assembly to finish lists every row written before it (a row written after it is followed by its writer's own
    assembly)."""
    listed = _listing(output_dir)
    for _ in range(ASSEMBLY_TRIES):
        cases = [CaseStatistics.from_json(output_dir / ROWS / name) for name, *_ in listed]
        write_cohort(output_dir, cases)
        again = _listing(output_dir)
        if again == listed:
            return len(cases)
        listed = again
    log.warning("%s: rows were still being added after %d assemblies; rerun to assemble", output_dir, ASSEMBLY_TRIES)
    return len(listed)


def _listing(output_dir: Path) -> list[tuple[str, int, int]]:
    """The row files now: (name, modification time in ns, size), by name (the temporaries of rows being written,
    dot files, are not rows)."""
    folder = Path(output_dir) / ROWS
    if not folder.is_dir():
        return []
    rows = [p for p in folder.iterdir() if p.name.endswith(".json") and not p.name.startswith(".")]
    return sorted((p.name, (s := p.stat()).st_mtime_ns, s.st_size) for p in rows)


def write_cohort(output_dir: Path, cases: Sequence[CaseStatistics]) -> tuple[Path, Path]:
    """``statistics.csv`` and ``statistics.json`` of ``cases`` (sorted by case id) in ``output_dir``, atomically."""
    cases = sorted(cases, key=lambda c: c.case_id)
    json_path, csv_path = Path(output_dir) / JSON_NAME, Path(output_dir) / CSV_NAME
    CohortStatistics(tuple(cases)).to_json(json_path)
    atomic_write_text(csv_path, cohort_csv(cases))
    return csv_path, json_path


def cohort_csv(cases: Sequence[CaseStatistics]) -> str:
    """One row per case and structure: case, structure, label_values (space-separated), voxels, volume_ml, area_mm2,
    components, then ``{channel}_mean``, ``_std``, ``_p5``, ``_p95`` of every channel of any case (empty where a
    case has no such channel or the structure no voxel)."""
    channels = list(dict.fromkeys(name for case in cases for name in case.channel_names))
    fields = ("mean", "std", "p5", "p95")
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    head = ["case", "structure", "label_values", "voxels", "volume_ml", "area_mm2", "components"]
    writer.writerow(head + [f"{c}_{f}" for c in channels for f in fields])
    for case in cases:
        for s in case.structures:
            row = [case.case_id, s.name, " ".join(map(str, s.values)), s.voxels, _number(s.volume_ml)]
            row += [_number(s.area_mm2), s.components]
            for channel in channels:
                stats = s.channels.get(channel)
                row += [_number(None if stats is None else getattr(stats, f)) for f in fields]
            writer.writerow(row)
    return text.getvalue()


def _number(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else repr(float(value))
