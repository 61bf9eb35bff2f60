"""``autoseg evaluate --images``: one picture per case through its largest error (``autoseg.review.pictures``:
three orthogonal slices of the case's first image channel, prediction dashed and reference solid in the
structures' fixed colours) and ``index.html``, the cases worst first (by their mean Dice over the classes defined
in them) with their Dice per class, each linking its picture. One case is drawn at a time: the memory is one
case's (``picture_bytes``)."""

from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import atomic_write_text
from autoseg.dataset.imageio import SUPPORTED_ENDINGS, read_geometry
from autoseg.evaluate.files import EvaluationError, read_label_map
from autoseg.evaluate.metrics import CaseMetrics, EvaluationSummary
from autoseg.review.drawing import colour, structure_numbers
from autoseg.review.pictures import error_picture, read_image_slices
from autoseg.review.png import write_png

INDEX = "index.html"
PICTURES = "pictures"  # the default folder of the pictures and index.html, in the predictions' folder


def image_file(images_dir: Path, case_id: str) -> Path | None:
    """The first channel of ``case_id`` in ``images_dir``: ``{case}_0000.ext`` (nnU-Net's layout), else
    ``{case}.ext``, in any format autoseg reads; None when there is none."""
    for name in (f"{case_id}_0000", case_id):
        for ending in SUPPORTED_ENDINGS:
            if (images_dir / f"{name}{ending}").is_file():
                return images_dir / f"{name}{ending}"
    return None


def write_pictures(summary: EvaluationSummary, images_dir: str | Path, pictures_dir: str | Path | None = None) -> Path:
    """Draw every case of ``summary`` into ``pictures_dir/{case}.png`` and write ``pictures_dir/index.html`` (None:
    ``pictures`` in the predictions' folder); its path. Every case's image is looked for before any is drawn: a
    missing one is an ``EvaluationError`` naming them."""
    images_dir = Path(images_dir)
    pictures_dir = Path(summary.pred_dir) / PICTURES if pictures_dir is None else Path(pictures_dir)
    if not images_dir.is_dir():
        raise EvaluationError(f"--images {images_dir}: folder not found")
    images = {case.case_id: image_file(images_dir, case.case_id) for case in summary.cases}
    missing = sorted(case_id for case_id, path in images.items() if path is None)
    if missing:
        raise EvaluationError(
            f"--images {images_dir}: no image for {len(missing)} case(s) ({', '.join(missing[:10])}); expected "
            f"{{case}}_0000 (or {{case}}) with one of {', '.join(SUPPORTED_ENDINGS)}; give the images' folder"
        )
    structures = [v if isinstance(v, tuple) else (v,) for v in summary.labels.values()]
    regions = any(isinstance(v, tuple) for v in summary.labels.values())
    numbers = structure_numbers(structures, regions)
    for case in summary.cases:
        pred, ref, image = Path(case.prediction), Path(case.reference), images[case.case_id]
        geometry = read_geometry(ref)
        picture, _ = error_picture(
            lambda pred=pred, ref=ref: read_pair(pred, ref),
            lambda point, image=image, geometry=geometry: read_image_slices(image, point, geometry),
            geometry,
            structures,
            numbers,
            summary.ignore_value,
        )
        write_png(pictures_dir / f"{case.case_id}.png", picture)
    index = pictures_dir / INDEX
    atomic_write_text(index, index_html(summary, numbers))
    return index


def read_pair(pred: Path, ref: Path) -> tuple[np.ndarray, np.ndarray]:
    """A case's prediction and reference as label maps (``read_label_map``), each uint8 where its values allow (the
    int16 it is read as held only while it is read): 1 byte a voxel each while a picture is drawn."""
    return _narrow(read_label_map(pred, "prediction")[0]), _narrow(read_label_map(ref, "reference")[0])


def _narrow(labels: np.ndarray) -> np.ndarray:
    if labels.size and (labels.min() < 0 or labels.max() > np.iinfo(np.uint8).max):
        return labels
    return labels.astype(np.uint8)


def case_score(case: CaseMetrics) -> float:
    """The mean Dice of the classes defined in ``case`` (NaN: none is)."""
    defined = [m.dice for m in case.classes.values() if not math.isnan(m.dice)]
    return sum(defined) / len(defined) if defined else math.nan


def worst_first(summary: EvaluationSummary) -> list[CaseMetrics]:
    """The cases by ``case_score``, lowest first; those with no class defined last; ties by case id."""
    return sorted(summary.cases, key=lambda c: (math.isnan(case_score(c)), case_score(c), c.case_id))


def index_html(summary: EvaluationSummary, numbers: list[int]) -> str:
    """The page: the legend (each structure's number, colour and name; the line styles), then a row per case, worst
    first: rank, case (linking its picture), mean Dice and each class's Dice."""
    names = list(summary.labels)
    legend = "".join(
        f'<li><span class="swatch" style="background:rgb{tuple(int(c) for c in colour(i))}"></span>'
        f"{numbers[i]}: {html.escape(name)}</li>"
        for i, name in enumerate(names)
    )
    head = "".join(f"<th>{html.escape(name)}</th>" for name in names)
    rows = []
    for rank, case in enumerate(worst_first(summary), 1):
        link = html.escape(f"{case.case_id}.png")
        dice = "".join(f"<td>{_dice(case.classes[name].dice)}</td>" for name in names)
        rows.append(
            f'<tr><td>{rank}</td><td><a href="{link}">{html.escape(case.case_id)}</a></td>'
            f"<td>{_dice(case_score(case))}</td>{dice}</tr>"
        )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>autoseg evaluation</title><style>'
        "body{font-family:sans-serif} td,th{padding:2px 8px;text-align:right} "
        ".swatch{display:inline-block;width:12px;height:12px;margin-right:6px}</style></head><body>\n"
        f"<h1>{len(summary.cases)} cases, worst first</h1>\n"
        f"<p>Predictions {html.escape(summary.pred_dir)}, references {html.escape(summary.gt_dir)}. Each picture: "
        "axial, coronal and sagittal slices through the case's largest error (its largest 26-connected region "
        "where prediction and reference differ); reference outlined solid (R), prediction dashed (P).</p>\n"
        f"<ul>{legend}</ul>\n<table><tr><th>rank</th><th>case</th><th>mean Dice</th>{head}</tr>\n"
        + "\n".join(rows)
        + "\n</table></body></html>\n"
    )


def _dice(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}"
