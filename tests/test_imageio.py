from __future__ import annotations

import numpy as np
import pytest
import SimpleITK as sitk

from autoseg.dataset.imageio import read_geometry, read_image, write_image


@pytest.mark.parametrize("ending", [".nii.gz", ".nrrd", ".mha"])
def test_roundtrip_keeps_geometry_exactly(tmp_path, ending):
    arr = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    image = sitk.GetImageFromArray(arr)
    image.SetSpacing((0.7, 0.8, 3.0))
    image.SetOrigin((-10.0, 5.5, 2.25))
    image.SetDirection((0.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0))
    src = tmp_path / f"a{ending}"
    sitk.WriteImage(image, str(src))
    data, geo = read_image(src)
    assert data.shape == (3, 4, 5) and geo.spacing_zyx == pytest.approx((3.0, 0.8, 0.7))
    out = tmp_path / f"b{ending}"
    write_image(out, data, geo)
    back, original = sitk.ReadImage(str(out)), sitk.ReadImage(str(src))  # as stored (NIfTI keeps float32)
    assert back.GetSpacing() == original.GetSpacing()
    assert back.GetOrigin() == original.GetOrigin()
    assert back.GetDirection() == original.GetDirection()
    assert read_geometry(out) == geo
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_2d_image_is_lifted_to_one_slice(tmp_path):
    image = sitk.GetImageFromArray(np.ones((6, 7), dtype=np.uint8))
    image.SetSpacing((0.5, 0.25))
    sitk.WriteImage(image, str(tmp_path / "x.nii.gz"))
    data, geo = read_image(tmp_path / "x.nii.gz")
    assert data.shape == (1, 6, 7) and geo.ndim == 2
    assert geo.spacing_zyx == (999.0, 0.25, 0.5)
    write_image(tmp_path / "y.nii.gz", data, geo)
    assert sitk.ReadImage(str(tmp_path / "y.nii.gz")).GetDimension() == 2


def test_unreadable_file_names_it(tmp_path):
    bad = tmp_path / "broken.nii.gz"
    bad.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="broken.nii.gz: SimpleITK cannot read"):
        read_image(bad)
