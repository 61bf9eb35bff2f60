from __future__ import annotations

from pathlib import Path

import pytest

from autoseg.core.artifacts import ArtifactError
from autoseg.core.workspace import (
    HEAD_TAIL_BYTES,
    Splits,
    Workspace,
    WorkspaceInfo,
    dataset_source,
    load_or_create_splits,
    make_splits,
)

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


def _raw(root: Path, sizes: dict[str, int]) -> Path:
    """A dataset folder: dataset.json and files of the given sizes (deterministic bytes)."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    (root / "dataset.json").write_text('{"name": "x"}')
    for i, (name, size) in enumerate(sizes.items()):
        (root / name).write_bytes(bytes((i + k) % 251 for k in range(size)))
    return root


SIZES = {"imagesTr/a_0000.nii.gz": 10, "labelsTr/a.nii.gz": 3 * HEAD_TAIL_BYTES, "imagesTr/b_0000.nii.gz": 100}


def test_dataset_source_is_content_not_paths_or_mtimes(tmp_path: Path) -> None:
    import shutil

    root = _raw(tmp_path / "d", SIZES)
    (root / "imagesTr" / ".DS_Store").write_bytes(b"finder")  # hidden files are not the dataset's
    copy = tmp_path / "elsewhere" / "d"
    shutil.copytree(root, copy, copy_function=shutil.copyfile)  # cp -r: new mtimes
    source = dataset_source(root)
    assert [f.name for f in source.files] == sorted(SIZES)
    assert dataset_source(copy) == source and source.changes_since(dataset_source(copy)) == []


def test_changes_since_names_each_added_removed_truncated_or_replaced_file(tmp_path: Path) -> None:
    root = _raw(tmp_path / "d", SIZES)
    before = dataset_source(root)
    big = root / "labelsTr/a.nii.gz"
    middle = bytearray(big.read_bytes())
    middle[len(middle) // 2] ^= 1
    big.write_bytes(bytes(middle))  # a change between the hashed ends is not seen (by design: cheap)
    assert dataset_source(root) == before
    last = bytearray(middle)
    last[-1] ^= 1
    big.write_bytes(bytes(last))  # same size, other tail
    (root / "imagesTr/b_0000.nii.gz").write_bytes(b"short")  # truncated
    (root / "imagesTr/a_0000.nii.gz").unlink()
    (root / "imagesTr/c_0000.nii.gz").write_bytes(b"new")
    (root / "dataset.json").write_text('{"name": "y"}')
    assert dataset_source(root).changes_since(before) == [
        "dataset.json: edited",
        "imagesTr/a_0000.nii.gz: removed",
        "imagesTr/b_0000.nii.gz: replaced or truncated (100 -> 5 bytes)",
        "imagesTr/c_0000.nii.gz: added",
        "labelsTr/a.nii.gz: replaced (same size, other content)",
    ]


def test_case_digest_changes_with_its_own_files_only(tmp_path: Path) -> None:
    root = _raw(tmp_path / "d", SIZES)
    before = dataset_source(root)
    (root / "imagesTr/b_0000.nii.gz").write_bytes(b"other")
    after = dataset_source(root)
    case_a = ["imagesTr/a_0000.nii.gz", "labelsTr/a.nii.gz"]
    assert after.digest_of(case_a) == before.digest_of(case_a)
    assert after.digest_of(["imagesTr/b_0000.nii.gz"]) != before.digest_of(["imagesTr/b_0000.nii.gz"])
    assert before.digest_of(["imagesTr/missing.nii.gz"]) != before.digest_of([])


def test_workspace_json_of_schema_1_loads_with_an_unknown_dataset(tmp_path: Path) -> None:
    path = tmp_path / "workspace.json"
    path.write_text('{"schema_version": 1, "dataset_root": "/data/Dataset001"}')
    info = WorkspaceInfo.from_json(path)
    assert info == WorkspaceInfo(dataset_root="/data/Dataset001", dataset=None, plans_hash="")
    assert Workspace.at(tmp_path).dataset_root() == Path("/data/Dataset001")


def test_workspace_json_round_trips_its_fingerprint(tmp_path: Path) -> None:
    info = WorkspaceInfo(str(tmp_path), dataset_source(_raw(tmp_path / "d", SIZES)), "abc")
    info.to_json(tmp_path / "workspace.json")
    assert WorkspaceInfo.from_json(tmp_path / "workspace.json") == info


def test_set_aside_renames_to_the_first_free_stale_name_and_keeps_the_contents(tmp_path: Path) -> None:
    ws = Workspace.at(tmp_path)
    results = ws.results("3d_fullres", 0).parent
    for expected in ("3d_fullres.stale-1", "3d_fullres.stale-2"):
        (results / "fold_0").mkdir(parents=True)
        (results / "fold_0" / "checkpoint_final.pt").write_bytes(b"weights")
        moved = ws.set_aside(results)
        assert moved == results.with_name(expected) and not results.exists()
        assert (moved / "fold_0" / "checkpoint_final.pt").read_bytes() == b"weights"
    ws.splits_path.write_text("{}")
    assert ws.set_aside(ws.splits_path) == tmp_path / "splits.stale-1.json"
    results.mkdir()
    assert ws.set_aside(results) is None and not results.exists()  # an empty folder is just removed
    assert ws.set_aside(tmp_path / "nothing") is None


def test_a_split_naming_a_case_that_is_not_preprocessed_is_refused_naming_file_fold_and_id(tmp_path: Path) -> None:
    """A training id of splits.json is used as a file name: one that climbs out of the workspace (or any id that
    is not a preprocessed case) is refused naming splits.json, the fold and the id, not read from where it points."""
    workspace = Workspace.at(tmp_path)
    splits = load_or_create_splits(workspace, CASES)
    first = splits.folds[0]
    tampered = Splits(
        splits.seed, (type(first)((*first.train, "../../elsewhere/case_00"), first.val), *splits.folds[1:])
    )
    tampered.to_json(workspace.splits_path)
    with pytest.raises(ArtifactError) as info:
        load_or_create_splits(workspace, CASES)
    message = str(info.value)
    assert str(workspace.splits_path) in message and "fold 0's train" in message
    assert "'../../elsewhere/case_00'" in message and "not a preprocessed case" in message
