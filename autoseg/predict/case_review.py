"""What ``predict --preview`` and ``--statistics`` write per case beside its label map, in the export thread that
wrote the label map (``CaseReview.after``): ``preview/{case}.png`` (``autoseg.review.pictures.preview_picture``) and
the row ``statistics/{case}.json`` (``autoseg.review.statistics``), both written atomically and counted among the
case's outputs by ``--continue`` (``review_paths``); at the end of the run, ``statistics.csv`` and
``statistics.json`` assembled from every row in the folder (``CaseReview.finish``), so that ``--part`` runs sharing
the folder write what one run writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.dataset.imageio import Geometry, read_dicom_series
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case, load_case
from autoseg.review.drawing import structure_numbers
from autoseg.review.pictures import Point, orthogonal_slices, picture_bytes, preview_picture, read_image_slices
from autoseg.review.png import write_png
from autoseg.review.statistics import (
    assemble_statistics,
    case_statistics,
    row_path,
    statistics_bytes,
    write_case_row,
)

PREVIEWS = "preview"  # the folder of the preview pictures, in the output folder


def review_paths(output_dir: Path, case_id: str, preview: bool, statistics: bool) -> list[Path]:
    """The files ``CaseReview`` writes for ``case_id``: its preview picture and its statistics row, as asked."""
    return ([Path(output_dir) / PREVIEWS / f"{case_id}.png"] if preview else []) + (
        [row_path(output_dir, case_id)] if statistics else []
    )


@dataclass(frozen=True)
class CaseReview:
    """``predict``'s ``--preview`` and ``--statistics`` for one output folder and model (``scheme``: the structures'
    names and label values; ``channel_names``: the image channels', as the plan names them)."""

    output_dir: Path
    scheme: LabelScheme
    channel_names: tuple[str, ...]
    preview: bool = False
    statistics: bool = False

    @property
    def active(self) -> bool:
        return self.preview or self.statistics

    def after(self, write: Callable[[], np.ndarray], case: Case, geometry: Geometry) -> Callable[[], None]:
        """``write`` (which writes the case's label map and returns it), then this case's review files."""
        if not self.active:
            return write
        return lambda: self.case(case, write(), geometry)

    def case(self, case: Case, labels: np.ndarray, geometry: Geometry) -> None:
        """Write the review files of ``case`` from its label map (Z, Y, X) as written, in ``geometry`` (none when
        neither is asked)."""
        scheme = self.scheme
        structures = dict(zip(scheme.names, scheme.foreground_values))
        if self.preview:
            picture = preview_picture(
                labels,
                _image_slices(case, geometry),
                geometry,
                list(structures.values()),
                structure_numbers(list(structures.values()), scheme.has_regions),
            )
            write_png(review_paths(self.output_dir, case.case_id, True, False)[0], picture)
        if self.statistics:
            images = load_case(case)[0]  # (C, Z, Y, X) float32: the intensities inside each structure
            stats = case_statistics(case.case_id, labels, geometry, structures, images, self.channel_names)
            del images
            write_case_row(self.output_dir, stats)

    def held_bytes(self, shape_zyx: tuple[int, ...]) -> int:
        """Peak bytes of ``case`` for a label map of ``shape_zyx`` beyond the label map itself: the preview
        (``picture_bytes``), then the statistics (``statistics_bytes``), one after the other."""
        preview = picture_bytes(shape_zyx, 0, 0) if self.preview else 0
        statistics = statistics_bytes(shape_zyx, len(self.channel_names)) if self.statistics else 0
        return max(preview, statistics)

    def finish(self) -> None:
        """Assemble ``statistics.csv`` and ``statistics.json`` from every row in the output folder."""
        if self.statistics:
            assemble_statistics(self.output_dir)


def _image_slices(case: Case, geometry: Geometry) -> Callable[[Point], tuple[np.ndarray, ...]]:
    """The first channel's slices through a point: read as regions of its file, or from the whole DICOM series."""
    if case.series_uid is None:
        return lambda point: read_image_slices(case.image_paths[0], point, geometry)
    return lambda point: orthogonal_slices(read_dicom_series(case.image_paths[0], case.series_uid)[0], point)
