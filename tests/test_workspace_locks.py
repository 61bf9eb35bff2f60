"""One writer per part of a workspace, through the real CLI in real concurrent processes: a second `train` of a fold
is refused naming the first, `plan_and_preprocess --overwrite` refuses to move a fold being trained, readers refuse
or go on while the plan is being replaced (never wait), the lock of a process killed with SIGKILL is taken over with
a warning, and under torchrun rank 0 holds the fold's lock for every rank.

A process is held still at a chosen moment with SIGSTOP (and let go with SIGCONT), so what runs beside it does not
depend on timing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_checks import assert_refused, run_cli, snapshot
from processes import descendants, kill_when, start

from autoseg.core.workspace import Workspace, WorkspaceInfo

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals, /proc")]

PLAN = ("--device", "cpu", "--cpu-flops", "1e10", "--ram", "8GiB", "-c", "3d_fullres", "--processes", "1")
TRAIN = ("--iterations-per-epoch", "4", "--val-iterations", "1", "--no-validation", "--loader-workers", "0")
TRAIN += ("--device", "cpu")
FOLD_LOCK = Path(".locks/results.3d_fullres.fold_0.lock")
PLAN_LOCK = Path(".locks/plan.lock")


@pytest.fixture()
def made(prepared: Path, tiny_dataset: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a writable dataset, a workspace made from it): copies of the tiny dataset and the prepared workspace."""
    dataset = Path(shutil.copytree(tiny_dataset, tmp_path / tiny_dataset.name, copy_function=shutil.copyfile))
    ws = Path(shutil.copytree(prepared, tmp_path / "ws"))
    info = Workspace.at(ws).info()
    WorkspaceInfo(str(dataset.resolve()), info.dataset, info.plans_hash).to_json(ws / "workspace.json")
    return dataset, ws


def _replace_case(dataset: Path) -> None:
    """demo_000's image and label replaced by demo_001's: --overwrite then moves every trained fold aside."""
    shutil.copyfile(dataset / "imagesTr/demo_001_0000.nii.gz", dataset / "imagesTr/demo_000_0000.nii.gz")
    shutil.copyfile(dataset / "labelsTr/demo_001.nii.gz", dataset / "labelsTr/demo_000.nii.gz")


def _record(path: Path, process: subprocess.Popen, timeout_s: float = 120, not_by: int = -1) -> dict:
    """The lock record at ``path`` once its holder (not process ``not_by``) has written it; ``process`` must still
    run."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"ended before holding {path}:\n{process.stderr.read().decode()}"
        try:
            record = json.loads(path.read_text())
            if record["pid"] != not_by:
                return record
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"{path} never held"
        time.sleep(0.005)


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _finish(process: subprocess.Popen, timeout_s: float = 300) -> str:
    _, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, err.decode()
    return err.decode()


def _names_holder(err: str, record: dict, lock_file: Path) -> None:
    for named in (f"process {record['pid']} ", record["host"], record["started"], record["command"], lock_file):
        assert str(named) in err, f"{named!r} not named in:\n{err}"


def test_two_trainings_of_one_fold_started_together_one_runs_one_is_refused(made) -> None:
    _, ws = made
    runs = [start("train", "fold", "0", "-w", ws, "--epochs", "8", *TRAIN) for _ in range(2)]
    results = []
    for process in runs:
        _, err = process.communicate(timeout=300)
        results.append((process.returncode, err.decode()))
    assert sorted(code for code, _ in results) == [0, 2], results
    winner = runs[[code for code, _ in results].index(0)]
    refusal = next(err for code, err in results if code == 2)
    assert f"process {winner.pid} " in refusal and socket.gethostname() in refusal, refusal
    assert "autoseg -q train fold 0" in refusal and str(ws / FOLD_LOCK) in refusal and "Traceback" not in refusal
    rows = [json.loads(line) for line in (ws / "results/3d_fullres/fold_0/metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(8))  # one run's epochs, not two interleaved
    assert not (ws / ".locks").exists()


def test_overwrite_refuses_to_move_a_fold_being_trained_and_moves_it_after(made, capsys) -> None:
    dataset, ws = made
    trainer = start("train", "fold", "0", "-w", ws, "--epochs", "6", *TRAIN)
    record = _record(ws / FOLD_LOCK, trainer)
    while not (ws / "results/3d_fullres/fold_0/train.log").exists():  # past its check of the dataset
        assert trainer.poll() is None, trainer.stderr.read().decode()
        time.sleep(0.005)
    _replace_case(dataset)
    with _stopped(trainer.pid):
        before = snapshot(ws)
        result = run_cli(capsys, "plan_and_preprocess", dataset, "-w", ws, *PLAN, "--overwrite")
        assert_refused(result, 2, "results/3d_fullres/fold_0")
        _names_holder(result.err, record, ws / FOLD_LOCK)
        assert snapshot(ws) == before  # nothing moved, deleted or planned
        gpus = run_cli(capsys, "train", "fold", "0", "-w", ws, "--gpus", "2", *TRAIN)  # refused before torchrun
        assert_refused(gpus, 2, f"process {record['pid']} ", ws / FOLD_LOCK)
    _finish(trainer)
    assert (ws / "results/3d_fullres/fold_0/checkpoint_final.pt").is_file()
    assert run_cli(capsys, "plan_and_preprocess", dataset, "-w", ws, *PLAN, "--overwrite").status == 0
    assert (ws / "results/3d_fullres.stale-1/fold_0/checkpoint_final.pt").is_file()


def test_while_the_plan_is_replaced_writers_and_readers_of_it_refuse_and_others_go_on(
    made, trained: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    dataset, ws = made
    monkeypatch.setattr("autoseg.cli.budget.measure_budget", lambda *a: pytest.fail("measured a budget"))
    shutil.copytree(trained / "results", ws / "results")
    _replace_case(dataset)
    planner = start("plan_and_preprocess", dataset, "-w", ws, *PLAN, "--overwrite")
    record = _record(ws / PLAN_LOCK, planner)
    assert record["replacing"] and record["part"] == "the plan and preprocessed data"
    with _stopped(planner.pid):
        for argv in (
            ("train", "fold", "1", "-w", ws, *TRAIN),
            ("find-best", "-w", ws),
            ("predict", "-i", dataset / "imagesTs", "-o", tmp_path / "out", "-w", ws),
            ("export-model", tmp_path / "model.zip", "-w", ws),
            ("plan_and_preprocess", dataset, "-w", ws, *PLAN),  # refused before its budget is measured
        ):
            t0 = time.monotonic()
            result = run_cli(capsys, *argv)
            assert_refused(result, 2, "being replaced")
            _names_holder(result.err, record, ws / PLAN_LOCK)
            assert time.monotonic() - t0 < 30
        assert not (tmp_path / "out").exists() and not (ws / "results/3d_fullres/fold_1").exists()
        assert run_cli(capsys, "explain", "-w", ws).status == 0  # reads plans.json, replaced whole: never waits
        labels = dataset / "labelsTr"
        assert run_cli(capsys, "evaluate", labels, labels, "-o", tmp_path / "summary.json", "--no-surface").status == 0
    _finish(planner)
    assert not (ws / ".locks").exists()


def test_the_lock_of_a_trainer_killed_with_sigkill_is_taken_over_with_a_warning(made) -> None:
    _, ws = made
    trainer = start("train", "fold", "0", "-w", ws, "--epochs", "50", *TRAIN)
    record = _record(ws / FOLD_LOCK, trainer)
    kill_when(trainer, lambda pids: (ws / "results/3d_fullres/fold_0/checkpoint_latest.pt").exists())
    assert json.loads((ws / FOLD_LOCK).read_text())["pid"] == record["pid"]  # left behind with its record
    err = _finish(start("train", "fold", "0", "-w", ws, "--epochs", "1", *TRAIN))
    assert "taking over the lock on results/3d_fullres/fold_0" in err and f"process {trainer.pid} " in err, err
    assert not (ws / ".locks").exists()


def test_under_torchrun_rank_0_holds_the_fold_for_every_rank(made, capsys) -> None:
    _, ws = made
    launcher = subprocess.Popen(
        [sys.executable, "-m", "autoseg.cli", "-q", "train", "fold", "0", "-w", ws, "--gpus", "2", "--epochs", "3"]
        + list(TRAIN),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    record = _record(ws / FOLD_LOCK, launcher, timeout_s=240, not_by=launcher.pid)  # the launcher only checks it
    assert "--gpus" not in record["command"] and record["pid"] in descendants(launcher.pid)
    with _stopped(record["pid"]):
        result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
        assert_refused(result, 2, f"process {record['pid']} ", ws / FOLD_LOCK)
    _finish(launcher)  # the other rank was not refused
    assert (ws / "results/3d_fullres/fold_0/checkpoint_final.pt").is_file()
    assert not (ws / ".locks").exists()
