from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import (
    Geometry,
    dicom_series,
    read_dicom_series,
    read_dicom_series_geometry,
    read_geometry,
    read_image,
    write_image,
)

# Spacings and origins exactly representable in float32 (NIfTI stores both as float32), so a round trip
# must give them back bit for bit; the directions are axis permutations with flips (exact in a quaternion).
GEOMETRY_3D = Geometry(
    ndim=3,
    size_xyz=(5, 4, 3),
    spacing_xyz=(0.75, 0.5, 3.0),
    origin_xyz=(-10.0, 5.5, 2.25),
    direction=(0.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0),
)
GEOMETRY_2D = Geometry(
    ndim=2, size_xyz=(5, 4), spacing_xyz=(0.25, 1.5), origin_xyz=(-3.5, 40.125), direction=(0.0, -1.0, 1.0, 0.0)
)


def _voxels(dtype: type, shape_zyx: tuple[int, ...]) -> np.ndarray:
    """Distinct values that also reach the dtype's extremes (a clipped or narrowed write changes them), and
    for floats fractions and magnitudes that float32 (or float16) cannot hold exactly."""
    n = int(np.prod(shape_zyx))
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        values = np.linspace(info.min, info.max, n).round().astype(dtype)
    else:
        values = np.linspace(-1e5, 1e5, n).astype(dtype) + np.asarray(1 / 3, dtype=dtype)
        if dtype == np.float64:
            values[0] = 1 + 2.0**-40  # rounds to 1.0 in float32
    np.random.default_rng(0).shuffle(values)  # no ramp along any axis: a flip or transpose changes voxels
    return values.reshape(shape_zyx)


@pytest.mark.parametrize("ending", [".nii.gz", ".nrrd", ".mha"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("geometry", [GEOMETRY_3D, GEOMETRY_2D], ids=["3d", "2d"])
def test_write_then_read_gives_back_every_voxel_and_the_geometry(tmp_path, ending, dtype, geometry):
    array = _voxels(dtype, geometry.shape_zyx)
    path = tmp_path / f"a{ending}"
    write_image(path, array, geometry)
    back, geo = read_image(path, dtype=None)
    assert back.dtype == array.dtype and back.shape == geometry.shape_zyx
    np.testing.assert_array_equal(back, array)
    assert geo == geometry and read_geometry(path) == geometry
    as_float32, _ = read_image(path)  # the default: float32, values as close as float32 holds them
    assert as_float32.dtype == np.float32
    np.testing.assert_array_equal(as_float32, array.astype(np.float32))
    stored = sitk.ReadImage(str(path))  # the file itself, as another tool reads it
    assert stored.GetDimension() == geometry.ndim and stored.GetSize() == geometry.size_xyz
    assert stored.GetSpacing() == geometry.spacing_xyz and stored.GetOrigin() == geometry.origin_xyz
    assert stored.GetDirection() == geometry.direction
    voxels = sitk.GetArrayFromImage(stored)
    np.testing.assert_array_equal(voxels, array[0] if geometry.ndim == 2 else array)
    assert not [p for p in tmp_path.iterdir() if p.name != path.name]  # no temporary left


@pytest.mark.parametrize("ending", [".nii.gz", ".nrrd", ".mha"])
def test_read_then_write_keeps_a_foreign_file_exactly(tmp_path, ending):
    """A file written by SimpleITK with an oblique direction and spacings float32 cannot hold: read, written
    back, the copy has the original's voxels and header as stored (NIfTI: spacing and origin in float32)."""
    arr = _voxels(np.float32, (3, 4, 5))
    image = sitk.GetImageFromArray(arr)
    image.SetSpacing((0.7, 0.8, 3.1))
    image.SetOrigin((-10.1, 5.5, 2.3))
    c, s = np.cos(0.3), np.sin(0.3)
    image.SetDirection((c, -s, 0.0, s, c, 0.0, 0.0, 0.0, 1.0))
    src = tmp_path / f"a{ending}"
    sitk.WriteImage(image, str(src))
    data, geo = read_image(src)
    np.testing.assert_array_equal(data, arr)
    original = sitk.ReadImage(str(src))  # as stored
    assert geo.spacing_zyx == tuple(reversed(original.GetSpacing())) == pytest.approx((3.1, 0.8, 0.7))
    out = tmp_path / f"b{ending}"
    write_image(out, data, geo)
    back = sitk.ReadImage(str(out))
    np.testing.assert_array_equal(sitk.GetArrayFromImage(back), arr)
    # NRRD stores spacing x direction as one vector per axis: splitting it again may move the last bit
    np.testing.assert_allclose(back.GetSpacing(), original.GetSpacing(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(back.GetOrigin(), original.GetOrigin(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(back.GetDirection(), original.GetDirection(), rtol=0, atol=1e-7)
    assert read_geometry(out).matches(geo, rtol=1e-7, atol_mm=1e-7) is None


def test_2d_image_is_lifted_to_one_slice(tmp_path):
    pixels = _voxels(np.uint8, (6, 7))
    image = sitk.GetImageFromArray(pixels)
    image.SetSpacing((0.5, 0.25))
    sitk.WriteImage(image, str(tmp_path / "x.nii.gz"))
    data, geo = read_image(tmp_path / "x.nii.gz")
    assert data.shape == (1, 6, 7) and geo.ndim == 2
    np.testing.assert_array_equal(data[0], pixels)
    assert geo.spacing_zyx == (999.0, 0.25, 0.5)
    write_image(tmp_path / "y.nii.gz", data, geo)
    back = sitk.ReadImage(str(tmp_path / "y.nii.gz"))
    assert back.GetDimension() == 2 and back.GetSpacing() == (0.5, 0.25)
    np.testing.assert_array_equal(sitk.GetArrayFromImage(back), pixels)


def test_write_refuses_an_array_of_another_shape(tmp_path):
    with pytest.raises(ValueError, match=r"array shape \(3, 4, 6\) does not match geometry \(3, 4, 5\)"):
        write_image(tmp_path / "a.nii.gz", np.zeros((3, 4, 6), np.float32), GEOMETRY_3D)
    assert not list(tmp_path.iterdir())


def test_unreadable_file_names_it(tmp_path):
    bad = tmp_path / "broken.nii.gz"
    bad.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="broken.nii.gz: SimpleITK cannot read"):
        read_image(bad)


def _truncate(path, keep_fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])


@pytest.mark.parametrize(
    ("ending", "keep_fraction"),
    [(".nii.gz", 0.5), (".nii.gz", None), (".nii", 0.5), (".nii", None), (".nrrd", 0.5), (".mha", 0.5), (".mha", None)],
)
def test_truncated_file_is_refused_naming_it(tmp_path, ending, keep_fraction):
    """SimpleITK reads a truncated NIfTI file with zeros for the missing voxels; autoseg refuses it (and the
    readers of the other formats fail on their own). For NIfTI and MetaImage, one missing byte is enough
    (None: the last byte cut)."""
    path = tmp_path / f"cut{ending}"
    write_image(path, _voxels(np.int16, GEOMETRY_3D.shape_zyx), GEOMETRY_3D)
    if keep_fraction is None:
        path.write_bytes(path.read_bytes()[:-1])
    else:
        _truncate(path, keep_fraction)
    with pytest.raises(ValueError, match=r"cut\.") as refused:
        read_image(path)
    assert "truncated" in str(refused.value)
    if ending.startswith(".nii"):  # the header-only read of the integrity check catches it too
        with pytest.raises(ValueError, match=r"cut\.nii.*truncated"):
            read_geometry(path)


def test_gzip_of_several_members_is_counted_whole(tmp_path):
    """A NIfTI gzip written as several members has the last member's size in its trailer: the file is then
    decompressed to count its bytes, accepted when complete and refused when one byte is missing."""
    plain = tmp_path / "a.nii"
    array = _voxels(np.int16, GEOMETRY_3D.shape_zyx)
    write_image(plain, array, GEOMETRY_3D)
    raw = plain.read_bytes()
    members = tmp_path / "members.nii.gz"
    members.write_bytes(gzip.compress(raw[:400]) + gzip.compress(raw[400:]))
    np.testing.assert_array_equal(read_image(members, dtype=None)[0], array)
    members.write_bytes(gzip.compress(raw[:400]) + gzip.compress(raw[400:-1]))
    with pytest.raises(ValueError, match=r"members\.nii\.gz: truncated.*holds \d+ uncompressed"):
        read_geometry(members)


def test_complete_nifti_with_trailing_bytes_is_read(tmp_path):
    path = tmp_path / "a.nii"
    write_image(path, _voxels(np.int16, GEOMETRY_3D.shape_zyx), GEOMETRY_3D)
    path.write_bytes(path.read_bytes() + b"\0\0")
    assert read_image(path)[1] == GEOMETRY_3D


def test_plain_nifti_named_nii_gz_is_read(tmp_path):
    """SimpleITK reads an uncompressed NIfTI file named .nii.gz; the truncation check follows the content."""
    plain = tmp_path / "a.nii"
    write_image(plain, _voxels(np.int16, GEOMETRY_3D.shape_zyx), GEOMETRY_3D)
    renamed = plain.rename(tmp_path / "a.nii.gz")
    assert read_image(renamed)[1] == GEOMETRY_3D
    renamed.write_bytes(renamed.read_bytes()[:-1])
    with pytest.raises(ValueError, match="a.nii.gz: truncated"):
        read_geometry(renamed)


@pytest.mark.parametrize("ending", [".nii.gz", ".nii"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_float_nifti_with_nan_or_inf_is_refused(tmp_path, ending, dtype, bad):
    """SimpleITK's NIfTI reader (niftilib) turns NaN and Inf into 0 without a word; autoseg refuses the file."""
    path = tmp_path / f"a{ending}"
    array = _voxels(dtype, GEOMETRY_3D.shape_zyx)
    write_image(path, array, GEOMETRY_3D)
    assert read_image(path, dtype=None)[0].dtype == dtype  # finite: read as before
    array[1, 2, 3] = bad
    array[2, 0, 0] = bad
    write_image(path, array, GEOMETRY_3D)
    with pytest.raises(ValueError, match=rf"a{ending}: holds 2 NaN or Inf voxel"):
        read_image(path)


@pytest.mark.parametrize("ending", [".nii.gz", ".nii"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5, 6, 7), (6, 7)])
@pytest.mark.parametrize("direction", [(1, 0, 0, 0, 1, 0, 0, 0, 1), (0, -1, 0, 1, 0, 0, 0, 0, -1)])
def test_float_nifti_read_in_one_pass_equals_simpleitk(tmp_path, ending, dtype, shape, direction):
    array = np.random.default_rng(0).normal(size=shape).astype(dtype)
    image = sitk.GetImageFromArray(array)
    image.SetSpacing((0.7, 0.8, 2.5)[: len(shape)])
    image.SetOrigin((-10.0, 4.0, 7.0)[: len(shape)])
    image.SetDirection(direction if len(shape) == 3 else (0, -1, 1, 0))
    path = tmp_path / f"img{ending}"
    sitk.WriteImage(image, str(path))
    expected = sitk.ReadImage(str(path))
    got, geometry = read_image(path, dtype=None)
    want = sitk.GetArrayFromImage(expected)
    assert got.dtype == want.dtype and got.tobytes() == want.reshape(got.shape).tobytes()
    assert geometry.direction == expected.GetDirection() and geometry.origin_xyz == expected.GetOrigin()


def test_scaled_float_nifti_is_read_through_simpleitk(tmp_path):
    """scl_slope/scl_inter (NIfTI-1 header bytes 112-120) change the values: SimpleITK applies them."""
    import struct

    path = tmp_path / "img.nii"
    sitk.WriteImage(sitk.GetImageFromArray(np.arange(60, dtype=np.float32).reshape(3, 4, 5)), str(path))
    raw = bytearray(path.read_bytes())
    raw[112:120] = struct.pack("<2f", 2.0, 1.0)
    path.write_bytes(bytes(raw))
    got, _ = read_image(path)
    assert np.array_equal(got, sitk.GetArrayFromImage(sitk.ReadImage(str(path))))
    assert got.ravel()[3] == 7.0  # 3 * 2 + 1


def test_metaimage_pair_is_written_under_its_final_names(tmp_path):
    """The .mhd header names its data file: after a write (and an overwrite) the header points at
    <stem>.zraw beside it and no temporary file or folder is left."""
    geometry = Geometry(3, (5, 4, 3), (1.0, 1.0, 2.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))
    first = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    for array in (first, first * 2):
        write_image(tmp_path / "case.mhd", array, geometry)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["case.mhd", "case.zraw"]
        assert "ElementDataFile = case.zraw" in (tmp_path / "case.mhd").read_text()
        assert np.array_equal(read_image(tmp_path / "case.mhd", dtype=None)[0], array)


def test_a_killed_metaimage_write_leaves_a_folder_the_next_run_removes(tmp_path):
    from autoseg.core.artifacts import remove_stale_temporaries

    stale = tmp_path / ".case.mhd.x1y2.tmp"
    stale.mkdir()
    (stale / "case.zraw").write_bytes(b"partial")
    assert remove_stale_temporaries(tmp_path, ["case.mhd"]) == [stale] and not stale.exists()


def test_float_nifti_reads_the_same_with_the_standard_zlib(tmp_path, monkeypatch):
    """Where no isal wheel exists, the one-pass reader inflates with zlib: same voxels."""
    import zlib

    import autoseg.dataset.nifti as nifti

    array = np.random.default_rng(1).normal(size=(4, 5, 6)).astype(np.float32)
    sitk.WriteImage(sitk.GetImageFromArray(array), str(tmp_path / "img.nii.gz"))
    fast = read_image(tmp_path / "img.nii.gz")[0]
    monkeypatch.setattr(nifti, "inflate_lib", zlib)
    assert np.array_equal(read_image(tmp_path / "img.nii.gz")[0], fast) and np.array_equal(fast, array)


def test_dicom_series_reads_back_its_voxels_and_geometry(tmp_path):
    """A series written slice by slice (rotated in-plane, anisotropic): the voxels and the geometry come
    back from the per-slice tags; a second series in the folder is listed beside it."""
    voxels = np.random.default_rng(0).integers(-1000, 2000, (5, 7, 6)).astype(np.int16)
    c, s = math.cos(0.3), math.sin(0.3)
    written = write_dicom_series(
        tmp_path,
        voxels,
        "1.2.3.1",
        spacing_xyz=(0.7, 0.9, 2.5),
        origin_xyz=(-10.0, 20.0, 30.0),
        direction=(c, -s, 0, s, c, 0, 0, 0, 1),
    )
    write_dicom_series(tmp_path, voxels[:3], "1.2.3.2")
    assert {uid: len(files) for uid, files in dicom_series(tmp_path).items()} == {"1.2.3.1": 5, "1.2.3.2": 3}
    array, geometry = read_dicom_series(tmp_path, "1.2.3.1")
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, voxels)
    assert geometry.ndim == 3 and geometry.size_xyz == (6, 7, 5)
    np.testing.assert_allclose(geometry.spacing_xyz, written.GetSpacing(), atol=1e-5)
    np.testing.assert_allclose(geometry.origin_xyz, written.GetOrigin(), atol=1e-5)
    np.testing.assert_allclose(geometry.direction, written.GetDirection(), atol=1e-5)
    with pytest.raises(InputError, match="no DICOM series 9.9"):
        read_dicom_series(tmp_path, "9.9")


def test_a_dicom_series_with_a_truncated_slice_is_refused_naming_it(tmp_path):
    """GDCM leaves a slice it cannot read out of the series, and SimpleITK's reader then read the other 4 of 5
    slices as the volume with only a warning: the slice file is refused by name instead."""
    voxels = np.random.default_rng(0).integers(-1000, 2000, (5, 7, 6)).astype(np.int16)
    write_dicom_series(tmp_path, voxels, "1.2.3.1")
    write_dicom_series(tmp_path, voxels[:3], "1.2.3.2")
    cut = tmp_path / "1.2.3.1-002.dcm"
    cut.write_bytes(cut.read_bytes()[:-1])
    with pytest.raises(InputError, match=rf"DICOM series 1.2.3.1: {cut}: truncated: element \(7FE0,0010\)"):
        read_dicom_series(tmp_path, "1.2.3.1")
    np.testing.assert_array_equal(read_dicom_series(tmp_path, "1.2.3.2")[0], voxels[:3])  # the other one is whole


def test_a_dicom_series_with_a_missing_slice_is_refused_naming_the_gap(tmp_path):
    """Slice 2 of 6 gone: SimpleITK would read 5 slices at one spacing (warning only), every slice after the gap
    2.5 mm off; the series is refused naming the two slices around the gap, its width and the usual spacing."""
    voxels = np.random.default_rng(0).integers(-1000, 2000, (6, 7, 6)).astype(np.int16)
    write_dicom_series(tmp_path, voxels, "1.2.3.1", spacing_xyz=(0.8, 0.9, 2.5))
    (tmp_path / "1.2.3.1-002.dcm").unlink()
    with pytest.raises(InputError) as info:
        read_dicom_series(tmp_path, "1.2.3.1")
    message = str(info.value)
    assert "1.2.3.1-001.dcm and 1.2.3.1-003.dcm lie 5 mm apart" in message and "other slices 2.5 mm" in message
    assert "1 slice(s) missing" in message and "DICOM series 1.2.3.1" in message


def test_a_dicom_series_with_a_slice_off_by_more_than_1_percent_is_refused(tmp_path):
    """One slice written 0.1 mm (4% of the 2.5 mm spacing) away from its place: refused; 0.01 mm (0.4%) passes."""
    voxels = np.random.default_rng(0).integers(-1000, 2000, (5, 7, 6)).astype(np.int16)
    for shift, refused in ((0.1, True), (0.01, False)):
        folder = tmp_path / str(shift)
        write_dicom_series(folder, voxels, "1.2.3.1", spacing_xyz=(0.8, 0.9, 2.5))
        moved = folder / "1.2.3.1-002.dcm"
        image = sitk.ReadImage(str(moved))
        x, y, z = (float(v) for v in image.GetMetaData("0020|0032").split("\\"))
        image.SetMetaData("0020|0032", f"{x}\\{y}\\{z + shift}")
        writer = sitk.ImageFileWriter()
        writer.KeepOriginalImageUIDOn()
        writer.SetFileName(str(moved))
        writer.Execute(image)
        if refused:
            with pytest.raises(InputError, match="not evenly spaced"):
                read_dicom_series(folder, "1.2.3.1")
        else:
            assert read_dicom_series(folder, "1.2.3.1")[0].shape == (5, 7, 6)


def test_a_dicom_series_shape_and_spacing_come_from_its_headers(tmp_path):
    """What the memory plan reads of a series (``read_dicom_series_geometry``: two slice headers) is the shape and
    spacing the series reads with, its files written against the slice normal too."""
    write_dicom_series(
        tmp_path / "s",
        np.zeros((7, 12, 10)),
        "1.2.3.77",
        spacing_xyz=(0.7, 1.1, 3.0),
        direction=(1, 0, 0, 0, 1, 0, 0, 0, -1),
    )
    read = read_dicom_series(tmp_path / "s", "1.2.3.77")[1]
    headers = read_dicom_series_geometry(tmp_path / "s", "1.2.3.77")
    assert headers.shape_zyx == read.shape_zyx == (7, 12, 10)
    np.testing.assert_allclose(headers.spacing_zyx, read.spacing_zyx, atol=1e-6)
