"""``autoseg statistics SEG_DIR [--images IMAGE_DIR]``: the statistics (``autoseg.review.statistics``) of every
segmentation in a folder, with the intensities of its images when given, written as ``statistics.csv`` and
``statistics.json``. Structures are named by the labels of a dataset.json beside the segmentations or the images
(or in their parent folder); without one, each label value found is a structure named by its value."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.dataset.imageio import SUPPORTED_ENDINGS, read_geometry, read_image, supported_ending
from autoseg.dataset.labels import foreground_entries
from autoseg.evaluate.files import EvaluationError, labels_from_dataset_json, read_label_map
from autoseg.review.statistics import CaseStatistics, case_statistics, write_cohort


@dataclass(frozen=True)
class StatisticsFiles:
    """What ``folder_statistics`` wrote."""

    csv: Path
    json: Path
    cases: int

    def describe(self) -> str:
        return f"statistics of {self.cases} case(s): {self.csv}, {self.json}"


def folder_statistics(
    seg_dir: str | Path, images_dir: str | Path | None = None, output_dir: str | Path | None = None
) -> StatisticsFiles:
    """Measure every segmentation of ``seg_dir`` (``{case}.ext``) and write ``statistics.csv`` and
    ``statistics.json`` into ``output_dir`` (None: ``seg_dir``); the files written. With
    ``images_dir``, each case's channels ``{case}_0000.ext``, ``{case}_0001.ext`` ... are read (refused, naming the
    case, when missing or of another geometry than the segmentation)."""
    seg_dir = Path(seg_dir)
    if not seg_dir.is_dir():
        raise EvaluationError(f"{seg_dir}: segmentation folder not found")
    files = sorted(p for p in seg_dir.iterdir() if supported_ending(p.name) and not p.name.startswith("."))
    if not files:
        raise EvaluationError(f"{seg_dir}: no segmentations in a format autoseg reads ({', '.join(SUPPORTED_ENDINGS)})")
    images = None if images_dir is None else Path(images_dir)
    if images is not None and not images.is_dir():
        raise EvaluationError(f"--images {images}: folder not found")
    meta = _dataset_json(seg_dir, images)
    cases = [_case(path, images, meta) for path in files]
    csv_path, json_path = write_cohort(Path(output_dir) if output_dir is not None else seg_dir, cases)
    return StatisticsFiles(csv_path, json_path, len(cases))


def _dataset_json(seg_dir: Path, images: Path | None) -> dict:
    """The labels and channel names of the first dataset.json beside (or above) the segmentations or images; {} when
    there is none."""
    for folder in (seg_dir, *(() if images is None else (images,))):
        labels = labels_from_dataset_json(folder)
        if labels is not None:
            for where in (folder, folder.parent):
                if (where / "dataset.json").is_file():
                    meta = json.loads((where / "dataset.json").read_text())
                    return {"labels": labels, "channel_names": meta.get("channel_names") or {}}
    return {}


def _case(path: Path, images_dir: Path | None, meta: dict) -> CaseStatistics:
    """One segmentation's statistics, with its images' intensities when ``images_dir`` is given."""
    case_id = path.name[: -len(supported_ending(path.name) or "")]
    labels, geometry = read_label_map(path, "segmentation")
    if "labels" in meta:
        structures = {n: v if isinstance(v, tuple) else (v,) for n, v in foreground_entries(meta["labels"]).items()}
    else:  # named by the values found
        structures = {str(v): (int(v),) for v in np.unique(labels) if v > 0}
    if images_dir is None:
        return case_statistics(case_id, labels, geometry, structures)
    channels = _channel_files(images_dir, case_id)
    for channel in channels:
        diff = read_geometry(channel).matches(geometry)
        if diff:
            raise EvaluationError(
                f"{channel} and {path} differ in {diff}; give the images the segmentation was made on"
            )
    images = np.stack([read_image(c)[0] for c in channels])  # (C, Z, Y, X) float32
    names = [str(meta.get("channel_names", {}).get(str(c), f"{c:04d}")) for c in range(len(channels))]
    return case_statistics(case_id, labels, geometry, structures, images, names)


def _channel_files(images_dir: Path, case_id: str) -> list[Path]:
    """``{case}_0000.ext``, ``{case}_0001.ext``, ... while they exist (one format); refused when there is none."""
    ending = next((e for e in SUPPORTED_ENDINGS if (images_dir / f"{case_id}_0000{e}").is_file()), None)
    if ending is None:
        raise EvaluationError(
            f"--images {images_dir}: no {case_id}_0000 image ({', '.join(SUPPORTED_ENDINGS)}) for the segmentation of "
            f"case {case_id}; give the folder of the images it was made on"
        )
    files = []
    while (images_dir / f"{case_id}_{len(files):04d}{ending}").is_file():
        files.append(images_dir / f"{case_id}_{len(files):04d}{ending}")
    return files
