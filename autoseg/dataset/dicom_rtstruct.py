"""An RT Structure Set (``autoseg predict --output-format rtstruct``) of a label map predicted from a DICOM series,
written with pydicom: one ROI per segment (``autoseg.dataset.dicom_write.segments``), each slice's outlines as
CLOSED_PLANAR contours referencing that slice's SOP instance.

A contour is the iso-line at 0.5 of the slice's mask (scikit-image's ``find_contours``, the mask padded so that a
structure touching the border closes): it runs between inside and outside voxel centres, half a voxel out of the
boundary voxels' centres, so the voxels whose centres it encloses are the mask (a single voxel is a diamond around
its centre). A hole is a contour of its own inside its structure's; readers fill a slice's contours by the even-odd
rule, as RTSTRUCT readers do. rt-utils draws contours through the boundary voxels' centres instead (a square of
n x n voxels becomes a polygon of (n-1) x (n-1) voxel widths, one voxel a point) and takes PixelSpacing's row spacing
as the column spacing, so it is not used.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np

import autoseg
from autoseg.core.artifacts import atomic_path
from autoseg.core.extras import require
from autoseg.dataset.dicom_source import EXTRA, SERIES_NUMBER, SourceSeries, checked_headers, log_empty, segments
from autoseg.dataset.labels import LabelScheme

RTSTRUCT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.481.3"
STUDY_COMPONENT_SOP_CLASS = "1.2.840.10008.3.1.2.3.1"  # what an RT Referenced Study item names (PS3.3 C.8.8.5)
COPIED = (  # the patient and study modules, copied from the source series
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "StudyInstanceUID",
    "StudyDate",
    "StudyTime",
    "StudyID",
    "AccessionNumber",
    "ReferringPhysicianName",
    "FrameOfReferenceUID",
)
COLORS = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180))


def write_rtstruct(path: Path, labels_zyx: np.ndarray, source: SourceSeries, scheme: LabelScheme) -> None:
    """``labels_zyx`` (Z, Y, X label values in ``source``'s geometry) as an RT Structure Set referencing ``source``,
    into ``path`` atomically."""
    pydicom = require("pydicom", EXTRA, "--output-format rtstruct")
    Dataset, Sequence = pydicom.Dataset, pydicom.Sequence
    headers = checked_headers(labels_zyx, source)
    log_empty(labels_zyx, scheme, str(path))
    ds = _base_dataset(pydicom, headers[0])
    ds.ReferencedFrameOfReferenceSequence = Sequence([_referenced_frame(pydicom, headers)])
    ds.StructureSetROISequence, ds.ROIContourSequence, ds.RTROIObservationsSequence = Sequence(), Sequence(), Sequence()
    for number, name, values in segments(scheme):
        roi = Dataset()
        roi.ROINumber, roi.ROIName, roi.ROIGenerationAlgorithm = number, name, "AUTOMATIC"
        roi.ReferencedFrameOfReferenceUID = headers[0].FrameOfReferenceUID
        ds.StructureSetROISequence.append(roi)
        contours = Dataset()
        contours.ReferencedROINumber, contours.ROIDisplayColor = number, list(COLORS[(number - 1) % len(COLORS)])
        contours.ContourSequence = Sequence(_contours(pydicom, labels_zyx, values, headers))
        ds.ROIContourSequence.append(contours)
        observation = Dataset()
        observation.ObservationNumber, observation.ReferencedROINumber = number, number
        observation.RTROIInterpretedType, observation.ROIInterpreter = "", ""
        ds.RTROIObservationsSequence.append(observation)
    with atomic_path(path, suffix=".dcm") as tmp:
        ds.save_as(tmp, enforce_file_format=True)


def _base_dataset(pydicom, first):
    """The RTSTRUCT's own modules: SOP common, RT series, structure set; patient and study copied from ``first``."""
    uid = pydicom.uid.generate_uid()
    meta = pydicom.dataset.FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = RTSTRUCT_SOP_CLASS, uid
    meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds = pydicom.dataset.FileDataset(None, {}, file_meta=meta, preamble=b"\0" * 128)
    now = datetime.datetime.now()
    ds.SpecificCharacterSet = "ISO_IR 192"
    ds.SOPClassUID, ds.SOPInstanceUID = RTSTRUCT_SOP_CLASS, uid
    for keyword in COPIED:
        setattr(ds, keyword, getattr(first, keyword, ""))
    ds.Modality, ds.SeriesInstanceUID, ds.SeriesNumber = "RTSTRUCT", pydicom.uid.generate_uid(), SERIES_NUMBER
    ds.SeriesDescription, ds.OperatorsName = "autoseg structures", ""
    ds.Manufacturer, ds.ManufacturerModelName, ds.SoftwareVersions = "autoseg", "autoseg", autoseg.__version__
    ds.StructureSetLabel, ds.InstanceNumber = "autoseg", 1
    ds.StructureSetDate, ds.StructureSetTime = now.strftime("%Y%m%d"), now.strftime("%H%M%S")
    return ds


def _referenced_frame(pydicom, headers):
    """The frame of reference, its study, the source series and every slice instance (Contour Image Sequence)."""
    Dataset, Sequence = pydicom.Dataset, pydicom.Sequence
    series = Dataset()
    series.SeriesInstanceUID = headers[0].SeriesInstanceUID
    series.ContourImageSequence = Sequence([_image_reference(pydicom, h) for h in headers])
    study = Dataset()
    study.ReferencedSOPClassUID, study.ReferencedSOPInstanceUID = STUDY_COMPONENT_SOP_CLASS, headers[0].StudyInstanceUID
    study.RTReferencedSeriesSequence = Sequence([series])
    frame = Dataset()
    frame.FrameOfReferenceUID = headers[0].FrameOfReferenceUID
    frame.RTReferencedStudySequence = Sequence([study])
    return frame


def _image_reference(pydicom, header):
    reference = pydicom.Dataset()
    reference.ReferencedSOPClassUID, reference.ReferencedSOPInstanceUID = header.SOPClassUID, header.SOPInstanceUID
    return reference


def _contours(pydicom, labels_zyx: np.ndarray, values: tuple[int, ...], headers) -> list:
    """The CLOSED_PLANAR contours of the voxels holding ``values``, slice by slice, in patient coordinates (mm); the
    points in the middle of a straight run are left out (the polygon is the same)."""
    measure = require("skimage.measure", EXTRA, "--output-format rtstruct")
    found = []
    for z in range(labels_zyx.shape[0]):
        mask = np.isin(labels_zyx[z], values)
        if not mask.any():
            continue
        to_patient = slice_to_patient(headers[z])
        for outline in measure.find_contours(np.pad(mask, 1).astype(np.uint8), 0.5):  # padded: a border closes
            # points within 0.001 voxel of a straight run left out (tolerance 0 would keep every point); closed: the
            # last point repeats the first
            corners = measure.approximate_polygon(outline, tolerance=1e-3)
            points = to_patient(corners[:-1] - 1)  # the pad's offset
            contour = pydicom.Dataset()
            contour.ContourImageSequence = pydicom.Sequence([_image_reference(pydicom, headers[z])])
            contour.ContourGeometricType, contour.NumberOfContourPoints = "CLOSED_PLANAR", len(points)
            contour.ContourData = [f"{v:.4f}" for v in points.ravel()]
            found.append(contour)
    return found


def slice_to_patient(header):
    """(N, 2) (row, column) voxel coordinates of the slice ``header`` -> (N, 3) patient coordinates (mm): Image
    Position (Patient) plus column steps along the row direction and row steps along the column direction
    (PixelSpacing is the row spacing, then the column spacing)."""
    origin = np.array(header.ImagePositionPatient, dtype=float)
    orientation = np.array(header.ImageOrientationPatient, dtype=float)
    row_spacing, column_spacing = (float(v) for v in header.PixelSpacing)
    along_row, along_column = orientation[:3] * column_spacing, orientation[3:] * row_spacing
    return lambda rc: origin + rc[:, 1:2] * along_row + rc[:, 0:1] * along_column
