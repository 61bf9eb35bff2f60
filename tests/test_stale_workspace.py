"""A workspace knows the dataset and plan it was made from: through the real CLI, a different or changed
dataset is refused with nothing changed (or redone with --overwrite, equal to a fresh workspace), a
plans.json edited after preprocessing stops training, a budget too small for any network writes nothing,
and a workspace.json of schema 1 still works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli, snapshot

from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace, WorkspaceInfo
from autoseg.demo.data import make_demo_dataset
from autoseg.plan.budget import Budget
from autoseg.plan.iteration_target import iteration_target
from autoseg.plan.run import file_hash
from autoseg.preprocess.run import PreprocessRequest, plan_and_preprocess

PLAN = ("--device", "cpu", "--cpu-flops", "1e10", "--ram", "8GiB")  # fixed budget: the same plan every run
CONFIG = ("-c", "3d_fullres", "--processes", "1")
TRAIN = ("--epochs", "1", "--iterations-per-epoch", "1", "--val-iterations", "1", "--no-validation")


def _plan_and_preprocess(capsys, dataset: Path, ws: Path, *extra: str):
    return run_cli(capsys, "plan_and_preprocess", dataset, "-w", ws, *PLAN, *CONFIG, *extra)


def _copy(src: Path, dst: Path) -> Path:
    """``cp -r`` without -p: new mtimes, same content."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    return dst


def _preprocessed(ws: Path) -> dict[str, str]:
    """The preprocessed cases and their source record (the reports hold timings)."""
    return {k: v for k, v in snapshot(ws / "preprocessed").items() if not k.endswith("_report.json")}


@pytest.fixture(scope="module")
def made(tiny_dataset, tmp_path_factory) -> tuple[Path, Path]:
    """(dataset copy, workspace made from it as `plan_and_preprocess DATASET -w WS *PLAN *CONFIG` makes it).
    Tests copy both."""
    root = tmp_path_factory.mktemp("stale")
    dataset = _copy(tiny_dataset, root / "Dataset001_Tiny")
    budget = Budget(gpu_memory_bytes=8 * GiB, host_ram_bytes=8 * GiB, device="cpu", cpu_flops_per_second=1e10)
    request = PreprocessRequest(configs=("3d_fullres",), processes=1)
    plan_and_preprocess(dataset, Workspace.at(root / "ws"), budget, preprocessing=request, progress=False)
    return dataset, root / "ws"


@pytest.fixture()
def copies(made, tmp_path) -> tuple[Path, Path]:
    dataset, ws = made
    return _copy(dataset, tmp_path / dataset.name), _copy(ws, tmp_path / "ws")


def _repoint(ws: Path, dataset: Path) -> None:
    """Make ``ws`` record ``dataset`` (a copy of its own dataset: same files) as the folder it was made from."""
    info = Workspace.at(ws).info()
    WorkspaceInfo(str(dataset.resolve()), info.dataset, info.plans_hash).to_json(ws / "workspace.json")


def test_rerun_on_the_unchanged_dataset_changes_nothing(copies, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    before = snapshot(ws)
    assert _plan_and_preprocess(capsys, dataset, ws).status == 0
    assert snapshot(ws) == before


def test_a_different_dataset_is_refused_naming_both(copies, tmp_path, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    other = make_demo_dataset(tmp_path / "Dataset002_Other", num_train=3, num_test=0, shape_zyx=(12, 28, 28), seed=9)
    before = snapshot(ws)
    result = _plan_and_preprocess(capsys, other, ws)
    assert_refused(result, 2, ws, dataset.resolve(), other.resolve(), "-w", "--overwrite")
    assert snapshot(ws) == before


def _add_case(dataset: Path) -> str:
    shutil.copyfile(dataset / "imagesTr/demo_000_0000.nii.gz", dataset / "imagesTr/demo_009_0000.nii.gz")
    shutil.copyfile(dataset / "labelsTr/demo_000.nii.gz", dataset / "labelsTr/demo_009.nii.gz")
    meta = json.loads((dataset / "dataset.json").read_text())
    meta["numTraining"] += 1
    (dataset / "dataset.json").write_text(json.dumps(meta))
    return "imagesTr/demo_009_0000.nii.gz"


def _replace_case(dataset: Path) -> str:
    """Case demo_000's image and label replaced by demo_001's (a consistent pair, other content)."""
    shutil.copyfile(dataset / "imagesTr/demo_001_0000.nii.gz", dataset / "imagesTr/demo_000_0000.nii.gz")
    shutil.copyfile(dataset / "labelsTr/demo_001.nii.gz", dataset / "labelsTr/demo_000.nii.gz")
    return "imagesTr/demo_000_0000.nii.gz"


def _rewrite_voxels(dataset: Path) -> str:
    """demo_002's image rewritten in place with other voxels, same geometry: the plan stays the same (z-score
    normalization reads no dataset statistics), so only this case is stale."""
    path = dataset / "imagesTr/demo_002_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    array = sitk.GetArrayFromImage(image)
    array[array.shape[0] // 2] += 5
    changed = sitk.GetImageFromArray(array)
    changed.CopyInformation(image)
    sitk.WriteImage(changed, str(path))
    return "imagesTr/demo_002_0000.nii.gz"


def _edit_dataset_json(dataset: Path) -> str:
    meta = json.loads((dataset / "dataset.json").read_text())
    meta["description"] = "edited"
    (dataset / "dataset.json").write_text(json.dumps(meta, indent=4))
    return "dataset.json"


@pytest.mark.slow
@pytest.mark.parametrize("change", [_add_case, _replace_case, _rewrite_voxels, _edit_dataset_json])
def test_a_changed_dataset_is_refused_then_redone_as_fresh_with_overwrite(copies, tmp_path, capsys, change) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    changed = change(dataset)
    before = snapshot(ws)
    assert_refused(_plan_and_preprocess(capsys, dataset, ws), 2, dataset, changed, "--overwrite")
    assert snapshot(ws) == before
    result = _plan_and_preprocess(capsys, dataset, ws, "--overwrite")
    assert result.status == 0, result.err
    fresh = tmp_path / "fresh"
    assert _plan_and_preprocess(capsys, dataset, fresh).status == 0
    assert _preprocessed(ws) == _preprocessed(fresh)
    assert (ws / "plans.json").read_bytes() == (fresh / "plans.json").read_bytes()


def test_overwrite_redoes_only_the_changed_case_when_the_plan_stays(copies, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    _rewrite_voxels(dataset)
    before = _preprocessed(ws)
    assert _plan_and_preprocess(capsys, dataset, ws, "--overwrite").status == 0
    after = _preprocessed(ws)
    redone = {k for k in before if before[k] != after.get(k)}
    assert "3d_fullres/demo_002_data.npy" in redone and "3d_fullres_source.json" in redone
    assert all(k.startswith("3d_fullres/demo_002") for k in redone - {"3d_fullres_source.json"}), redone
    assert after.keys() == before.keys()


def test_overwrite_moves_trained_folds_of_a_changed_dataset_aside(copies, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    fold = ws / "results/3d_fullres/fold_0"
    fold.mkdir(parents=True)
    (fold / "checkpoint_final.pt").write_bytes(b"trained")
    _replace_case(dataset)
    assert _plan_and_preprocess(capsys, dataset, ws, "--overwrite").status == 0
    assert not (ws / "results/3d_fullres").exists()
    assert (ws / "results/3d_fullres.stale-1/fold_0/checkpoint_final.pt").read_bytes() == b"trained"


def test_train_refuses_preprocessed_data_of_another_plan(prepared, tmp_path, capsys) -> None:
    ws = _copy(prepared, tmp_path / "ws")
    plans = json.loads((ws / "plans.json").read_text())
    plans["configurations"]["3d_fullres"]["spacing_mm"] = [3.0, 1.0, 1.0]  # a hand edit of the target spacing
    (ws / "plans.json").write_text(json.dumps(plans, indent=2))
    before = snapshot(ws)
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
    assert_refused(result, 2, ws / "preprocessed/3d_fullres", "spacing_mm", "plan_and_preprocess", "--overwrite")
    assert snapshot(ws) == before


@pytest.mark.slow
def test_train_refuses_a_changed_dataset_and_works_without_one(copies, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    _edit_dataset_json(dataset)
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
    assert_refused(result, 2, dataset, "dataset.json", "plan_and_preprocess", "--overwrite")
    shutil.rmtree(dataset)  # gone: training reads the preprocessed data only, the final validation the images
    validating = [a for a in TRAIN if a != "--no-validation"]
    assert_refused(run_cli(capsys, "train", "fold", "0", "-w", ws, *validating), 2, dataset, "--no-validation")
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
    assert result.status == 0, result.err
    assert (ws / "results/3d_fullres/fold_0/checkpoint_final.pt").is_file()


@pytest.mark.slow
def test_a_budget_too_small_for_any_network_writes_nothing(copies, tmp_path, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    new = tmp_path / "new_ws"
    for target in (new, ws):
        before = snapshot(target)
        result = run_cli(
            capsys,
            "plan_and_preprocess",
            dataset,
            "-w",
            target,
            "--device",
            "cpu",
            "--cpu-flops",
            "1e10",
            "--ram",
            "1MiB",
            "--overwrite",
        )
        assert_refused(result, 2, "--ram", "MiB")
        assert snapshot(target) == before
    assert not new.exists() or not any(new.iterdir())


def test_a_schema_1_workspace_is_adopted_for_its_own_folder_and_refuses_another(copies, tmp_path, capsys) -> None:
    dataset, ws = copies
    (ws / "workspace.json").write_text(json.dumps({"schema_version": 1, "dataset_root": str(dataset.resolve())}))
    (ws / "preprocessed/3d_fullres_source.json").unlink()  # as an older autoseg left it
    cases = _preprocessed(ws)
    assert Workspace.at(ws).info().dataset is None
    elsewhere = _copy(dataset, tmp_path / "elsewhere" / dataset.name)  # same files, but nothing recorded to say so
    before = snapshot(ws)
    assert_refused(_plan_and_preprocess(capsys, elsewhere, ws), 2, ws, dataset.resolve(), elsewhere.resolve())
    assert snapshot(ws) == before
    assert _plan_and_preprocess(capsys, dataset, ws).status == 0
    assert Workspace.at(ws).info().dataset is not None  # recorded from now on
    assert {k: v for k, v in _preprocessed(ws).items() if not k.endswith("_source.json")} == cases


def test_overwrite_with_another_ram_budget_replans_but_keeps_trained_folds(copies, capsys) -> None:
    dataset, ws = copies
    _repoint(ws, dataset)
    fold = ws / "results/3d_fullres/fold_0"
    fold.mkdir(parents=True)
    (fold / "checkpoint_final.pt").write_bytes(b"trained")
    cases = _preprocessed(ws)
    argv = (
        "plan_and_preprocess",
        dataset,
        "-w",
        ws,
        "--device",
        "cpu",
        "--cpu-flops",
        "1e10",
        "--ram",
        "4GiB",
        *CONFIG,
    )
    assert run_cli(capsys, *argv).status == 0  # without --overwrite the workspace's plan is kept
    assert json.loads((ws / "plans.json").read_text())["host_ram_bytes"] == 8 * GiB
    assert run_cli(capsys, *argv, "--overwrite").status == 0
    assert json.loads((ws / "plans.json").read_text())["host_ram_bytes"] == 4 * GiB
    assert (fold / "checkpoint_final.pt").read_bytes() == b"trained"  # the network and data are the same
    assert _preprocessed(ws) == cases


@pytest.mark.parametrize(("field", "value", "kept"), [("loader_workers", 3, True), ("batch_size", 1, False)])
def test_overwrite_sets_trained_folds_aside_only_when_the_network_or_its_data_change(
    copies, capsys, field, value, kept
) -> None:
    """plans.json as an earlier planner run wrote it (its hash recorded), differing from this run's plan in one
    field: a machine figure keeps the trained folds, a training figure moves them aside."""
    dataset, ws = copies
    _repoint(ws, dataset)
    plans = json.loads((ws / "plans.json").read_text())
    plans["configurations"]["3d_fullres"][field] = value
    (ws / "plans.json").write_text(json.dumps(plans, indent=2))
    info = Workspace.at(ws).info()
    WorkspaceInfo(info.dataset_root, info.dataset, file_hash(ws / "plans.json")).to_json(ws / "workspace.json")
    fold = ws / "results/3d_fullres/fold_0"
    fold.mkdir(parents=True)
    (fold / "checkpoint_final.pt").write_bytes(b"trained")
    assert _plan_and_preprocess(capsys, dataset, ws, "--overwrite").status == 0
    assert (fold / "checkpoint_final.pt").is_file() == kept
    assert (ws / "results/3d_fullres.stale-1/fold_0/checkpoint_final.pt").is_file() != kept


def test_planning_for_another_time_budget_keeps_the_preprocessed_cases(copies, capsys) -> None:
    """`plan_and_preprocess --time-budget T --overwrite` on a workspace planned without one: the rule's target and
    the budget are recorded, the step is sized for them, the preprocessed cases are not rewritten (the spacing is
    the same) and the folds trained on the old patch are moved aside."""
    dataset, ws = copies
    _repoint(ws, dataset)
    fold = ws / "results/3d_fullres/fold_0"
    fold.mkdir(parents=True)
    (fold / "checkpoint_final.pt").write_bytes(b"trained")
    cases, before = _preprocessed(ws), json.loads((ws / "plans.json").read_text())
    assert _plan_and_preprocess(capsys, dataset, ws, "--time-budget", "3m", "--overwrite").status == 0
    after = json.loads((ws / "plans.json").read_text())
    target = iteration_target(180.0)
    assert (after["time_budget_seconds"], after["cpu_seconds_per_iteration"]) == (180.0, target.seconds)
    assert after["iteration_reason"] == target.reason
    old, new = (p["configurations"]["3d_fullres"]["predicted_seconds_per_iteration"] for p in (before, after))
    assert new <= target.seconds < old  # a narrower network here: the patch covered the tiny cases already
    assert _preprocessed(ws) == cases
    assert (ws / "results/3d_fullres.stale-1/fold_0/checkpoint_final.pt").is_file()
