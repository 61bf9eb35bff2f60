"""The DICOM series a label map was predicted from, as its DICOM outputs (``autoseg.dataset.dicom_write``: SEG;
``autoseg.dataset.dicom_rtstruct``: RTSTRUCT) reference it: its slice files in the label map's z order and their
headers, and the segments a label map is described by."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.extras import require

if TYPE_CHECKING:
    from autoseg.dataset.labels import LabelScheme
    from autoseg.dataset.raw import Case

log = logging.getLogger("autoseg")

EXTRA = "dicom"  # pyproject.toml's extra installing highdicom, pydicom and scikit-image
SERIES_NUMBER = 9901  # a DICOM output's series number: beside the source's, not one a scanner gives


@dataclass(frozen=True)
class SourceSeries:
    """The DICOM series a label map was predicted from: its folder, SeriesInstanceUID and slice files in the label
    map's z order (GDCM's order along the slice normal)."""

    folder: Path
    series_uid: str
    files: tuple[str, ...]

    @classmethod
    def of(cls, case: Case) -> SourceSeries:
        """The series ``case`` was read from (a case of a folder of DICOM series: ``series_uid`` set)."""
        from autoseg.dataset.imageio import dicom_series

        if case.series_uid is None:
            raise InputError(f"{case.image_paths[0]}: case {case.case_id!r} was not read from a DICOM series")
        folder = Path(case.image_paths[0])
        return cls(folder, case.series_uid, dicom_series(folder)[case.series_uid])

    def headers(self) -> list:
        """Every slice's header (pydicom datasets without pixel data), in the label map's z order."""
        pydicom = require("pydicom", EXTRA, "DICOM outputs (--output-format dicom-seg or rtstruct)")
        return [pydicom.dcmread(f, stop_before_pixels=True) for f in self.files]


def segments(scheme: LabelScheme) -> list[tuple[int, str, tuple[int, ...]]]:
    """Each segment's number (1, 2, ...), name and the label values it is: a class's value, or a region's values
    (a region is the union of the label values it holds, as its painted label map shows them)."""
    return [(i + 1, name, values) for i, (name, values) in enumerate(zip(scheme.names, scheme.foreground_values))]


def checked_headers(labels_zyx: np.ndarray, source: SourceSeries) -> list:
    """``source``'s slice headers, the label map checked against their count, rows and columns."""
    headers = source.headers()
    shape = (len(headers), int(headers[0].Rows), int(headers[0].Columns))
    if tuple(labels_zyx.shape) != shape:
        raise InputError(
            f"{source.folder}: DICOM series {source.series_uid} is {shape} (slices, rows, columns) but the label "
            f"map to write is {tuple(labels_zyx.shape)}; the series changed since it was read: predict it again"
        )
    return headers


def log_empty(labels_zyx: np.ndarray, scheme: LabelScheme, what: str) -> None:
    """A log line naming the segments the label map holds no voxel of (described, empty, in ``what``)."""
    held = set(np.unique(labels_zyx).tolist())
    empty = [name for _, name, values in segments(scheme) if not held.intersection(values)]
    if empty:
        log.info("%s: no voxel of %s: described without %s", what, ", ".join(empty), "voxels")
