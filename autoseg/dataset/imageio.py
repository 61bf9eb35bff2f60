"""Reading and writing medical images through SimpleITK, in array (z, y, x) order.

autoseg works on arrays in (z, y, x) order; SimpleITK reports spacing and origin in (x, y, z).
``Geometry`` keeps SimpleITK's own vectors (so writing back is exact) and exposes array-order views.
2D images are lifted to 3D with one slice (z = 1), so every stage handles one shape convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import SimpleITK as sitk

from autoseg.core.errors import InputError

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


def _fmt(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def supported_ending(path: str | Path) -> str | None:
    """The file's image ending (".nii.gz", ".nrrd", ...; the longest that matches), or None."""
    return next((e for e in SUPPORTED_ENDINGS if str(path).lower().endswith(e)), None)


def read_geometry(path: str | Path) -> Geometry:
    """Geometry from the header only (no voxel data read)."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError as e:
        raise InputError(f"{path}: SimpleITK cannot read this image header ({_first_line(e)})") from e
    return Geometry(
        ndim=reader.GetDimension(),
        size_xyz=tuple(int(v) for v in reader.GetSize()),
        spacing_xyz=tuple(float(v) for v in reader.GetSpacing()),
        origin_xyz=tuple(float(v) for v in reader.GetOrigin()),
        direction=tuple(float(v) for v in reader.GetDirection()),
    )


def read_image(path: str | Path, dtype: type | None = np.float32) -> tuple[np.ndarray, Geometry]:
    """Read one single-component image. Returns the array, shape (Z, Y, X), in ``dtype`` (None: the file's
    own), and its geometry."""
    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as e:
        raise InputError(f"{path}: SimpleITK cannot read this image ({_first_line(e)})") from e
    if image.GetNumberOfComponentsPerPixel() != 1:
        raise InputError(
            f"{path}: has {image.GetNumberOfComponentsPerPixel()} components per voxel; autoseg expects one "
            "channel per file ({case}_0000, {case}_0001, ...) as in the nnU-Net dataset format"
        )
    if image.GetDimension() not in (2, 3):
        raise InputError(f"{path}: {image.GetDimension()}D images are not supported (2D or 3D only)")
    geometry = Geometry(
        ndim=image.GetDimension(),
        size_xyz=tuple(int(v) for v in image.GetSize()),
        spacing_xyz=tuple(float(v) for v in image.GetSpacing()),
        origin_xyz=tuple(float(v) for v in image.GetOrigin()),
        direction=tuple(float(v) for v in image.GetDirection()),
    )
    array = sitk.GetArrayFromImage(image)
    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype, copy=False)
    return array.reshape(geometry.shape_zyx), geometry


def write_image(path: str | Path, array_zyx: np.ndarray, geometry: Geometry) -> None:
    """Write ``array_zyx`` (shape ``geometry.shape_zyx``) with ``geometry``, atomically."""
    from autoseg.core.artifacts import atomic_path

    if tuple(array_zyx.shape) != geometry.shape_zyx:
        raise InputError(f"{path}: array shape {array_zyx.shape} does not match geometry {geometry.shape_zyx}")
    data = array_zyx[0] if geometry.ndim == 2 else array_zyx
    image = sitk.GetImageFromArray(np.ascontiguousarray(data))
    image.SetSpacing(geometry.spacing_xyz)
    image.SetOrigin(geometry.origin_xyz)
    image.SetDirection(geometry.direction)
    suffix = supported_ending(path) or ""
    with atomic_path(path, suffix=suffix) as tmp:
        sitk.WriteImage(image, str(tmp), useCompression=True)


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
