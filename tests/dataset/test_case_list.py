"""dataset.json's "dataset" entry (the training cases listed) and numTraining: ids are plain names, files lie in the
dataset's own imagesTr/ and labelsTr/, and what is debatable is said."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from autoseg.core.errors import InputError
from autoseg.dataset.case_list import case_id_problem
from autoseg.dataset.raw import load_dataset


def _write_meta(root: Path, change) -> None:
    meta = json.loads((root / "dataset.json").read_text())
    (root / "dataset.json").write_text(json.dumps(change(meta)))


def _entry(ids: list[str]) -> dict:
    return {c: {"images": [f"imagesTr/{c}_0000.nii.gz"], "label": f"labelsTr/{c}.nii.gz"} for c in ids}


def test_the_dataset_entry_chooses_the_cases_and_names_the_files_it_leaves_out(dataset_copy, caplog):
    _write_meta(dataset_copy, lambda m: {**m, "numTraining": 2, "dataset": _entry(["demo_003", "demo_001"])})
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        ds = load_dataset(dataset_copy)
    assert [c.case_id for c in ds.cases] == ["demo_003", "demo_001"]
    assert ds.cases[0].image_paths == (dataset_copy / "imagesTr" / "demo_003_0000.nii.gz",)
    assert ds.cases[0].label_path == dataset_copy / "labelsTr" / "demo_003.nii.gz"
    assert "does not name 6 file(s)" in caplog.text and "imagesTr/demo_000_0000.nii.gz" in caplog.text


def test_a_dataset_entry_naming_every_file_warns_nothing(dataset_copy, caplog):
    ids = [f"demo_{i:03d}" for i in range(5)]
    _write_meta(dataset_copy, lambda m: {**m, "dataset": _entry(ids)})
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        assert [c.case_id for c in load_dataset(dataset_copy).cases] == ids
    assert caplog.text == ""


def _outside(root: Path) -> dict:
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(root / "imagesTr" / "demo_000_0000.nii.gz", elsewhere / "demo_000_0000.nii.gz")
    return {"demo_000": {"images": [str(elsewhere / "demo_000_0000.nii.gz")], "label": "labelsTr/demo_000.nii.gz"}}


ENTRIES = {  # a dataset entry -> the id the refusal names, and what it says
    "id-climbs-out": (lambda r: {"../evil": _entry(["demo_000"])["demo_000"]}, "'../evil'", "path separator"),
    "id-is-a-path": (lambda r: {"sub/demo_000": _entry(["demo_000"])["demo_000"]}, "'sub/demo_000'", "separator"),
    "id-is-dot-dot": (lambda r: {"..": _entry(["demo_000"])["demo_000"]}, "'..'", "starts with '.'"),
    "id-empty": (lambda r: {"": _entry(["demo_000"])["demo_000"]}, "''", "not a non-empty name"),
    "image-outside-absolute": (_outside, "'demo_000'", "elsewhere/demo_000_0000.nii.gz"),
    "image-climbs-out": (
        lambda r: {"demo_000": {"images": ["imagesTr/../../x_0000.nii.gz"], "label": "labelsTr/demo_000.nii.gz"}},
        "'demo_000'",
        "imagesTr/../../x_0000.nii.gz",
    ),
    "label-in-imagesTr": (
        lambda r: {"demo_000": {"images": ["imagesTr/demo_000_0000.nii.gz"], "label": "imagesTr/demo_001_0000.nii.gz"}},
        "'demo_000'",
        "labelsTr",
    ),
    "image-in-a-subfolder": (
        lambda r: {"demo_000": {"images": ["imagesTr/a/demo_000_0000.nii.gz"], "label": "labelsTr/demo_000.nii.gz"}},
        "'demo_000'",
        "imagesTr/a/demo_000_0000.nii.gz",
    ),
    "two-images-for-one-channel": (
        lambda r: {"demo_000": {"images": ["imagesTr/demo_000_0000.nii.gz"] * 2, "label": "labelsTr/demo_000.nii.gz"}},
        "'demo_000'",
        "1 file(s), one per channel_names",
    ),
    "not-an-object": (lambda r: ["demo_000"], "'dataset'", "must map each training case id"),
}


@pytest.mark.parametrize("name", list(ENTRIES))
def test_a_dataset_entry_outside_the_dataset_is_refused_naming_dataset_json_and_the_id(dataset_copy, name):
    make, named, says = ENTRIES[name]
    entry = make(dataset_copy)
    _write_meta(dataset_copy, lambda m: {**m, "dataset": entry})
    with pytest.raises(InputError) as refused:
        load_dataset(dataset_copy)
    message = str(refused.value)
    assert str(dataset_copy / "dataset.json") in message and named in message and says in message, message


@pytest.mark.parametrize("case_id", ["case_001", "BraTS-GLI-00000-000", "a.b"])
def test_plain_case_ids_pass(case_id):
    assert case_id_problem(case_id) is None


def test_a_dataset_json_without_num_training_warns_with_the_count(dataset_copy, caplog):
    _write_meta(dataset_copy, lambda m: {k: v for k, v in m.items() if k != "numTraining"})
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        load_dataset(dataset_copy)
    assert "has no numTraining: training on the 5 labels in labelsTr" in caplog.text


def test_num_training_is_checked_against_the_dataset_entry(dataset_copy):
    _write_meta(dataset_copy, lambda m: {**m, "numTraining": 5, "dataset": _entry(["demo_000", "demo_001"])})
    with pytest.raises(InputError, match="numTraining is 5 but there are 2 cases its 'dataset' entry names"):
        load_dataset(dataset_copy)
