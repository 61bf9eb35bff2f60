from __future__ import annotations

import json

import numpy as np
import pytest
import SimpleITK as sitk

from autoseg.dataset import DatasetError, check_integrity, list_prediction_inputs, load_dataset
from autoseg.imageio import read_image, write_image


def test_load_dataset_reads_nnunet_layout(tiny_dataset):
    ds = load_dataset(tiny_dataset)
    assert ds.channel_names == ("MRI",)
    assert ds.labels == {"background": 0, "organ": 1, "lesion": 2}
    assert ds.num_classes == 3
    assert [c.case_id for c in ds.cases] == [f"demo_{i:03d}" for i in range(5)]
    assert ds.cases[0].image_paths[0].name == "demo_000_0000.nii.gz"
    check_integrity(ds)  # the generated dataset is consistent


def test_missing_dataset_json(tmp_path):
    with pytest.raises(DatasetError, match="no dataset.json"):
        load_dataset(tmp_path)


def test_num_training_mismatch_names_the_file(dataset_copy):
    meta = json.loads((dataset_copy / "dataset.json").read_text())
    meta["numTraining"] = 7
    (dataset_copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"dataset.json: numTraining is 7 but labelsTr holds 5"):
        load_dataset(dataset_copy)


def test_missing_channel_is_reported_per_case(dataset_copy):
    (dataset_copy / "imagesTr" / "demo_002_0000.nii.gz").unlink()
    with pytest.raises(DatasetError, match=r"case demo_002: missing file\(s\).*demo_002_0000.nii.gz"):
        check_integrity(load_dataset(dataset_copy))


def test_geometry_mismatch_names_case_file_and_difference(dataset_copy):
    path = dataset_copy / "labelsTr" / "demo_001.nii.gz"
    image = sitk.ReadImage(str(path))
    image.SetOrigin(tuple(o + 5.0 for o in image.GetOrigin()))
    sitk.WriteImage(image, str(path))
    expected = r"case demo_001: demo_001_0000.nii.gz and label demo_001.nii.gz differ in origin"
    with pytest.raises(DatasetError, match=expected):
        check_integrity(load_dataset(dataset_copy))


def test_undeclared_label_value(dataset_copy):
    path = dataset_copy / "labelsTr" / "demo_003.nii.gz"
    seg, geo = read_image(path, dtype=np.uint8)
    seg[0, 0, 0] = 5
    write_image(path, seg, geo)
    with pytest.raises(DatasetError, match=r"demo_003.nii.gz holds label value\(s\) \[5\] not declared"):
        check_integrity(load_dataset(dataset_copy))


def _convert_to_nrrd(root):
    """Rewrite the dataset with .nrrd files (SimpleITK's NIfTI reader turns NaN into 0, NRRD keeps it)."""
    for folder in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        for f in list((root / folder).glob("*.nii.gz")):
            sitk.WriteImage(sitk.ReadImage(str(f)), str(f).replace(".nii.gz", ".nrrd"))
            f.unlink()
    meta = json.loads((root / "dataset.json").read_text())
    meta["file_ending"] = ".nrrd"
    (root / "dataset.json").write_text(json.dumps(meta))


def test_nan_in_image(dataset_copy):
    _convert_to_nrrd(dataset_copy)
    check_integrity(load_dataset(dataset_copy))  # NRRD datasets read like NIfTI ones
    path = dataset_copy / "imagesTr" / "demo_004_0000.nrrd"
    image, geo = read_image(path)
    image[0, 1, 1] = np.nan
    write_image(path, image, geo)
    with pytest.raises(DatasetError, match=r"demo_004_0000.nrrd holds NaN or Inf"):
        check_integrity(load_dataset(dataset_copy))


def test_prediction_inputs_folder_and_file(tiny_dataset):
    cases = list_prediction_inputs(tiny_dataset / "imagesTs", num_channels=1)
    assert [c.case_id for c in cases] == ["demo_005", "demo_006"]
    single = list_prediction_inputs(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz", num_channels=1)
    assert single[0].case_id == "demo_005"
    with pytest.raises(DatasetError, match="expects 2 channels"):
        list_prediction_inputs(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz", num_channels=2)
