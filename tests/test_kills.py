"""SIGKILL of each stage's main process, through the real CLI in a subprocess: no worker outlives it, and a
rerun gives what a run that was never killed gives, with no temporary file left.

Runs that must match bit for bit use one CPU (``sched_setaffinity``): the CPU thread count is measured at
the start of training and prediction, and a different count changes the float sums.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_checks import run_cli, snapshot
from disk_limits import temporaries
from processes import kill_when, one_cpu, start

from autoseg.core.workspace import Workspace
from autoseg.demo.data import make_demo_dataset
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

PLAN = ["--gpu-memory", "8GiB", "--ram", "8GiB", "--device", "cpu", "--cpu-flops", "1e11", "-c", "3d_fullres"]
TRAIN = [
    "--iterations-per-epoch",
    "4",
    "--val-iterations",
    "1",
    "--no-validation",
    "--loader-workers",
    "1",
    "--device",
    "cpu",
]


def _spawned_workers(pids: list[int]) -> list[int]:
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            return ""

    return [pid for pid in pids if "multiprocessing.spawn" in cmdline(pid)]


def test_plan_and_preprocess_killed_leaves_no_worker_and_reruns_identically(tmp_path: Path, capsys) -> None:
    dataset = make_demo_dataset(tmp_path / "Dataset001_Tiny", num_train=8, num_test=0, shape_zyx=(12, 28, 28), seed=3)
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    cases = killed / "preprocessed" / "3d_fullres"
    process = start("plan_and_preprocess", dataset, "-w", killed, "--processes", "2", *PLAN)
    kill_when(process, lambda pids: len(_spawned_workers(pids)) == 2 and any(cases.glob("*.npy")))

    assert run_cli(capsys, "plan_and_preprocess", dataset, "-w", killed, "--processes", "2", *PLAN).status == 0
    assert run_cli(capsys, "plan_and_preprocess", dataset, "-w", reference, "--processes", "2", *PLAN).status == 0
    assert snapshot(cases) == snapshot(reference / "preprocessed" / "3d_fullres")
    assert len(snapshot(cases)) == 8 * 4
    assert temporaries(killed) == []


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "ws"))


def test_train_killed_mid_epoch_resumes_to_identical_weights(workspace: Path, tmp_path: Path) -> None:
    reference = Path(shutil.copytree(workspace, tmp_path / "reference"))
    with one_cpu():
        train(
            Workspace.at(reference),
            "3d_fullres",
            0,
            RunConfig(epochs=3, iterations_per_epoch=4, val_iterations=1, validate=False, loader_workers=1),
            progress=False,
        )
    fold = workspace / "results" / "3d_fullres" / "fold_0"
    process = start("train", "fold", "0", "-w", workspace, "--epochs", "3", *TRAIN)
    started: list[float] = []

    def mid_epoch_1(pids: list[int]) -> bool:  # a while after epoch 0's checkpoint, with the loader worker up
        if not started and (fold / "checkpoint_latest.pt").exists():
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 0.3 and len(pids) > 0

    workers = kill_when(process, mid_epoch_1)
    assert workers, "the trainer had no loader worker to outlive it"
    assert not (fold / "checkpoint_final.pt").exists()
    (fold / ".checkpoint_latest.pt.k1ll3d.tmp.pt").write_bytes(b"half a checkpoint")  # a kill during torch.save

    resumed = start("train", "fold", "0", "-w", workspace, "--epochs", "3", "--resume", *TRAIN)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err.decode()
    expected, got = (
        read_checkpoint_file(f / "results" / "3d_fullres" / "fold_0" / "checkpoint_final.pt", "")
        for f in (reference, workspace)
    )
    assert expected["network"].keys() == got["network"].keys()
    for name, tensor in expected["network"].items():
        assert torch.equal(tensor, got["network"][name]), name
    assert temporaries(workspace) == []


def test_predict_killed_reruns_to_identical_outputs(
    workspace: Path, tiny_dataset: Path, tmp_path: Path, capsys
) -> None:
    with one_cpu():
        train(
            Workspace.at(workspace),
            "3d_fullres",
            0,
            RunConfig(epochs=1, iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1),
            progress=False,
        )
    inputs = tmp_path / "in"
    inputs.mkdir()
    image = next((tiny_dataset / "imagesTs").glob("*_0000.nii.gz"))
    for i in range(8):
        shutil.copy(image, inputs / f"scan_{i:03d}_0000.nii.gz")
    out, reference = tmp_path / "out", tmp_path / "reference"
    with one_cpu():
        assert run_cli(capsys, "predict", "-i", inputs, "-o", reference, "-w", workspace, "--no-mirror").status == 0

    process = start("predict", "-i", inputs, "-o", out, "-w", workspace, "--no-mirror")
    kill_when(process, lambda pids: any(out.glob("scan_*.nii.gz")))
    assert len(list(out.glob("scan_*.nii.gz"))) < 8
    (out / ".scan_007.nii.gz.k1ll3d.tmp.nii.gz").write_bytes(b"half an image")  # a kill during the write
    with one_cpu():
        assert run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", workspace, "--no-mirror").status == 0
    assert snapshot(out) == snapshot(reference) and len(snapshot(out)) == 8
    assert temporaries(out) == []


def test_train_gpus_killed_stops_torchrun_and_its_ranks(workspace: Path) -> None:
    """`train --gpus 2 --device cpu` runs torchrun as a child: SIGKILL of autoseg sends torchrun SIGTERM
    (a death signal), and torchrun stops its two ranks."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autoseg.cli",
            "-q",
            "train",
            "fold",
            "0",
            "-w",
            workspace,
            "--gpus",
            "2",
            "--epochs",
            "50",
            *TRAIN,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def ranks_started(pids: list[int]) -> bool:
        return sum("autoseg" in _cmdline(pid) and "train" in _cmdline(pid) for pid in pids) >= 2

    kill_when(process, ranks_started, timeout_s=120)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""
