"""DICOM SEG and RTSTRUCT outputs read back: the SEG's frames, placed by their positions, give the label map voxel for
voxel; the RTSTRUCT's contours, filled by the even-odd rule, give it back exactly on these shapes (the tolerance the
docs state: Dice >= 0.95 per structure)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from dicom_series import FRAME_OF_REFERENCE_UID, write_dicom_series
from extras import require_extra

from autoseg.core.errors import InputError
from autoseg.dataset.dicom_source import SourceSeries
from autoseg.dataset.dicom_write import check_dicom_output, write_dicom_labels
from autoseg.dataset.imageio import read_dicom_series
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case

UID = "1.2.826.0.1.3680043.8.498.77"
SCHEME = LabelScheme.from_labels({"background": 0, "liver": 1, "lesion": 2, "vessel": 3})


@pytest.fixture()
def series(tmp_path: Path) -> tuple[Case, np.ndarray]:
    """A 6-slice series whose files run against the slice normal (z direction -1: GDCM's order is the reverse of the
    written one), non-square pixels, and a label map in the geometry the series reads as: a ring with a hole, a
    one-voxel lesion, a structure on the image border; no "vessel"."""
    folder = tmp_path / "series"
    write_dicom_series(
        folder, np.zeros((6, 14, 12)), UID, spacing_xyz=(0.7, 1.1, 3.0), direction=(1, 0, 0, 0, 1, 0, 0, 0, -1)
    )
    _, geometry = read_dicom_series(folder, UID)
    labels = np.zeros(geometry.shape_zyx, np.uint8)
    labels[1:4, 2:9, 2:8] = 1
    labels[1:4, 4:6, 4:6] = 0  # a hole in the ring
    labels[2, 11, 3] = 2  # one voxel
    labels[5, 10:, 8:] = 1  # on the border, on the slice that is the first file written
    return Case("case_a", (folder,), None, series_uid=UID), labels


def _slice_index(positions: np.ndarray, headers: list) -> np.ndarray:
    """Each (N, 3) position's slice in ``headers`` (the label map's z order), by the nearest slice position."""
    slices = np.array([[float(v) for v in h.ImagePositionPatient] for h in headers])
    return np.argmin(np.linalg.norm(positions[:, None, :] - slices[None], axis=2), axis=1)


def _seg_labels(path: Path, headers: list, shape: tuple[int, ...]) -> np.ndarray:
    """The label map a SEG's frames give, each frame placed by its Image Position (Patient), not by its order."""
    pydicom = require_extra("pydicom")
    ds = pydicom.dcmread(path)
    labels = np.zeros(shape, np.uint8)
    frames = ds.pixel_array.reshape(-1, *shape[1:])
    for frame, item in zip(frames, ds.PerFrameFunctionalGroupsSequence):
        position = np.array([[float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient]])
        segment = int(item.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        labels[_slice_index(position, headers)[0]][frame.astype(bool)] = segment
    return labels


def _rtstruct_labels(path: Path, headers: list, shape: tuple[int, ...]) -> np.ndarray:
    """The label map an RTSTRUCT's contours give: each slice's contours of a ROI filled by the even-odd rule, voxels
    whose centre is inside (scikit-image's ``polygon``)."""
    pydicom, draw = require_extra("pydicom"), require_extra("skimage.draw")
    ds = pydicom.dcmread(path)
    labels = np.zeros(shape, np.uint8)
    origin = np.array([float(v) for v in headers[0].ImagePositionPatient])
    row_spacing, column_spacing = (float(v) for v in headers[0].PixelSpacing)
    cosines = np.array([float(v) for v in headers[0].ImageOrientationPatient]).reshape(2, 3)
    for roi in ds.ROIContourSequence:
        mask = np.zeros(shape, bool)
        for contour in getattr(roi, "ContourSequence", []):
            points = np.array([float(v) for v in contour.ContourData]).reshape(-1, 3)
            z = _slice_index(points[:1], headers)[0]
            columns, rows = ((points - origin) @ cosines.T / [column_spacing, row_spacing]).T
            filled = np.zeros(shape[1:], bool)
            filled[draw.polygon(rows, columns, shape[1:])] = True
            mask[z] ^= filled
        labels[mask] = int(roi.ReferencedROINumber)
    return labels


def test_a_dicom_seg_gives_the_label_map_back_voxel_for_voxel(series, tmp_path, caplog):
    hd = require_extra("highdicom")
    case, labels = series
    source = SourceSeries.of(case)
    with caplog.at_level(logging.INFO, logger="autoseg"):
        write_dicom_labels(tmp_path / "case_a.dcm", labels, source, SCHEME, "dicom-seg")
    headers = source.headers()
    assert np.array_equal(_seg_labels(tmp_path / "case_a.dcm", headers, labels.shape), labels)
    seg = hd.seg.segread(tmp_path / "case_a.dcm")
    assert seg.StudyInstanceUID == headers[0].StudyInstanceUID
    assert seg.FrameOfReferenceUID == FRAME_OF_REFERENCE_UID
    referenced = seg.ReferencedSeriesSequence[0]
    assert referenced.SeriesInstanceUID == UID
    assert {r.ReferencedSOPInstanceUID for r in referenced.ReferencedInstanceSequence} == {
        h.SOPInstanceUID for h in headers
    }
    described = [
        (s.SegmentNumber, s.SegmentLabel, s.SegmentedPropertyTypeCodeSequence[0].CodeMeaning)
        for s in seg.SegmentSequence
    ]
    assert described == [(1, "liver", "Tissue"), (2, "lesion", "Tissue"), (3, "vessel", "Tissue")]
    assert "no voxel of vessel" in caplog.text  # described, without frames


def test_an_rtstruct_gives_the_label_map_back_from_its_contours(series, tmp_path, caplog):
    pydicom = require_extra("pydicom")
    require_extra("skimage")
    case, labels = series
    source = SourceSeries.of(case)
    with caplog.at_level(logging.INFO, logger="autoseg"):
        write_dicom_labels(tmp_path / "case_a_rtstruct.dcm", labels, source, SCHEME, "rtstruct")
    headers = source.headers()
    back = _rtstruct_labels(tmp_path / "case_a_rtstruct.dcm", headers, labels.shape)
    for value in (1, 2):  # the stated tolerance is Dice >= 0.95; these shapes come back exactly
        assert np.array_equal(back == value, labels == value), value
    ds = pydicom.dcmread(tmp_path / "case_a_rtstruct.dcm")
    frame = ds.ReferencedFrameOfReferenceSequence[0]
    assert frame.FrameOfReferenceUID == FRAME_OF_REFERENCE_UID
    referenced = frame.RTReferencedStudySequence[0].RTReferencedSeriesSequence[0]
    assert referenced.SeriesInstanceUID == UID
    assert len(referenced.ContourImageSequence) == len(headers)
    assert [r.ROIName for r in ds.StructureSetROISequence] == ["liver", "lesion", "vessel"]
    assert "ContourSequence" not in ds.ROIContourSequence[2] or not ds.ROIContourSequence[2].ContourSequence
    assert "no voxel of vessel" in caplog.text


def test_regions_are_segments_that_overlap(series, tmp_path):
    require_extra("highdicom")
    case, labels = series
    regions = LabelScheme.from_labels({"background": 0, "whole": [1, 2], "core": 2}, [1, 2])
    write_dicom_labels(tmp_path / "r.dcm", labels.clip(0, 2), SourceSeries.of(case), regions, "dicom-seg")
    pydicom = require_extra("pydicom")
    ds = pydicom.dcmread(tmp_path / "r.dcm")
    voxels = {1: 0, 2: 0}
    for frame, item in zip(ds.pixel_array.reshape(-1, *labels.shape[1:]), ds.PerFrameFunctionalGroupsSequence):
        voxels[int(item.SegmentIdentificationSequence[0].ReferencedSegmentNumber)] += int(frame.sum())
    assert voxels == {1: int(np.isin(labels, (1, 2)).sum()), 2: int((labels == 2).sum())}


def test_dicom_outputs_are_refused_before_prediction_when_they_cannot_be_written(series, tmp_path, monkeypatch):
    case, _ = series
    image = Case("img", (tmp_path / "img_0000.nii.gz",), None)
    with pytest.raises(InputError, match=r"img_0000.nii.gz: case 'img' is not a DICOM series.*--output-format nifti"):
        check_dicom_output([case, image], "rtstruct")
    check_dicom_output([image], "nifti")  # NIfTI of anything
    monkeypatch.setitem(sys.modules, "highdicom", None)  # as if the extra were not installed
    with pytest.raises(InputError, match=r'--output-format dicom-seg.*pip install "autoseg\[dicom\]"'):
        check_dicom_output([case], "dicom-seg")


def test_a_series_without_a_frame_of_reference_is_refused(tmp_path):
    require_extra("pydicom")
    folder = tmp_path / "nofor"
    write_dicom_series(folder, np.zeros((2, 4, 4)), UID, frame_of_reference_uid=None)
    with pytest.raises(InputError, match=r"no Frame of Reference UID \(0020,0052\).*--output-format nifti"):
        check_dicom_output([Case("c", (folder,), None, series_uid=UID)], "dicom-seg")


def test_a_label_map_without_foreground_is_written_empty(series, tmp_path):
    """highdicom cannot leave out every frame: the SEG then holds empty ones; the RTSTRUCT has no contour."""
    require_extra("highdicom")
    case, labels = series
    empty = np.zeros_like(labels)
    source = SourceSeries.of(case)
    write_dicom_labels(tmp_path / "e.dcm", empty, source, SCHEME, "dicom-seg")
    write_dicom_labels(tmp_path / "e_rtstruct.dcm", empty, source, SCHEME, "rtstruct")
    headers = source.headers()
    assert not _seg_labels(tmp_path / "e.dcm", headers, labels.shape).any()
    assert not _rtstruct_labels(tmp_path / "e_rtstruct.dcm", headers, labels.shape).any()


def test_a_series_highdicom_refuses_is_an_error_naming_it(series, tmp_path, monkeypatch):
    require_extra("highdicom")
    from autoseg.dataset import dicom_write

    def refuse(*args):
        raise ValueError("Source images have no Frame Of Reference UID")

    monkeypatch.setattr(dicom_write, "_segmentation", refuse)
    case, labels = series
    with pytest.raises(InputError, match=rf"series: DICOM series {UID}: highdicom cannot.*--output-format nifti"):
        write_dicom_labels(tmp_path / "x.dcm", labels, SourceSeries.of(case), SCHEME, "dicom-seg")
    assert not list(tmp_path.glob("x.dcm*")) and not list(tmp_path.glob(".x.dcm*"))
