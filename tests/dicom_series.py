"""Writing a 3D image as a DICOM series (one 2D file per slice, SimpleITK's ImageSeriesWriter pattern), to
test what reads one back: int16 voxels, the series' geometry carried by the per-slice position and
orientation tags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

FRAME_OF_REFERENCE_UID = "1.2.826.0.1.3680043.2.9.1"  # what a DICOM SEG or RTSTRUCT of the series references


def write_dicom_series(
    folder: Path,
    voxels_zyx: np.ndarray,
    series_uid: str,
    spacing_xyz: tuple[float, float, float] = (0.8, 0.9, 2.5),
    origin_xyz: tuple[float, float, float] = (-10.0, 20.0, 30.0),
    direction: tuple[float, ...] = (1, 0, 0, 0, 1, 0, 0, 0, 1),
    frame_of_reference_uid: str | None = FRAME_OF_REFERENCE_UID,
) -> sitk.Image:
    """Write ``voxels_zyx`` (int16) into ``folder`` as the series ``series_uid`` (files ``{uid}-{i}.dcm``);
    ``frame_of_reference_uid`` None: without one; returns the 3D image written."""
    folder.mkdir(parents=True, exist_ok=True)
    image = sitk.GetImageFromArray(voxels_zyx.astype(np.int16))
    image.SetSpacing(spacing_xyz)
    image.SetOrigin(origin_xyz)
    image.SetDirection(direction)
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()  # keep the series UID set below
    d = direction
    orientation = "\\".join(str(v) for v in (d[0], d[3], d[6], d[1], d[4], d[7]))  # row and column cosines
    for i in range(image.GetDepth()):
        slice_ = image[:, :, i]
        for tag, value in (
            ("0008|0060", "CT"),
            ("0020|000e", series_uid),
            ("0020|000d", "1.2.826.0.1.3680043.2.9"),
            ("0020|0037", orientation),
            ("0020|0013", str(i)),
            ("0008|0008", "DERIVED\\SECONDARY"),
            ("0020|0032", "\\".join(str(v) for v in image.TransformIndexToPhysicalPoint((0, 0, i)))),
            ("0018|0050", str(spacing_xyz[2])),
        ):
            slice_.SetMetaData(tag, value)
        if frame_of_reference_uid is not None:
            slice_.SetMetaData("0020|0052", frame_of_reference_uid)
        writer.SetFileName(str(folder / f"{series_uid}-{i:03d}.dcm"))
        writer.Execute(slice_)
    return image
