from __future__ import annotations

import json
import re

import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series

from autoseg.dataset.imageio import read_image, write_image
from autoseg.dataset.inputs import list_prediction_inputs
from autoseg.dataset.raw import DatasetError, check_integrity, load_case, load_dataset


def test_load_dataset_reads_nnunet_layout(tiny_dataset):
    ds = load_dataset(tiny_dataset)
    assert ds.channel_names == ("MRI",)
    assert ds.labels == {"background": 0, "organ": 1, "lesion": 2}
    assert ds.num_label_values == 3
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
    with pytest.raises(DatasetError, match=r"dataset.json: numTraining is 7 but there are 5 labels in labelsTr"):
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


def test_planning_checks_voxels_while_fingerprinting_and_writes_nothing(dataset_copy, tmp_path):
    """plan_dataset reads each case once: the fingerprint reports every case's voxel problems together."""
    from autoseg.core.units import GiB
    from autoseg.core.workspace import Workspace
    from autoseg.plan.budget import Budget
    from autoseg.plan.run import plan_dataset

    for case, value in (("demo_001", 7), ("demo_003", 5)):
        path = dataset_copy / "labelsTr" / f"{case}.nii.gz"
        seg, geo = read_image(path, dtype=np.uint8)
        seg[0, 0, 0] = value
        write_image(path, seg, geo)
    path = dataset_copy / "labelsTr" / "demo_002.nii.gz"
    seg, geo = read_image(path)
    seg[0, 0, 0] = 0.5
    write_image(path, seg, geo)  # float32 label map
    workspace = Workspace.at(tmp_path / "ws")
    with pytest.raises(DatasetError, match=r"3 problem\(s\) found; nothing was written") as err:
        plan_dataset(dataset_copy, workspace, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    assert "demo_001.nii.gz holds label value(s) [7]" in str(err.value)
    assert "demo_002.nii.gz holds non-integer values" in str(err.value)
    assert not workspace.fingerprint_path.exists() and not workspace.plans_path.exists()


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
    found = list_prediction_inputs(tiny_dataset / "imagesTs", num_channels=1)
    assert [c.case_id for c in found.cases] == ["demo_005", "demo_006"] and found.problems == {}
    single = list_prediction_inputs(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz", num_channels=1)
    assert single.cases[0].case_id == "demo_005"
    with pytest.raises(DatasetError, match="expects 2 channels"):
        list_prediction_inputs(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz", num_channels=2)


def _set_labels(root, labels, regions_class_order=None):
    meta = json.loads((root / "dataset.json").read_text())
    meta["labels"] = labels
    meta.pop("regions_class_order", None)
    if regions_class_order is not None:
        meta["regions_class_order"] = regions_class_order
    (root / "dataset.json").write_text(json.dumps(meta))


def test_region_labels_with_ignore_are_read(dataset_copy):
    _set_labels(dataset_copy, {"background": 0, "organ": [1, 2], "lesion": 2, "ignore": 3}, [1, 2])
    path = dataset_copy / "labelsTr" / "demo_003.nii.gz"
    seg, geo = read_image(path, dtype=np.uint8)
    seg[:2] = 3  # two unlabelled slices
    write_image(path, seg, geo)
    ds = load_dataset(dataset_copy)
    assert ds.labels == {"background": 0, "organ": (1, 2), "lesion": 2, "ignore": 3}
    assert ds.regions_class_order == (1, 2) and ds.label_values == (0, 1, 2, 3) and ds.num_label_values == 4
    assert ds.label_scheme.num_outputs == 2 and ds.label_scheme.ignore_value == 3
    check_integrity(ds)  # the ignore value is a declared value
    seg[0, 0, 0] = 4
    write_image(path, seg, geo)
    with pytest.raises(DatasetError, match=r"demo_003.nii.gz holds label value\(s\) \[4\] not declared"):
        check_integrity(load_dataset(dataset_copy))


def test_plain_labels_with_ignore_are_read(dataset_copy):
    _set_labels(dataset_copy, {"background": 0, "organ": 1, "lesion": 2, "ignore": 3})
    ds = load_dataset(dataset_copy)
    assert ds.label_scheme.num_outputs == 3 and ds.num_label_values == 4 and not ds.label_scheme.has_regions


@pytest.mark.parametrize(
    "labels, order, message",
    [
        ({"background": 0, "organ": [1, 2], "lesion": 2}, None, r'need a top-level "regions_class_order"'),
        ({"background": 0, "organ": 1, "ignore": 1}, None, r"'ignore' is 1 but must be the highest label value"),
        (
            {"background": 0, "organ": [1, 2], "lesion": 2},
            [1, 3],
            r"regions_class_order\[1\] is 3, which is not a value",
        ),
        ({"background": 0, "organ": 1, "lesion": 3}, None, r"consecutive integers from 0"),
    ],
)
def test_bad_labels_name_dataset_json(dataset_copy, labels, order, message):
    _set_labels(dataset_copy, labels, order)
    with pytest.raises(DatasetError, match=message) as info:
        load_dataset(dataset_copy)
    assert str(info.value).startswith(str(dataset_copy / "dataset.json"))


def _meta(root):
    return json.loads((root / "dataset.json").read_text())


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda m: None, "JSON object"),
        (lambda m: [m], "JSON object"),
        (lambda m: {**m, "numTraining": "5"}, "numTraining must be an integer"),
        (lambda m: {**m, "numTraining": 5.5}, "numTraining must be an integer"),
        (lambda m: {**m, "numTraining": True}, "numTraining must be an integer"),
        (lambda m: {**m, "channel_names": {}}, "channel_names"),
        (lambda m: {**m, "channel_names": None}, "channel_names"),
        (lambda m: {**m, "channel_names": ["MRI"]}, "channel_names"),
        (lambda m: {**m, "channel_names": {"0": 5}}, "channel_names"),
        (lambda m: {**m, "channel_names": {"0": " "}}, "channel_names"),
        (lambda m: {**m, "channel_names": {"1": "MRI"}}, "channel_names"),
        (lambda m: {**m, "labels": ["background", "organ"]}, "labels"),
        (lambda m: {**m, "labels": {"background": 0, "organ": "1", "lesion": 2}}, "label 'organ'"),
        (lambda m: {**m, "labels": {"background": 0, "organ": 1.0, "lesion": 2}}, "label 'organ'"),
        (lambda m: {**m, "file_ending": "nii.gz"}, "file_ending 'nii.gz'.*did you mean '.nii.gz'"),
        (lambda m: {**m, "file_ending": None}, "file_ending"),
        (lambda m: {k: v for k, v in m.items() if k != "labels"}, "missing key 'labels'"),
    ],
    ids=[
        "null",
        "list",
        "numTraining-str",
        "numTraining-float",
        "numTraining-bool",
        "channels-empty",
        "channels-null",
        "channels-list",
        "channels-number",
        "channels-blank",
        "channels-from-1",
        "labels-list",
        "label-str",
        "label-float",
        "ending-no-dot",
        "ending-null",
        "labels-missing",
    ],
)
def test_malformed_dataset_json_names_file_and_key(dataset_copy, change, key):
    (dataset_copy / "dataset.json").write_text(json.dumps(change(_meta(dataset_copy))))
    with pytest.raises(DatasetError, match=key) as info:
        load_dataset(dataset_copy)
    assert str(info.value).startswith(str(dataset_copy / "dataset.json"))


def test_dataset_json_not_utf8_is_named(dataset_copy):
    (dataset_copy / "dataset.json").write_bytes(b'\xff\xfe{\x00"')
    with pytest.raises(DatasetError, match=r"dataset.json: not UTF-8"):
        load_dataset(dataset_copy)


@pytest.mark.parametrize("num_training", [None, 4])
def test_image_without_label_is_refused_listing_it(dataset_copy, num_training):
    """Whether or not numTraining is given (a count that matches does not prove every image has its label), an
    image with no label in labelsTr is named instead of being left out of training silently."""
    meta = _meta(dataset_copy)
    meta.pop("numTraining")
    if num_training is not None:
        meta["numTraining"] = num_training
    (dataset_copy / "dataset.json").write_text(json.dumps(meta))
    (dataset_copy / "labelsTr" / "demo_002.nii.gz").unlink()
    with pytest.raises(
        DatasetError,
        match=r"imagesTr: 1 image\(s\) belong to no training case.*\n  "
        r"demo_002_0000.nii.gz \(no label demo_002.nii.gz in labelsTr\)",
    ):
        load_dataset(dataset_copy)


def test_channel_file_beyond_channel_names_is_refused(dataset_copy):
    images = dataset_copy / "imagesTr"
    (images / "demo_001_0001.nii.gz").write_bytes((images / "demo_001_0000.nii.gz").read_bytes())
    with pytest.raises(DatasetError, match=r"demo_001_0001.nii.gz \(channel 0001, but dataset.json declares 1"):
        load_dataset(dataset_copy)


def _make_2d(path):
    image = sitk.ReadImage(str(path))
    sitk.WriteImage(image[:, :, 5], str(path))


def test_2d_case_in_a_3d_dataset_is_named(dataset_copy):
    _make_2d(dataset_copy / "imagesTr" / "demo_003_0000.nii.gz")
    _make_2d(dataset_copy / "labelsTr" / "demo_003.nii.gz")
    with pytest.raises(
        DatasetError,
        match=r"1 problem.*\n  case demo_003: demo_003.nii.gz and its images are 2D but 4 "
        r"other case\(s\) are 3D",
    ):
        check_integrity(load_dataset(dataset_copy), read_voxels=False)


def test_truncated_file_is_a_listed_problem(dataset_copy):
    """The header-only check (read_voxels=False, what plan_and_preprocess runs first) finds it."""
    path = dataset_copy / "imagesTr" / "demo_002_0000.nii.gz"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DatasetError, match=r"case demo_002: .*demo_002_0000.nii.gz: damaged or truncated"):
        check_integrity(load_dataset(dataset_copy), read_voxels=False)


def test_prediction_input_problems_are_listed_per_case(dataset_copy):
    """Each case's problem is listed under its id (the other cases can be predicted); raise_problems
    lists them all (--fail-fast: before anything is predicted)."""
    folder = dataset_copy / "imagesTs"
    assert list_prediction_inputs(folder, num_channels=1, image_dim=3).problems == {}
    extra = folder / "demo_005_0001.nii.gz"
    extra.write_bytes((folder / "demo_005_0000.nii.gz").read_bytes())
    found = list_prediction_inputs(folder, num_channels=1)
    assert list(found.problems) == ["demo_005"] and len(found.cases) == 2
    assert re.search(r"demo_005_0001.nii.gz: the model takes 1 channel\(s\)", found.problems["demo_005"])
    extra.unlink()
    found = list_prediction_inputs(folder, num_channels=1, image_dim=2)
    assert "demo_005_0000.nii.gz is a 3D image but the model was trained on 2D" in found.problems["demo_005"]
    path = folder / "demo_006_0000.nii.gz"
    path.write_bytes(path.read_bytes()[:-1])
    found = list_prediction_inputs(path, num_channels=1)
    with pytest.raises(DatasetError, match=r"nothing was predicted:\n  .*demo_006_0000.nii.gz: damaged or truncated"):
        found.raise_problems()
    (folder / "demo_005_0000.nii.gz").unlink()
    (folder / "demo_005_0001.nii.gz").write_bytes(path.read_bytes())
    assert (
        "lacks channel file(s) ['demo_005_0000.nii.gz']"
        in list_prediction_inputs(folder, num_channels=2).problems["demo_005"]
    )


def test_prediction_channels_on_different_grids_are_refused(dataset_copy):
    folder = dataset_copy / "imagesTs"
    image = sitk.ReadImage(str(folder / "demo_005_0000.nii.gz"))
    image.SetSpacing((2.0, 2.0, 2.0))
    sitk.WriteImage(image, str(folder / "demo_005_0001.nii.gz"))
    (folder / "demo_006_0000.nii.gz").unlink()
    problems = list_prediction_inputs(folder, num_channels=2).problems
    assert "demo_005_0001.nii.gz and demo_005_0000.nii.gz differ in spacing" in problems["demo_005"]


def test_dicom_folder_is_one_case_named_after_it_or_its_series(tmp_path):
    voxels = np.arange(4 * 6 * 5, dtype=np.int16).reshape(4, 6, 5)
    folder = tmp_path / "ct_2024"
    write_dicom_series(folder, voxels, "1.2.3.1")
    (case,) = list_prediction_inputs(folder, num_channels=1).cases
    assert case.case_id == "ct_2024" and case.series_uid == "1.2.3.1"
    np.testing.assert_array_equal(load_case(case)[0], voxels[None])
    assert (
        "is a 3D image (4 slices) but the model was trained on 2D"
        in list_prediction_inputs(folder, num_channels=1, image_dim=2).problems["ct_2024"]
    )
    with pytest.raises(DatasetError, match="a DICOM series is one channel but the model takes 2"):
        list_prediction_inputs(folder, num_channels=2)
    write_dicom_series(folder, voxels[::-1], "1.2.3.2")
    with pytest.raises(
        DatasetError,
        match=r"holds 2 DICOM series; choose one with --series UID:\n  1.2.3.1 \(4 files\)"
        r"\n  1.2.3.2 \(4 files\)",
    ):
        list_prediction_inputs(folder, num_channels=1)
    (case,) = list_prediction_inputs(folder, num_channels=1, series="1.2.3.2").cases
    assert case.case_id == "1.2.3.2"
    np.testing.assert_array_equal(load_case(case)[0], voxels[None, ::-1])
    with pytest.raises(DatasetError, match="--series 9.9: no such series"):
        list_prediction_inputs(folder, num_channels=1, series="9.9")
    with pytest.raises(DatasetError, match="no images named .* and no DICOM series"):
        list_prediction_inputs(tmp_path, num_channels=1)  # the series are one folder below


def test_a_truncated_dicom_slice_is_a_problem_of_its_case_found_before_reading(tmp_path):
    voxels = np.arange(4 * 6 * 5, dtype=np.int16).reshape(4, 6, 5)
    write_dicom_series(tmp_path / "ct", voxels, "1.2.3.1")
    cut = tmp_path / "ct" / "1.2.3.1-001.dcm"
    cut.write_bytes(cut.read_bytes()[:-1])
    assert f"{cut}: truncated: element (7FE0,0010)" in list_prediction_inputs(tmp_path / "ct", 1).problems["ct"]
    write_dicom_series(tmp_path / "one", voxels[:1], "1.2.3.2")  # its only slice cut: GDCM lists no series
    cut = tmp_path / "one" / "1.2.3.2-000.dcm"
    cut.write_bytes(cut.read_bytes()[:-1])
    with pytest.raises(DatasetError, match=rf"no DICOM series found; truncated: {cut}: truncated: element"):
        list_prediction_inputs(tmp_path / "one", num_channels=1)


def test_load_case_refuses_nan_naming_the_file(dataset_copy):
    """NaN kept by the format (NRRD) is refused where a case to predict is read (no all-background output)."""
    _convert_to_nrrd(dataset_copy)
    path = dataset_copy / "imagesTs" / "demo_005_0000.nrrd"
    image, geo = read_image(path)
    image[0, 1, 1] = np.inf
    write_image(path, image, geo)
    case = list_prediction_inputs(path, num_channels=1).cases[0]
    with pytest.raises(DatasetError, match=r"demo_005_0000.nrrd holds NaN or Inf"):
        load_case(case)
