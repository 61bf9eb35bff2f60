"""`autoseg predict --output-format dicom-seg|rtstruct` through the real CLI: the DICOM objects hold the label map the
NIfTI output holds, and asking for them where they cannot be written is refused before any prediction."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli, snapshot
from dicom_series import write_dicom_series
from extras import require_extra

from autoseg.dataset.dicom_source import SourceSeries
from autoseg.dataset.raw import Case

UID = "1.2.826.0.1.3680043.8.498.79"


def _predict(capsys, trained: Path, inputs: Path, out: Path, *flags: str):
    return run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", trained, "--no-mirror", *flags)


@pytest.mark.slow  # the trained fixture
def test_a_dicom_series_is_written_as_seg_and_rtstruct_holding_the_nifti_label_map(
    capsys, trained: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    pydicom = require_extra("pydicom")
    require_extra("highdicom")
    voxels = sitk.GetArrayFromImage(sitk.ReadImage(str(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz")))
    series = tmp_path / "patient_9"
    write_dicom_series(series, np.round(voxels * 100), UID)
    out = tmp_path / "out"
    for output in ("nifti", "dicom-seg", "rtstruct"):
        assert _predict(capsys, trained, series, out, "--output-format", output).status == 0
    assert sorted(snapshot(out)) == ["patient_9.dcm", "patient_9.nii.gz", "patient_9_rtstruct.dcm"]
    labels = sitk.GetArrayFromImage(sitk.ReadImage(str(out / "patient_9.nii.gz")))
    headers = SourceSeries.of(Case("patient_9", (series,), None, series_uid=UID)).headers()
    seg = pydicom.dcmread(out / "patient_9.dcm")
    from_seg = np.zeros_like(labels)
    positions = np.array([[float(v) for v in h.ImagePositionPatient] for h in headers])
    for frame, item in zip(seg.pixel_array.reshape(-1, *labels.shape[1:]), seg.PerFrameFunctionalGroupsSequence):
        where = np.array([float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient])
        z = int(np.argmin(np.linalg.norm(positions - where, axis=1)))
        from_seg[z][frame.astype(bool)] = int(item.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
    np.testing.assert_array_equal(from_seg, labels)
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["organ", "lesion"]
    rtstruct = pydicom.dcmread(out / "patient_9_rtstruct.dcm")
    assert [r.ROIName for r in rtstruct.StructureSetROISequence] == ["organ", "lesion"]
    assert rtstruct.StudyInstanceUID == headers[0].StudyInstanceUID


@pytest.mark.slow  # the trained fixture
def test_dicom_outputs_of_images_or_without_the_extra_are_refused_before_predicting(
    capsys, trained: Path, inputs: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    result = _predict(capsys, trained, inputs, out, "--output-format", "dicom-seg")
    assert_refused(result, 2, inputs / "demo_005_0000.nii.gz", "is not a DICOM series", "--output-format nifti")
    assert snapshot(out) == {}
    monkeypatch.setitem(sys.modules, "skimage.measure", None)  # as if the dicom extra were not installed
    series = tmp_path / "series"
    write_dicom_series(series, np.zeros((3, 8, 8)), UID)
    result = _predict(capsys, trained, series, out, "--output-format", "rtstruct")
    assert_refused(result, 2, "--output-format rtstruct", 'pip install "autoseg[dicom]"')
    assert snapshot(out) == {}
