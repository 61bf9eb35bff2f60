"""Preprocessed cases are tied to the plan fields and raw files they were made from
(``preprocessed/<config>_source.json``): what no longer matches is found, refused, or deleted to be redone."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from cli_checks import snapshot

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace, dataset_source
from autoseg.dataset.raw import load_dataset
from autoseg.plan.plans import IntensityProperties, Plans
from autoseg.preprocess.plan_fields import preprocessing_fields
from autoseg.preprocess.run import check_preprocessed, preprocess_workspace, stale_preprocessed
from autoseg.preprocess.store import (
    PreprocessedSource,
    case_files,
    delete_case,
    read_source,
    source_path,
    stored_case_ids,
)

CONFIG = "3d_fullres"


@pytest.fixture()
def ws(prepared: Path, tmp_path: Path) -> Workspace:
    return Workspace.at(shutil.copytree(prepared, tmp_path / "ws"))


def _stale(ws: Workspace, plans: Plans | None = None, unknown_is_stale: bool = False):
    dataset = load_dataset(ws.dataset_root())
    return stale_preprocessed(
        ws, plans or Plans.from_json(ws.plans_path), dataset, dataset_source(dataset.root), [CONFIG], unknown_is_stale
    )


def _edit_plan(ws: Workspace, **changes) -> Plans:
    plans = Plans.from_json(ws.plans_path)
    config = plans.configurations[CONFIG].with_(**changes)
    plans = replace(plans, configurations={**plans.configurations, CONFIG: config})
    plans.to_json(ws.plans_path)
    return plans


def test_a_freshly_preprocessed_workspace_has_nothing_stale(ws: Workspace) -> None:
    record = read_source(ws.preprocessed(CONFIG))
    assert record is not None and sorted(record.cases) == stored_case_ids(ws.preprocessed(CONFIG))
    assert _stale(ws) == []
    check_preprocessed(ws, Plans.from_json(ws.plans_path), CONFIG)  # no error


def test_only_the_plan_fields_preprocessing_reads_count() -> None:
    from factories import tiny_plans

    plans = tiny_plans()
    fields = preprocessing_fields(plans, CONFIG)
    config = plans.configurations[CONFIG]
    unread = replace(
        plans,
        host_ram_bytes=1,
        configurations={CONFIG: config.with_(batch_size=7, patch_size=(16,) * 3)},
        intensity_properties=(IntensityProperties(0.0, 1.0, -5.0, 5.0),),
    )  # z-score reads none
    assert preprocessing_fields(unread, CONFIG) == fields
    for changed in (
        replace(plans, configurations={CONFIG: config.with_(spacing_mm=(3.0, 1.0, 1.0))}),
        replace(plans, normalization=("ct",)),
        replace(plans, use_nonzero_mask=(False,)),
        replace(plans, labels={"background": 0, "organ": 1}),
    ):
        assert preprocessing_fields(changed, CONFIG) != fields
    ct = replace(plans, normalization=("ct",))
    assert preprocessing_fields(
        replace(ct, intensity_properties=unread.intensity_properties), CONFIG
    ) != preprocessing_fields(ct, CONFIG)  # CT normalization reads them


def test_another_plan_makes_every_case_stale_and_training_refuses(ws: Workspace) -> None:
    plans = _edit_plan(ws, spacing_mm=(3.0, 1.0, 1.0))
    (stale,) = _stale(ws)
    assert stale.cases == tuple(stored_case_ids(ws.preprocessed(CONFIG)))
    assert any("spacing_mm" in r for r in stale.reasons)
    with pytest.raises(InputError, match="spacing_mm.*plan_and_preprocess .* --overwrite"):
        check_preprocessed(ws, plans, CONFIG)


def test_cases_of_other_files_or_no_longer_in_the_dataset_are_stale(ws: Workspace) -> None:
    folder = ws.preprocessed(CONFIG)
    record = read_source(folder)
    cases = dict(record.cases, demo_001="made-from-other-files")
    PreprocessedSource(record.plan_fields, cases).to_json(source_path(folder))
    shutil.copy(case_files(folder, "demo_000").data, folder / "gone_data.npy")  # an incomplete leftover
    (stale,) = _stale(ws)
    assert stale.cases == ("gone", "demo_001")
    assert stale.reasons == ("case gone: no longer in the dataset", "case demo_001: made from other files")


def test_a_folder_without_a_record_is_current_unless_the_dataset_changed(ws: Workspace) -> None:
    source_path(ws.preprocessed(CONFIG)).unlink()  # an older autoseg's folder
    assert _stale(ws) == []
    check_preprocessed(ws, Plans.from_json(ws.plans_path), CONFIG)  # taken as plans.json's
    (stale,) = _stale(ws, unknown_is_stale=True)
    assert stale.cases == tuple(stored_case_ids(ws.preprocessed(CONFIG)))


def test_preprocess_workspace_refuses_stale_cases_then_redoes_them_with_overwrite(ws: Workspace) -> None:
    folder = ws.preprocessed(CONFIG)
    before = snapshot(ws.root)
    _edit_plan(ws, spacing_mm=(2.0, 1.0, 1.0))
    edited = snapshot(ws.root)
    with pytest.raises(InputError, match="3d_fullres: made with another plan: spacing_mm"):
        preprocess_workspace(ws, [CONFIG], processes=1, progress=False)
    assert snapshot(ws.root) == edited
    preprocess_workspace(ws, [CONFIG], processes=1, progress=False, overwrite=True)
    assert read_source(folder).plan_fields["spacing_mm"] == [2.0, 1.0, 1.0]
    assert json.loads((folder / "demo_000.json").read_text())["target_spacing_mm"] == [2.0, 1.0, 1.0]
    assert (
        snapshot(ws.root)[f"preprocessed/{CONFIG}/demo_000_data.npy"]
        != before[f"preprocessed/{CONFIG}/demo_000_data.npy"]
    )
    assert _stale(ws) == []


def test_delete_case_removes_the_case_and_its_copies_only(tmp_path: Path) -> None:
    for case_id in ("c1", "c10"):
        for copy in (-1, 0, 1):
            for path in case_files(tmp_path, case_id, copy):
                path.write_bytes(b"x")
        (tmp_path / f"{case_id}.json").write_text("{}")
    assert stored_case_ids(tmp_path) == ["c1", "c10"]
    delete_case(tmp_path, "c1")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for copy in (-1, 0, 1) for p in case_files(tmp_path, "c10", copy)] + ["c10.json"]
    )
    assert stored_case_ids(tmp_path) == ["c10"]
