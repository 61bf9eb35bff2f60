"""NIfTI files read by their header, beside SimpleITK: ``check_complete`` refuses a truncated file (which SimpleITK
would read with zeros in place of the missing voxels), ``read_float_nifti`` reads a float image in one pass over
its voxels and ``nifti_nonfinite_voxels`` counts the NaN/Inf voxels SimpleITK would read as 0.
``autoseg.dataset.imageio.read_image`` calls them for .nii and .nii.gz files.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # inflates gzip faster than zlib and than SimpleITK's NIfTI read, with zlib's API
    from isal import isal_zlib as inflate_lib
except ImportError:  # a platform without an isal wheel: the standard library's zlib
    inflate_lib = zlib

from autoseg.core.errors import InputError

GZIP_READ_CHUNK_BYTES = 1 << 22  # compressed bytes read (and allocated) at a time by the float NIfTI reader


def check_complete(path: str | Path) -> None:
    """Refuse a NIfTI file (.nii, .nii.gz) that holds fewer bytes than its header announces.

    SimpleITK reads a truncated NIfTI image without an error, with zeros in place of the missing voxels
    (its NRRD and MetaImage readers do fail). Expected size: vox_offset + voxels x bytes per voxel, from the
    header. Uncompressed: compared with the file size. Gzip: compared with the last member's ISIZE field
    (the uncompressed size mod 2**32, the file's last 4 bytes), which costs one small read; only when they
    differ (a truncated stream, or several gzip members) is the whole file decompressed to count its bytes
    and check its CRC. Other formats: nothing to do here.
    """
    checked_nifti_layout(Path(path))


@dataclass(frozen=True)
class NiftiLayout:
    compressed: bool  # gzip
    vox_offset: int  # where the voxels start (uncompressed)
    expected_bytes: int  # vox_offset + voxels x bytes per voxel
    float_dtype: np.dtype | None  # float32/float64 voxels (byte order included), else None
    scaled: bool = False  # scl_slope/scl_inter change the stored values (SimpleITK applies them)


_NIFTI1_HEADER_BYTES, _NIFTI2_HEADER_BYTES = 348, 540
_NIFTI_FLOAT_TYPES = {16: "f4", 64: "f8"}  # NIfTI datatype codes of float32, float64


def checked_nifti_layout(path: Path) -> NiftiLayout | None:
    """The layout of a complete NIfTI file (InputError if truncated); None for other files."""
    if not str(path).lower().endswith((".nii", ".nii.gz")):
        return None
    with open(path, "rb") as f:
        compressed = f.read(2) == b"\x1f\x8b"  # gzip's magic; SimpleITK also reads a plain file named .nii.gz
    try:
        with gzip.open(path, "rb") if compressed else open(path, "rb") as f:
            layout = _nifti_layout(f.read(_NIFTI2_HEADER_BYTES), compressed)
        if layout is None:
            return None  # not a NIfTI header we know: SimpleITK's own reader decides
        expected = layout.expected_bytes
        actual = _gzip_size(path, expected) if compressed else path.stat().st_size
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: damaged or truncated gzip stream ({e}); copy or export the file again") from e
    if actual < expected:
        raise InputError(
            f"{path}: truncated: the NIfTI header announces {expected} bytes (header and voxels) but "
            f"the file holds {actual}{' uncompressed' if compressed else ''}; "
            "copy or export the file again"
        )
    return layout


def _nifti_layout(header: bytes, compressed: bool) -> NiftiLayout | None:
    """Parse a NIfTI-1 or NIfTI-2 header (either byte order); None if it is not one."""
    for order in "<>":
        if len(header) >= _NIFTI1_HEADER_BYTES and struct.unpack(order + "i", header[:4])[0] == _NIFTI1_HEADER_BYTES:
            dims = struct.unpack(order + "8h", header[40:56])
            datatype, bitpix = struct.unpack(order + "2h", header[70:74])
            vox_offset = int(struct.unpack(order + "f", header[108:112])[0])
            slope, inter = struct.unpack(order + "2f", header[112:120])
            break
        if len(header) >= _NIFTI2_HEADER_BYTES and struct.unpack(order + "i", header[:4])[0] == _NIFTI2_HEADER_BYTES:
            datatype, bitpix = struct.unpack(order + "2h", header[12:16])
            dims = struct.unpack(order + "8q", header[16:80])
            vox_offset = struct.unpack(order + "q", header[168:176])[0]
            slope, inter = struct.unpack(order + "2d", header[176:192])
            break
    else:
        return None
    if not 1 <= dims[0] <= 7 or bitpix <= 0 or bitpix % 8:
        return None
    voxels = int(np.prod([max(int(d), 1) for d in dims[1 : dims[0] + 1]], dtype=np.int64))
    vox_offset = max(vox_offset, _NIFTI1_HEADER_BYTES)
    float_type = _NIFTI_FLOAT_TYPES.get(datatype)
    scaled = not (slope in (0.0, 1.0) and inter == 0.0) and math.isfinite(slope)  # NIfTI: slope 0 means none
    return NiftiLayout(
        compressed,
        vox_offset,
        vox_offset + voxels * bitpix // 8,
        np.dtype(order + float_type) if float_type else None,
        scaled,
    )


def nonfinite_message(path: str | Path, count: int) -> str:
    return (
        f"{path}: holds {count} NaN or Inf voxel(s) (SimpleITK would read them as 0); replace them "
        "(e.g. with the image's minimum) and run again"
    )


def read_float_nifti(path: Path, layout: NiftiLayout, shape_zyx: tuple[int, ...], components: int) -> np.ndarray | None:
    """A float NIfTI image read in one pass over its voxels, NaN/Inf refused: the voxels straight into the
    array (x fastest, as SimpleITK lays them out: (Z, Y, X)); ``shape_zyx`` and ``components`` (per voxel) from
    SimpleITK's header read (the caller's, with the geometry). Costs what SimpleITK's own read costs, with one
    copy of the image in memory instead of two (measured equal arrays, see the tests). None when the file needs
    what SimpleITK does beyond that (intensity scaling, several components, more than 3 dimensions: a shape of
    other than 3 axes): the caller reads it through SimpleITK."""
    voxels = int(np.prod(shape_zyx))
    if (
        layout.scaled
        or components != 1
        or len(shape_zyx) != 3
        or voxels * layout.float_dtype.itemsize != layout.expected_bytes - layout.vox_offset
    ):
        return None
    array = np.empty(shape_zyx, dtype=layout.float_dtype)
    view = memoryview(array.reshape(-1)).cast("B")
    filled = _read_voxel_bytes(path, layout, view)
    if filled < len(view):  # check_complete passed, so only a file changed under us gets here
        raise InputError(f"{path}: ended after {filled} of {len(view)} voxel bytes; copy or export the file again")
    nonfinite = array.size - int(np.count_nonzero(np.isfinite(array)))
    if nonfinite:
        raise InputError(nonfinite_message(path, nonfinite))
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _read_voxel_bytes(path: Path, layout: NiftiLayout, view: memoryview) -> int:
    """Fill ``view`` with the file's voxel bytes (those after vox_offset); the number of bytes filled.
    Gzip: inflated (isal, else zlib) ``GZIP_READ_CHUNK_BYTES`` of compressed bytes at a time, every gzip member
    in turn."""
    with open(path, "rb", buffering=0) as f:
        if not layout.compressed:
            f.seek(layout.vox_offset)
            filled = 0
            while filled < len(view) and (n := f.readinto(view[filled:])):
                filled += n
            return filled
        skip, filled, inflate = layout.vox_offset, 0, inflate_lib.decompressobj(16 + zlib.MAX_WBITS)
        while filled < len(view) and (chunk := f.read(GZIP_READ_CHUNK_BYTES)):
            while chunk and filled < len(view):
                out = memoryview(inflate.decompress(chunk))
                chunk = b""
                if inflate.eof:  # the next gzip member, if any, starts in the unused bytes
                    chunk, inflate = inflate.unused_data, inflate_lib.decompressobj(16 + zlib.MAX_WBITS)
                cut = min(skip, len(out))
                skip, out = skip - cut, out[cut:]
                n = min(len(out), len(view) - filled)
                view[filled : filled + n] = out[:n]
                filled += n
        return filled


def nifti_nonfinite_voxels(path: Path, layout: NiftiLayout) -> int:
    """How many NaN/Inf voxels a float NIfTI file stores. SimpleITK (niftilib) replaces them by 0 when it
    reads, so they are counted from the file: one more pass over its voxels, 1 MiB at a time, which costs more
    than SimpleITK's own read of a .nii.gz (Python's zlib is slower than ITK's) and little beside a .nii's."""
    dtype = layout.float_dtype
    assert dtype is not None
    count, step = 0, (1 << 20) // dtype.itemsize * dtype.itemsize
    with gzip.open(path, "rb") if layout.compressed else open(path, "rb") as f:
        f.seek(layout.vox_offset)
        remaining = layout.expected_bytes - layout.vox_offset
        while remaining > 0 and (chunk := f.read(min(step, remaining))):
            remaining -= len(chunk)
            values = np.frombuffer(chunk, dtype=dtype)
            count += values.size - int(np.count_nonzero(np.isfinite(values)))
    return count


def _gzip_size(path: Path, expected: int) -> int:
    """The uncompressed size of a gzip file: ``expected`` when its ISIZE field agrees, else counted by
    decompressing the whole file (raises EOFError on a truncated stream, BadGzipFile on a bad CRC)."""
    with open(path, "rb") as f:
        f.seek(-4, 2)
        if struct.unpack("<I", f.read(4))[0] == expected % 2**32:
            return expected
    total = 0
    with gzip.open(path, "rb") as g:
        while chunk := g.read(1 << 24):
            total += len(chunk)
    return total
