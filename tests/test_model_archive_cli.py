"""`autoseg export-model` and `autoseg predict -m` through the real CLI: a model predicts without its
workspace, byte for byte as from the workspace, and a damaged or altered archive is refused naming it and the
member, before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from cli_checks import assert_refused, run_cli, snapshot
from processes import kill_when, start

from autoseg.cli.main import main

MANIFEST = "autoseg_model.json"
CHECKPOINT = "results/3d_fullres/fold_0/checkpoint_final.pt"
pytestmark = pytest.mark.slow  # the trained fixture: one fold trained once per session (~5 s); a test then < 1 s


@pytest.fixture(scope="module")
def archive(trained: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model_zip") / "model.zip"
    assert main(["-q", "export-model", str(out), "-w", str(trained)]) == 0
    return out


# two runs compared byte for byte: one runtime for both (auto may choose again on a busy machine)
TORCH = ("--runtime", "torch")


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _write(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _model_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("autoseg-model-*"))


def test_a_model_predicts_elsewhere_without_its_workspace_identically(
    trained: Path, tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch, native_bf16
) -> None:
    ws, images = tmp_path / "ws", tiny_dataset / "imagesTs"
    shutil.copytree(trained, ws)
    result = run_cli(capsys, "predict", "-i", images, "-o", tmp_path / "from_ws", "-w", ws, "--no-mirror", *TORCH)
    assert result.status == 0, result.err
    model = tmp_path / "model.zip"
    skipped = run_cli(capsys, "export-model", tmp_path / "unchecked.zip", "-w", ws, "--no-precision-check")
    assert "fold 0 of 3d_fullres: bf16 not checked: no stored check" in skipped.out, skipped.err
    assert "--no-precision-check skips making one" in skipped.out
    result = run_cli(capsys, "export-model", model, "-w", ws)
    assert result.status == 0 and f"wrote {model}" in result.out, result.err
    assert "fold 0 of 3d_fullres: bf16 checked (made now): fp32 / bf16 (torch) mean Dice over 1 " in result.out
    moved = tmp_path / "elsewhere" / "model.zip"
    moved.parent.mkdir()
    model.rename(moved)
    shutil.rmtree(ws)  # the workspace is gone: the archive must carry everything
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    before = _model_folders()
    result = run_cli(capsys, "predict", "-m", moved, "-i", images, "-o", "out", "--no-mirror", *TORCH)
    assert result.status == 0, result.err
    assert snapshot(fresh / "out") == snapshot(tmp_path / "from_ws") != {}
    assert sorted(p.name for p in fresh.iterdir()) == ["out"]  # nothing unpacked into the working directory
    assert _model_folders() == before  # the temporary workspace was removed


def test_export_refuses_a_missing_fold_and_an_unplanned_workspace(trained: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model.zip"
    before = snapshot(trained)
    assert_refused(
        run_cli(capsys, "export-model", out, "-w", trained, "--folds", "0", "2"),
        2,
        "fold(s) 2 of 3d_fullres",
        "checkpoint_final.pt",
        "autoseg train fold 2",
    )
    assert_refused(
        run_cli(capsys, "export-model", out, "-w", tmp_path / "nothing"),
        2,
        tmp_path / "nothing" / "plans.json",
        "plan_and_preprocess",
    )
    assert_refused(run_cli(capsys, "export-model", out, "-w", trained, "--folds", "zero"), 2, "'zero' is not a fold")
    assert not out.exists() and snapshot(trained) == before


def _truncated(members: dict[str, bytes], path: Path) -> Path:
    path.write_bytes(_write(path, members).read_bytes()[:-200])
    return path


def _tampered(members: dict[str, bytes], path: Path) -> Path:
    data = bytearray(members[CHECKPOINT])
    data[len(data) // 2] ^= 0xFF  # one byte of the weights
    return _write(path, {**members, CHECKPOINT: bytes(data)})


def _zip_slip(members: dict[str, bytes], path: Path) -> Path:
    return _write(path, {**members, "../../outside.txt": b"x"})


def _future_version(members: dict[str, bytes], path: Path) -> Path:
    manifest = json.loads(members[MANIFEST])
    return _write(path, {**members, MANIFEST: json.dumps({**manifest, "schema_version": 99}).encode()})


@pytest.mark.parametrize(
    "damage, named",
    [
        (_truncated, ["truncated or damaged"]),
        (_tampered, [f"member {CHECKPOINT}", "sha256", "differs from the manifest"]),
        (_zip_slip, ["member '../../outside.txt' has an unsafe path"]),
        (_future_version, [f"member {MANIFEST}", "archive format version 99"]),
    ],
)
def test_predict_refuses_a_damaged_or_altered_archive(
    archive: Path, tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch, damage, named: list[str]
) -> None:
    bad = damage(_members(archive), tmp_path / "bad.zip")
    monkeypatch.chdir(tmp_path)
    before = _model_folders()
    result = run_cli(capsys, "predict", "-m", bad, "-i", tiny_dataset / "imagesTs", "-o", tmp_path / "out")
    assert_refused(result, 2, bad, *named)
    assert not (tmp_path / "out").exists() and not (tmp_path.parent / "outside.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.zip"] and _model_folders() == before


def test_predict_from_an_archive_refuses_folds_it_does_not_hold(
    archive: Path, tiny_dataset: Path, tmp_path: Path, capsys
) -> None:
    result = run_cli(
        capsys, "predict", "-m", archive, "-i", tiny_dataset / "imagesTs", "-o", tmp_path / "out", "--folds", "0", "3"
    )
    assert_refused(result, 2, "--folds 3", archive, "fold(s) 0")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["-w", "."], ["-w/--workspace", "-m/--model"]),
        (["--workspace", "ws"], ["-w/--workspace", "-m/--model"]),
        (["--checkpoint", "best"], ["--checkpoint", "-m/--model", "export-model"]),
        (["--checkpoint", "final"], ["--checkpoint", "-m/--model"]),
    ],
)
def test_predict_from_an_archive_refuses_workspace_and_checkpoint_at_parse_time(
    tmp_path: Path, capsys, flags, named: list[str]
) -> None:
    """The archive is the workspace and holds one checkpoint per fold: -w or --checkpoint beside -m would be
    ignored, so they are refused before anything is read or written (the archive need not even exist)."""
    result = run_cli(
        capsys, "predict", "-m", tmp_path / "model.zip", "-i", tmp_path / "in", "-o", tmp_path / "out", *flags
    )
    assert_refused(result, 2, *named)
    assert list(tmp_path.iterdir()) == []


def test_the_model_folder_a_killed_predict_left_is_removed_by_the_next_one(
    archive: Path, tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """SIGKILL runs no cleanup: the unpacked model stays in the temporary folder, named with its process id, and
    the next `predict -m` removes it (that process is gone); a running process's folder and others are kept."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the killed process's temporary folder
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # and this one's
    images = tiny_dataset / "imagesTs"
    process = start("predict", "-m", archive, "-i", images, "-o", tmp_path / "killed")
    kill_when(process, lambda _: any(temp.glob(f"autoseg-model-*/{CHECKPOINT}")))
    assert [p.name.split("-")[2] for p in temp.iterdir()] == [str(process.pid)]  # left behind, named with its pid
    running = temp / f"autoseg-model-{os.getpid()}-running"  # this process is alive: its folder is in use
    others = [running, temp / "autoseg-model-notes", temp / "autoseg-model-k1ll3d"]  # not named with a pid
    for folder in others:
        folder.mkdir()
    result = run_cli(capsys, "predict", "-m", archive, "-i", images, "-o", tmp_path / "out", "--no-mirror")
    assert result.status == 0, result.err
    assert sorted(temp.iterdir()) == sorted(others)


def test_predict_from_an_archive_loads_each_checkpoint_once(
    archive: Path, tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The checkpoint is read where predict loads it (weights_only), not a second time to check the archive."""
    loads: Counter[str] = Counter()
    load = torch.load

    def counted(path, *args, **kwargs):
        loads[Path(path).relative_to(Path(path).parents[3]).as_posix()] += 1
        return load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    result = run_cli(
        capsys, "predict", "-m", archive, "-i", tiny_dataset / "imagesTs", "-o", tmp_path / "out", "--no-mirror"
    )
    assert result.status == 0, result.err
    assert loads == {CHECKPOINT: 1}


@pytest.mark.parametrize(
    "checkpoint, named",
    [
        ({"version": 2, "network": {}, "payload": Path("/etc/passwd")}, "it is not a readable checkpoint"),  # code
        ({"version": 2, "network": torch.nn.Linear(2, 2).state_dict()}, "its weights do not fit the planned"),
        ({"version": 2}, "holds no network weights"),
    ],
)
def test_predict_refuses_a_crafted_checkpoint_naming_the_archive_and_member(
    archive: Path, tiny_dataset: Path, tmp_path: Path, capsys, checkpoint: dict, named: str
) -> None:
    """Members and manifest agree (the sums catch damage, not forgery): the checkpoint is refused when predict
    loads it, with weights_only=True (no code runs), before any case is predicted."""
    crafted = tmp_path / "crafted.pt"
    torch.save(checkpoint, crafted)
    members = {**_members(archive), CHECKPOINT: crafted.read_bytes()}
    manifest = json.loads(members[MANIFEST])
    manifest["members"] = [
        {"name": n, "size_bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for n, b in members.items()
        if n != MANIFEST
    ]
    bad = _write(tmp_path / "bad.zip", {**members, MANIFEST: json.dumps(manifest).encode()})
    result = run_cli(capsys, "predict", "-m", bad, "-i", tiny_dataset / "imagesTs", "-o", tmp_path / "out")
    assert_refused(result, 2, f"{bad}: member {CHECKPOINT}: {named}", "export the model again")
    assert "autoseg-model-" not in result.err and not list((tmp_path / "out").glob("*.nii.gz"))
