from __future__ import annotations

from pathlib import Path

import pytest

from autoseg.core.artifacts import ArtifactError
from autoseg.core.workspace import Splits, Workspace, load_or_create_splits, make_splits

CASES = [f"case_{i:02d}" for i in range(12)]


def test_five_folds_with_disjoint_validation_sets_covering_all_cases() -> None:
    splits = make_splits(list(reversed(CASES)), seed=7)
    assert len(splits.folds) == 5 and splits.seed == 7
    vals = [set(f.val) for f in splits.folds]
    assert sorted(len(v) for v in vals) == [2, 2, 2, 3, 3]  # 12 cases in 5 folds, as even as possible
    assert set().union(*vals) == set(CASES)
    assert sum(len(v) for v in vals) == len(CASES)  # disjoint
    for fold in splits.folds:
        assert set(fold.train) == set(CASES) - set(fold.val)
        assert list(fold.train) == sorted(fold.train) and list(fold.val) == sorted(fold.val)


def test_same_seed_same_splits_regardless_of_input_order() -> None:
    assert make_splits(CASES, seed=3) == make_splits(list(reversed(CASES)), seed=3)
    assert make_splits(CASES, seed=3) != make_splits(CASES, seed=4)


def test_fewer_cases_than_folds_gives_one_case_per_fold() -> None:
    splits = make_splits(["a", "b", "c"])
    assert [len(f.val) for f in splits.folds] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 2 training cases"):
        make_splits(["only"])


def test_load_or_create_writes_then_reuses_splits_json(tmp_path: Path) -> None:
    workspace = Workspace.at(tmp_path)
    created = load_or_create_splits(workspace, CASES, seed=1)
    assert workspace.splits_path.is_file()
    assert Splits.from_json(workspace.splits_path) == created
    # a different seed does not reshuffle: the saved splits win, so folds stay comparable across runs
    reused = load_or_create_splits(workspace, list(reversed(CASES)), seed=99)
    assert reused == created and reused.seed == 1


def test_load_or_create_raises_when_cases_changed(tmp_path: Path) -> None:
    workspace = Workspace.at(tmp_path)
    load_or_create_splits(workspace, CASES)
    before = workspace.splits_path.read_text()
    for changed in (CASES[:-1], [*CASES, "case_99"]):
        with pytest.raises(ArtifactError, match="delete it to make new splits") as info:
            load_or_create_splits(workspace, changed)
        assert str(workspace.splits_path) in str(info.value)
    assert workspace.splits_path.read_text() == before


def test_missing_workspace_files_say_which_command_to_run(tmp_path: Path) -> None:
    workspace = Workspace.at(tmp_path / "ws")
    with pytest.raises(ArtifactError, match="autoseg plan_and_preprocess"):
        workspace.dataset_root()
    with pytest.raises(ArtifactError, match="run `autoseg plan") as info:
        workspace.require(workspace.plans_path, "plan")
    assert str(workspace.plans_path) in str(info.value)
    assert workspace.results("2d", 3) == workspace.root / "results" / "2d" / "fold_3"


def test_trained_folds_are_the_numbered_folds_with_the_checkpoint(tmp_path: Path) -> None:
    ws = Workspace.at(tmp_path)
    for fold, which in ((0, "final"), (2, "final"), (1, "latest"), ("all", "final")):
        path = ws.checkpoint("3d_fullres", fold, which)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    assert ws.checkpoint("2d", 3, "best") == tmp_path / "results" / "2d" / "fold_3" / "checkpoint_best.pt"
    assert ws.trained_folds("3d_fullres") == (0, 2)
    assert ws.trained_folds("3d_fullres", "latest") == (1,)
    assert ws.trained_folds("2d") == ()
