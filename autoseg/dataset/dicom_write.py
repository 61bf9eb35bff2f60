"""DICOM outputs of a label map predicted from a DICOM series (``autoseg predict --output-format``): a DICOM
Segmentation (``dicom-seg``, ``{case}.dcm``, written by highdicom) or an RT Structure Set (``rtstruct``,
``{case}_rtstruct.dcm``, ``autoseg.dataset.dicom_rtstruct``), each referencing its source series: the patient and
study copied, the series and frame-of-reference UIDs and every slice's SOP instance referenced.

The label map is in the series' geometry as ``read_dicom_series`` read it: slice ``z`` is the series' file ``z`` in
GDCM's order along the slice normal (``dicom_series``), rows y and columns x. So a slice is tied to its source
instance by that order here, and a reader ties SEG frames and RTSTRUCT contours back to slices by the referenced
instance or the frame's position.

Each segment is a dataset.json label (``LabelScheme.names``: a class, or a region as the union of its label values)
with its name; dataset.json gives no codes, so each is described with SNOMED CT's generic "Tissue" as category and
type (``GENERIC_CODE``). A label the prediction does not hold stays described (a SEG segment without frames, an
RTSTRUCT ROI without contours), so segment and ROI numbers are the same for every case, and a log line says so.
highdicom, pydicom and scikit-image are the ``dicom`` extra (``autoseg.core.extras``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import autoseg
from autoseg.core.artifacts import atomic_path
from autoseg.core.errors import InputError
from autoseg.core.extras import require
from autoseg.dataset.dicom_rtstruct import write_rtstruct
from autoseg.dataset.dicom_source import EXTRA, SERIES_NUMBER, SourceSeries, checked_headers, log_empty, segments

if TYPE_CHECKING:  # the CLI's parser reads OUTPUT_FORMATS: no SimpleITK for it
    from autoseg.dataset.imageio import Geometry
    from autoseg.dataset.labels import LabelScheme
    from autoseg.dataset.raw import Case


NIFTI = "nifti"
DICOM_OUTPUTS = {"dicom-seg": ".dcm", "rtstruct": "_rtstruct.dcm"}  # --output-format -> the ending after {case}
OUTPUT_FORMATS = (NIFTI, *DICOM_OUTPUTS)
GENERIC_CODE = ("85756007", "SCT", "Tissue")  # every segment's category and type: dataset.json names no code


def output_ending(output_format: str, nifti_ending: str) -> str:
    """What follows the case id in its label map's file name: ``nifti_ending`` (the input's own, or .nii.gz for a
    DICOM series) for ``nifti``, else ``.dcm`` (SEG) or ``_rtstruct.dcm``."""
    return nifti_ending if output_format == NIFTI else DICOM_OUTPUTS[output_format]


def check_dicom_output(cases: Sequence[Case], output_format: str) -> None:
    """Before any prediction: refuse a DICOM ``output_format`` when its extra is not installed, when a case is not a
    DICOM series (naming its file) or when a series has no Frame of Reference UID to reference."""
    if output_format == NIFTI:
        return
    what = f"--output-format {output_format}"
    require("highdicom" if output_format == "dicom-seg" else "skimage.measure", EXTRA, what)
    pydicom = require("pydicom", EXTRA, what)
    for case in cases:
        if case.series_uid is None:
            raise InputError(
                f"{case.image_paths[0]}: case {case.case_id!r} is not a DICOM series, and {what} writes a DICOM "
                "object that references the series it was predicted from; pass a folder holding the DICOM series "
                "(-i), or write NIfTI (--output-format nifti)"
            )
        first = SourceSeries.of(case).files[0]
        if "FrameOfReferenceUID" not in pydicom.dcmread(first, stop_before_pixels=True):
            raise InputError(
                f"{first}: DICOM series {case.series_uid} has no Frame of Reference UID (0020,0052), which a "
                f"{output_format} object must reference; write NIfTI instead (--output-format nifti)"
            )


def label_writer(case: Case, output_format: str) -> Callable[[Path, np.ndarray, Geometry, LabelScheme], None]:
    """How ``case``'s label map is written: (path, label map (Z, Y, X), its geometry, the labels) -> the file, by
    ``write_image`` (``nifti``) or as a DICOM object of its source series (its files listed when it is written)."""
    if output_format == NIFTI:
        return write_nifti
    return lambda path, labels, geometry, scheme: write_dicom_labels(
        path, labels, SourceSeries.of(case), scheme, output_format
    )


def write_nifti(path: Path, labels_zyx: np.ndarray, geometry: Geometry, scheme: LabelScheme) -> None:
    """``label_writer``'s ``nifti``: ``write_image`` (the format follows ``path``'s ending)."""
    from autoseg.dataset.imageio import write_image

    write_image(path, labels_zyx, geometry)


def write_dicom_labels(
    path: Path, labels_zyx: np.ndarray, source: SourceSeries, scheme: LabelScheme, output_format: str
) -> None:
    """Write ``labels_zyx`` (Z, Y, X label values, in ``source``'s geometry) as ``output_format`` (``dicom-seg`` or
    ``rtstruct``) into ``path``, atomically."""
    if output_format == "dicom-seg":
        write_dicom_seg(path, labels_zyx, source, scheme)
    elif output_format == "rtstruct":
        write_rtstruct(path, labels_zyx, source, scheme)
    else:
        raise ValueError(f"not a DICOM output format: {output_format!r} (one of {', '.join(DICOM_OUTPUTS)})")


def write_dicom_seg(path: Path, labels_zyx: np.ndarray, source: SourceSeries, scheme: LabelScheme) -> None:
    """``labels_zyx`` as a binary DICOM Segmentation referencing ``source`` (highdicom), into ``path`` atomically.
    Frames without a voxel of their segment are left out (``omit_empty_frames``), so the pixel data grows with the
    slices each segment covers (``autoseg.memory.host.dicom_seg_bytes``)."""
    hd = require("highdicom", EXTRA, "--output-format dicom-seg")
    headers = checked_headers(labels_zyx, source)
    log_empty(labels_zyx, scheme, str(path))
    algorithm = hd.AlgorithmIdentificationSequence(
        name="autoseg",
        version=autoseg.__version__,
        family=hd.sr.CodedConcept("123110", "DCM", "Artificial Intelligence"),
    )
    code = hd.sr.CodedConcept(*GENERIC_CODE)
    descriptions = [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=name,
            segmented_property_category=code,
            segmented_property_type=code,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, name, _ in segments(scheme)
    ]
    try:
        seg = _segmentation(hd, headers, labels_zyx, scheme, descriptions)
    except (ValueError, AttributeError) as e:  # highdicom's checks of the source headers
        raise InputError(
            f"{source.folder}: DICOM series {source.series_uid}: highdicom cannot make a SEG referencing it ({e}); "
            "write NIfTI instead (--output-format nifti)"
        ) from e
    with atomic_path(path, suffix=".dcm") as tmp:
        seg.save_as(tmp)


def _segmentation(hd, headers: list, labels_zyx: np.ndarray, scheme: LabelScheme, descriptions: list):
    """highdicom's binary Segmentation of ``labels_zyx`` over the source slices ``headers``."""
    return hd.seg.Segmentation(
        source_images=headers,
        pixel_array=_seg_pixels(labels_zyx, scheme),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=hd.UID(),
        series_number=SERIES_NUMBER,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="autoseg",
        manufacturer_model_name="autoseg",
        software_versions=autoseg.__version__,
        device_serial_number="0",
        series_description="autoseg segmentation",
        omit_empty_frames=True,
    )


def _seg_pixels(labels_zyx: np.ndarray, scheme: LabelScheme) -> np.ndarray:
    """highdicom's pixel array: plain classes as the label map itself (value = segment number; highdicom takes one
    segment at a time from it), regions as (Z, Y, X, S) bool masks (they overlap: one segment per region)."""
    if not scheme.has_regions:
        return labels_zyx if labels_zyx.dtype == np.uint8 else labels_zyx.astype(np.uint16)
    masks = np.empty((*labels_zyx.shape, len(scheme.names)), dtype=bool)
    for number, _, values in segments(scheme):
        masks[..., number - 1] = np.isin(labels_zyx, values)
    return masks
