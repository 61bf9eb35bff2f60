"""Reading and writing medical images through SimpleITK, in array (z, y, x) order.

autoseg works on arrays in (z, y, x) order; SimpleITK reports spacing and origin in (x, y, z).
``Geometry`` keeps SimpleITK's own vectors (so writing back is exact) and exposes array-order views.
2D images are lifted to 3D with one slice (z = 1), so every stage handles one shape convention.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import SimpleITK as sitk

from autoseg.core.errors import InputError
from autoseg.dataset.dicom_file import check_dicom_series
from autoseg.dataset.nifti import (
    check_complete,
    checked_nifti_layout,
    nifti_nonfinite_voxels,
    nonfinite_message,
    read_float_nifti,
)

SUPPORTED_ENDINGS = (".nii.gz", ".nii", ".nrrd", ".mha", ".mhd")


@dataclass(frozen=True)
class Geometry:
    """Physical geometry of an image as SimpleITK gives it (all vectors in x, y, z order).

    ``ndim`` is the image's own dimension (2 or 3); ``size_xyz``, ``spacing_xyz``, ``origin_xyz``
    have ``ndim`` entries and ``direction`` ``ndim * ndim`` (row-major).
    """

    ndim: int
    size_xyz: tuple[int, ...]
    spacing_xyz: tuple[float, ...]
    origin_xyz: tuple[float, ...]
    direction: tuple[float, ...]

    @property
    def shape_zyx(self) -> tuple[int, int, int]:
        """Array shape in autoseg's 3D convention (2D images have z = 1)."""
        s = tuple(reversed(self.size_xyz))
        return (1, *s) if self.ndim == 2 else s  # type: ignore[return-value]

    @property
    def spacing_zyx(self) -> tuple[float, float, float]:
        """Voxel spacing in mm, array order; a 2D image's z spacing is reported as 999 (never resampled)."""
        s = tuple(float(v) for v in reversed(self.spacing_xyz))
        return (999.0, *s) if self.ndim == 2 else s  # type: ignore[return-value]

    def matches(self, other: Geometry, rtol: float = 1e-3, atol_mm: float = 1e-3) -> str | None:
        """Return a description of the first mismatch with ``other`` (within tolerance), or None."""
        if self.ndim != other.ndim:
            return f"dimension {self.ndim} vs {other.ndim}"
        if self.size_xyz != other.size_xyz:
            return f"size (x,y,z) {self.size_xyz} vs {other.size_xyz}"
        if not np.allclose(self.spacing_xyz, other.spacing_xyz, rtol=rtol, atol=atol_mm):
            return f"spacing (x,y,z) {_fmt(self.spacing_xyz)} vs {_fmt(other.spacing_xyz)}"
        scale = max(1.0, float(np.max(np.abs(self.spacing_xyz))))
        if not np.allclose(self.origin_xyz, other.origin_xyz, rtol=0, atol=max(atol_mm, rtol * scale)):
            return f"origin (x,y,z) {_fmt(self.origin_xyz)} vs {_fmt(other.origin_xyz)}"
        if not np.allclose(self.direction, other.direction, rtol=0, atol=1e-3):
            return f"direction {_fmt(self.direction)} vs {_fmt(other.direction)}"
        return None


def geometry_problem(geometry: Geometry) -> str | None:
    """Why no stage can use an image of ``geometry``, or None: an axis of size 0 (no voxel to train on or predict),
    a spacing that is not finite and positive (SimpleITK's header reports a negative one as written; a full read
    takes its absolute value, so the header and the voxels would disagree)."""
    if min(geometry.size_xyz) < 1:
        return f"size (x,y,z) {geometry.size_xyz} has an axis without voxels"
    if not all(np.isfinite(s) and s > 0 for s in geometry.spacing_xyz):
        return f"spacing (x,y,z) {_fmt(geometry.spacing_xyz)} mm is not finite and positive on every axis"
    return None


def _fmt(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def supported_ending(path: str | Path) -> str | None:
    """The file's image ending (".nii.gz", ".nrrd", ...; the longest that matches), or None."""
    return next((e for e in SUPPORTED_ENDINGS if str(path).lower().endswith(e)), None)


def read_geometry(path: str | Path) -> Geometry:
    """Geometry from the header only (no voxel data read); a NIfTI file is also checked for truncation
    (``check_complete``)."""
    geometry, _ = _header(path)
    check_complete(path)
    return geometry


def _header(path: str | Path) -> tuple[Geometry, int]:
    """Geometry and components per voxel from SimpleITK's header-only read."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError as e:
        raise InputError(
            f"{path}: SimpleITK cannot read this image header ({_first_line(e)}); "
            "the file is damaged, truncated or not an image"
        ) from e
    return image_geometry(reader), reader.GetNumberOfComponents()


def read_image(path: str | Path, dtype: type | None = np.float32) -> tuple[np.ndarray, Geometry]:
    """Read one single-component image. Returns the array, shape (Z, Y, X), in ``dtype`` (None: the file's
    own), and its geometry. A truncated or damaged file is refused (``check_complete`` for NIfTI, which
    SimpleITK would read with zeros in place of the missing voxels; the other formats' readers fail), and so
    is a float NIfTI file storing NaN or Inf (which SimpleITK would read as 0; other formats keep them, and
    ``autoseg.dataset.raw`` refuses them)."""
    layout = checked_nifti_layout(Path(path))
    if layout is not None and layout.float_dtype is not None:
        geometry, components = _header(Path(path))
        array = read_float_nifti(Path(path), layout, geometry.shape_zyx, components)
        if array is not None:
            if dtype is not None and array.dtype != dtype:
                array = array.astype(dtype, copy=False)
            return array, geometry
        nonfinite = nifti_nonfinite_voxels(Path(path), layout)
        if nonfinite:
            raise InputError(nonfinite_message(path, nonfinite))
    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as e:
        raise InputError(
            f"{path}: SimpleITK cannot read this image ({_first_line(e)}); the file is damaged, "
            "truncated or not an image"
        ) from e
    return _array_and_geometry(image, path, dtype)


def _array_and_geometry(image: sitk.Image, path: str | Path, dtype: type | None) -> tuple[np.ndarray, Geometry]:
    """``read_image``'s result from an image SimpleITK read from ``path`` (named in the errors)."""
    if image.GetNumberOfComponentsPerPixel() != 1:
        raise InputError(
            f"{path}: has {image.GetNumberOfComponentsPerPixel()} components per voxel; autoseg expects one "
            "channel per file ({case}_0000, {case}_0001, ...) as in the nnU-Net dataset format"
        )
    if image.GetDimension() not in (2, 3):
        raise InputError(f"{path}: {image.GetDimension()}D images are not supported (2D or 3D only)")
    geometry = image_geometry(image)
    array = sitk.GetArrayFromImage(image)
    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype, copy=False)
    return array.reshape(geometry.shape_zyx), geometry


def image_geometry(image: sitk.Image | sitk.ImageFileReader) -> Geometry:
    """The geometry of a SimpleITK image, or of the header a reader read (its own vectors, x, y, z)."""
    return Geometry(
        ndim=image.GetDimension(),
        size_xyz=tuple(int(v) for v in image.GetSize()),
        spacing_xyz=tuple(float(v) for v in image.GetSpacing()),
        origin_xyz=tuple(float(v) for v in image.GetOrigin()),
        direction=tuple(float(v) for v in image.GetDirection()),
    )


def as_image(array_zyx: np.ndarray, geometry: Geometry) -> sitk.Image:
    """``array_zyx`` (shape ``geometry.shape_zyx``) as a SimpleITK image of ``geometry`` (a 2D one without its
    z = 1 axis)."""
    data = array_zyx[0] if geometry.ndim == 2 else array_zyx
    image = sitk.GetImageFromArray(np.ascontiguousarray(data))
    image.SetSpacing(geometry.spacing_xyz)
    image.SetOrigin(geometry.origin_xyz)
    image.SetDirection(geometry.direction)
    return image


def dicom_series(folder: str | Path) -> dict[str, tuple[str, ...]]:
    """The DICOM series in ``folder`` (not below it): SeriesInstanceUID -> its files in slice order (GDCM's
    sort by position along the slice normal). Empty when the folder holds no DICOM file."""
    uids = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    return {uid: tuple(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), uid)) for uid in uids}


def read_dicom_series(
    folder: str | Path, series_uid: str, dtype: type | None = np.float32
) -> tuple[np.ndarray, Geometry]:
    """Read one DICOM series of ``folder`` as ``read_image`` reads a file: (Z, Y, X) in ``dtype`` (the
    rescale slope and intercept applied: CT in HU) and its geometry (spacing from the slice positions,
    origin of the first slice, direction from the image orientation). A truncated slice file is refused
    (``check_dicom_series``)."""
    files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_uid)
    if not files:
        raise InputError(f"{folder}: no DICOM series {series_uid}")
    check_dicom_series(folder, series_uid)  # GDCM lists a series without the slice files it cannot read
    check_slice_spacing(folder, series_uid, files)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    try:
        image = reader.Execute()
    except RuntimeError as e:
        raise InputError(
            f"{folder}: SimpleITK cannot read DICOM series {series_uid} ({_first_line(e)}); a file "
            "of it is damaged or truncated"
        ) from e
    return _array_and_geometry(image, f"{folder} (DICOM series {series_uid})", dtype)


def read_dicom_series_geometry(folder: str | Path, series_uid: str) -> Geometry:
    """The shape and spacing ``read_dicom_series`` reads series ``series_uid`` of ``folder`` with, from its first and
    last slice headers (no voxel read): the first slice's size and pixel spacing, the slice count, the mean spacing
    between the slices along their normal; the origin and direction are the first slice's (what a memory plan
    needs: a 300-slice series is not scanned as a volume for it)."""
    files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_uid)
    if not files:
        raise InputError(f"{folder}: no DICOM series {series_uid}")
    first, _ = _header(files[0])
    if first.ndim != 3:  # one 2D slice
        return first
    gap = abs(_position_along_normal(files[-1]) - _position_along_normal(files[0])) / max(len(files) - 1, 1)
    return replace(
        first,
        size_xyz=(*first.size_xyz[:2], len(files)),
        spacing_xyz=(*first.spacing_xyz[:2], gap if len(files) > 1 else first.spacing_xyz[2]),
    )


SLICE_SPACING_TOLERANCE = 0.01  # of the series' median spacing: the reader assumes one spacing for every slice


def check_slice_spacing(folder: str | Path, series_uid: str, files: Sequence[str]) -> None:
    """Refuse a series whose slices (``files``, in GDCM's order along the slice normal) are not evenly spaced: a
    gap deviating from the median spacing by more than ``SLICE_SPACING_TOLERANCE`` of it, a missing slice among
    them. SimpleITK reads such a series with one spacing and only a warning, which puts every slice after the gap
    in the wrong place."""
    if len(files) < 3:
        return
    positions = np.array([_position_along_normal(f) for f in files])
    gaps = np.diff(positions)
    spacing = float(np.median(gaps))
    off = np.abs(gaps - spacing) > SLICE_SPACING_TOLERANCE * abs(spacing)
    if spacing == 0 or off.any():
        i = int(np.argmax(off)) if spacing else 0
        missing = round(gaps[i] / spacing) - 1 if spacing else 0
        hint = f" ({missing} slice(s) missing?)" if missing >= 1 else ""
        raise InputError(
            f"{folder}: DICOM series {series_uid}: its slices are not evenly spaced: {Path(files[i]).name} and "
            f"{Path(files[i + 1]).name} lie {abs(gaps[i]):.4g} mm apart, the series' other slices "
            f"{abs(spacing):.4g} mm{hint}; read as one volume, every slice after the gap would be misplaced. "
            "Export the complete series again, or convert it with a tool that resamples uneven slices (e.g. "
            "dcm2niix) and predict the NIfTI file"
        )


def _position_along_normal(path: str) -> float:
    """A slice file's Image Position (Patient) projected on its slice normal (from Image Orientation), in mm."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(path)
    reader.ReadImageInformation()
    try:
        position = [float(v) for v in reader.GetMetaData("0020|0032").split("\\")]
        orientation = [float(v) for v in reader.GetMetaData("0020|0037").split("\\")]
    except (RuntimeError, ValueError) as e:
        raise InputError(f"{path}: no readable Image Position / Orientation (Patient) ({_first_line(e)})") from e
    normal = np.cross(orientation[:3], orientation[3:6])
    return float(np.dot(position, normal))


def write_image(path: str | Path, array_zyx: np.ndarray, geometry: Geometry) -> None:
    """Write ``array_zyx`` (shape ``geometry.shape_zyx``) with ``geometry``, atomically."""
    from autoseg.core.artifacts import atomic_path

    if tuple(array_zyx.shape) != geometry.shape_zyx:
        raise InputError(f"{path}: array shape {array_zyx.shape} does not match geometry {geometry.shape_zyx}")
    image = as_image(array_zyx, geometry)
    suffix = supported_ending(path) or ""
    if suffix == ".mhd":
        _write_metaimage_pair(Path(path), image)
        return
    with atomic_path(path, suffix=suffix) as tmp:
        sitk.WriteImage(image, str(tmp), useCompression=True)


def _write_metaimage_pair(path: Path, image: sitk.Image) -> None:
    """A .mhd header names its data file (``<stem>.zraw``): both are written under their final names in a
    temporary folder beside ``path`` (named as ``atomic_path`` names temporaries, so a killed run's folder is
    removed by ``remove_stale_temporaries``), then the data file and the header are renamed into place (a
    header written under a temporary name would point at a temporary data file)."""
    import shutil
    import tempfile

    from autoseg.core.artifacts import WriteError

    folder = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        sitk.WriteImage(image, str(folder / path.name), useCompression=True)
        for written in sorted(folder.iterdir(), key=lambda f: f.name == path.name):  # the header last
            os.replace(written, path.parent / written.name)
    except (OSError, RuntimeError) as e:
        raise WriteError(path, _first_line(e)) from e
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _first_line(e: Exception) -> str:
    # ITK appends the C library's last errno ("Reason: No such file or directory") even when the file exists
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("Reason:")]
    return lines[-1] if lines else type(e).__name__
