"""Bad input files and datasets through the real CLI: each is refused with exit status 2, a message that
names the file (or the dataset.json key), no traceback, and nothing written or changed.

One test per category (parametrized over its cases): truncated files, dimension and channel count, NaN/Inf,
dataset.json, an all-background dataset, evaluation inputs. The broken files are made here from the tiny
dataset; predict runs against a fold trained once per session (conftest.trained: 1 iteration).
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli, snapshot
from image_headers import as_mha, set_mha_header

CASE_IMAGE = "imagesTr/demo_000_0000.nii.gz"
# A stated budget: plan_and_preprocess does not measure this machine (seconds) before checking the dataset.
BUDGET = ("--processes", "1", "--device", "cpu", "--gpu-memory", "8GiB", "--ram", "8GiB", "--cpu-flops", "50e9")
CASE_LABEL = "labelsTr/demo_000.nii.gz"


def _truncate(path: Path, keep_fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])


def _edit_voxels(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rewrite an image with ``change`` applied to its (z, y, x) array; the geometry is kept where the
    dimension is (a slice of a 3D image becomes a 2D image with default geometry)."""
    image = sitk.ReadImage(str(path))
    out = sitk.GetImageFromArray(change(sitk.GetArrayFromImage(image)))
    if out.GetDimension() == image.GetDimension():
        out.CopyInformation(image)
    sitk.WriteImage(out, str(path), useCompression=True)


def _edit_meta(root: Path, change: Callable[[dict], object]) -> None:
    meta = json.loads((root / "dataset.json").read_text())
    (root / "dataset.json").write_text(json.dumps(change(meta)))


def _to_uncompressed_nii(root: Path) -> None:
    for f in list(root.rglob("*.nii.gz")):
        f.with_name(f.name[:-3]).write_bytes(gzip.decompress(f.read_bytes()))
        f.unlink()
    _edit_meta(root, lambda m: {**m, "file_ending": ".nii"})


def _trunc_nii(root: Path) -> str:
    _to_uncompressed_nii(root)
    path = root / CASE_IMAGE[:-3]
    path.write_bytes(path.read_bytes()[:-1])  # one byte short
    return str(path)


def _no_label(root: Path) -> str:
    _edit_meta(root, lambda m: {k: v for k, v in m.items() if k != "numTraining"})
    (root / CASE_LABEL).unlink()
    return "demo_000_0000.nii.gz"


def _extra_training_channel(root: Path) -> str:
    shutil.copy(root / CASE_IMAGE, root / "imagesTr/demo_001_0001.nii.gz")
    return "demo_001_0001.nii.gz"


def _case_2d(root: Path) -> str:
    for rel in (CASE_IMAGE, CASE_LABEL):
        _edit_voxels(root / rel, lambda a: a[5])
    return "case demo_000"


def _all_background(root: Path) -> str:
    for f in (root / "labelsTr").glob("*.nii.gz"):
        _edit_voxels(f, lambda a: a * 0)
    return str(root / "labelsTr")


def _mha_header(root: Path, key: str, value: str) -> str:
    """Every image of the dataset as .mha (``as_mha``), then ``key = value`` in the header of case demo_003's image
    and label; returns the image."""
    for f in list(root.rglob("*.nii.gz")):
        as_mha(f)
    _edit_meta(root, lambda m: {**m, "file_ending": ".mha"})
    for rel in ("imagesTr/demo_003_0000.mha", "labelsTr/demo_003.mha"):
        set_mha_header(root / rel, key, value)
    return str(root / "imagesTr/demo_003_0000.mha")


def _spacing(root: Path, spacing_xyz: tuple[float, float, float]) -> str:
    for rel in ("imagesTr/demo_003_0000.nii.gz", CASE_LABEL.replace("000", "003")):
        image = sitk.ReadImage(str(root / rel))
        image.SetSpacing(spacing_xyz)
        sitk.WriteImage(image, str(root / rel), useCompression=True)
    return str(root / "labelsTr/demo_003.nii.gz")


def _dataset_entry_outside(root: Path) -> str:
    outside = root.parent / "elsewhere_0000.nii.gz"
    shutil.copy(root / CASE_IMAGE, outside)
    entry = {"demo_000": {"images": [str(outside)], "label": CASE_LABEL}}
    _edit_meta(root, lambda m: {**m, "numTraining": 1, "dataset": entry})
    return "'dataset' entry 'demo_000'"


# Each breaks a copy of the dataset and returns the name the refusal must mention.
DATASET_CASES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "trunc-image-nii.gz": ("truncated", lambda d: (_truncate(d / CASE_IMAGE), str(d / CASE_IMAGE))[1]),
    "trunc-label-nii.gz": ("truncated", lambda d: (_truncate(d / CASE_LABEL, 0.9), str(d / CASE_LABEL))[1]),
    "trunc-image-nii": ("truncated", _trunc_nii),
    "2d-case-in-3d": ("dimension", _case_2d),
    "extra-channel-in-imagesTr": ("channels", _extra_training_channel),
    "json-null": ("dataset.json", lambda d: (_edit_meta(d, lambda m: None), "dataset.json")[1]),
    "json-not-utf8": (
        "dataset.json",
        lambda d: ((d / "dataset.json").write_bytes(b"\xff\xfe{\x00"), "dataset.json")[1],
    ),
    "numTraining-str": (
        "dataset.json",
        lambda d: (_edit_meta(d, lambda m: {**m, "numTraining": "5"}), "numTraining")[1],
    ),
    "channel_names-empty": (
        "dataset.json",
        lambda d: (_edit_meta(d, lambda m: {**m, "channel_names": {}}), "channel_names")[1],
    ),
    "label-value-str": (
        "dataset.json",
        lambda d: (
            _edit_meta(d, lambda m: {**m, "labels": {"background": 0, "organ": "1", "lesion": 2}}),
            "label 'organ'",
        )[1],
    ),
    "file_ending-no-dot": (
        "dataset.json",
        lambda d: (_edit_meta(d, lambda m: {**m, "file_ending": "nii.gz"}), "file_ending")[1],
    ),
    "image-without-label": ("dataset.json", _no_label),
    "all-background": ("labels", _all_background),
    "negative-spacing": ("geometry", lambda d: _mha_header(d, "ElementSpacing", "-0.8 0.8 2.8")),
    "zero-spacing": ("geometry", lambda d: _mha_header(d, "ElementSpacing", "0 0.8 2.8")),
    "zero-size-axis": ("geometry", lambda d: _mha_header(d, "DimSize", "0 27 11")),
    "spacing-in-metres": ("geometry", lambda d: _spacing(d, (0.0009, 0.0009, 0.0028))),
    "spacing-absurdly-large": ("geometry", lambda d: _spacing(d, (1e6, 1.0, 1.0))),
    "dataset-entry-outside": ("dataset.json", _dataset_entry_outside),
}


@pytest.mark.parametrize("name", list(DATASET_CASES))
def test_a_bad_dataset_is_refused_by_plan_and_preprocess_before_anything_is_written(
    name: str, dataset_copy: Path, tmp_path: Path, capsys
) -> None:
    named = DATASET_CASES[name][1](dataset_copy)
    workspace = tmp_path / "ws"
    dataset_before = snapshot(dataset_copy)
    result = run_cli(capsys, "plan_and_preprocess", dataset_copy, "-w", workspace, *BUDGET)
    assert_refused(result, 2, named)
    assert snapshot(workspace) == {} and snapshot(dataset_copy) == dataset_before


def _nan_input(folder: Path) -> str:
    path = folder / "demo_900_0000.nii.gz"
    _edit_voxels(path, lambda a: np.where(a > 0, np.nan, a).astype(np.float32))
    return str(path)


def _inf_input_nrrd(folder: Path) -> str:
    path = folder / "demo_900_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    array = sitk.GetArrayFromImage(image).astype(np.float32)
    array[0, 0, 0] = np.inf
    out = sitk.GetImageFromArray(array)
    out.CopyInformation(image)
    nrrd = folder / "demo_900_0000.nrrd"
    sitk.WriteImage(out, str(nrrd))
    path.unlink()
    return str(nrrd)


def _extra_input_channel(folder: Path) -> str:
    shutil.copy(folder / "demo_900_0000.nii.gz", folder / "demo_900_0001.nii.gz")
    return str(folder / "demo_900_0001.nii.gz")


def _input_2d(folder: Path) -> str:
    _edit_voxels(folder / "demo_900_0000.nii.gz", lambda a: a[5])
    return str(folder / "demo_900_0000.nii.gz")


def _trunc_input(folder: Path) -> str:
    path = folder / "demo_900_0000.nii.gz"
    _truncate(path)
    return str(path)


def _two_formats(folder: Path) -> str:
    path = folder / "demo_900_0000.nii.gz"
    sitk.WriteImage(sitk.ReadImage(str(path)), str(folder / "demo_900_0000.nrrd"))
    return f"{path} and {folder / 'demo_900_0000.nrrd'}"


def _negative_spacing_input(folder: Path) -> str:
    mha = as_mha(folder / "demo_900_0000.nii.gz")
    set_mha_header(mha, "ElementSpacing", "0.8 -0.8 2.8")
    return str(mha)


def _input_in_metres(folder: Path) -> str:
    path = folder / "demo_900_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    image.SetSpacing(tuple(s / 1000 for s in image.GetSpacing()))
    sitk.WriteImage(image, str(path))
    return str(path)


PREDICT_CASES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "trunc-input": ("truncated", _trunc_input),
    "2d-input-for-3d-model": ("dimension", _input_2d),
    "extra-channel": ("channels", _extra_input_channel),
    "nan-nifti": ("nan", _nan_input),
    "inf-nrrd": ("nan", _inf_input_nrrd),
    "one-case-two-formats": ("formats", _two_formats),
    "negative-spacing": ("geometry", _negative_spacing_input),
    "spacing-in-metres": ("geometry", _input_in_metres),
}


@pytest.mark.slow  # the trained fixture: ~5 s of training, once per session
@pytest.mark.parametrize("name", list(PREDICT_CASES))
def test_a_bad_input_is_refused_by_predict_before_anything_is_written(
    name: str, trained: Path, tiny_dataset: Path, tmp_path: Path, capsys
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(tiny_dataset / "imagesTs/demo_005_0000.nii.gz", inputs / "demo_900_0000.nii.gz")
    named = PREDICT_CASES[name][1](inputs)
    workspace_before = snapshot(trained)
    result = run_cli(capsys, "predict", "-i", inputs, "-o", tmp_path / "out", "-w", trained, "--no-mirror")
    assert_refused(result, 2, named)
    assert snapshot(tmp_path / "out") == {} and snapshot(trained) == workspace_before


def _float_prediction(pred: Path, gt: Path) -> str:
    path = pred / "demo_001.nii.gz"
    _edit_voxels(path, lambda a: a.astype(np.float32) + 0.3)
    return str(path)


def _missing_reference(pred: Path, gt: Path) -> str:
    (gt / "demo_001.nii.gz").unlink()
    return "demo_001.nii.gz"


def _missing_prediction(pred: Path, gt: Path) -> str:
    (pred / "demo_001.nii.gz").unlink()
    return "demo_001.nii.gz"


def _other_geometry(pred: Path, gt: Path) -> str:
    path = pred / "demo_001.nii.gz"
    image = sitk.ReadImage(str(path))
    image.SetSpacing(tuple(2 * s for s in image.GetSpacing()))
    sitk.WriteImage(image, str(path))
    return str(gt / "demo_001.nii.gz")  # and the prediction: checked below


def _trunc_prediction(pred: Path, gt: Path) -> str:
    path = pred / "demo_001.nii.gz"
    path.write_bytes(path.read_bytes()[:-1])
    return str(path)


EVALUATE_CASES: dict[str, Callable[[Path, Path], str]] = {
    "float-prediction": _float_prediction,
    "prediction-without-reference": _missing_reference,
    "reference-without-prediction": _missing_prediction,
    "other-geometry": _other_geometry,
    "trunc-prediction": _trunc_prediction,
}


@pytest.mark.parametrize("name", list(EVALUATE_CASES))
def test_bad_segmentations_are_refused_by_evaluate_without_a_summary(
    name: str, tiny_dataset: Path, tmp_path: Path, capsys
) -> None:
    pred, gt = tmp_path / "pred", tmp_path / "gt"
    pred.mkdir()
    gt.mkdir()
    for f in sorted((tiny_dataset / "labelsTr").glob("*.nii.gz"))[:2]:
        shutil.copy(f, pred / f.name)
        shutil.copy(f, gt / f.name)
    named = EVALUATE_CASES[name](pred, gt)
    before = snapshot(tmp_path)
    result = run_cli(capsys, "evaluate", pred, gt)
    assert_refused(result, 2, named, *([pred / "demo_001.nii.gz"] if name == "other-geometry" else []))
    assert snapshot(tmp_path) == before  # no summary.json


@pytest.mark.slow  # the trained fixture
def test_a_train_refused_while_setting_up_leaves_no_fold_folder_and_no_log(
    trained: Path, tmp_path: Path, capsys
) -> None:
    """--use-precomputed without precomputed copies is refused once the run is being set up (the data pipeline):
    train.log used to be open by then, and stayed behind in a new fold folder."""
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    before = snapshot(ws)
    result = run_cli(capsys, "train", "fold", "1", "-w", ws, "--use-precomputed", "--loader-workers", "0")
    assert_refused(result, 2, ws / "preprocessed" / "3d_fullres", "--use-precomputed")
    assert snapshot(ws) == before and not (ws / "results" / "3d_fullres" / "fold_1").exists()
