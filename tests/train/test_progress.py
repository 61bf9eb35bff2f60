"""The trainer's progress: a fold written before it became one artifact still resumes, to the same result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.train.run_config import RunConfig
from autoseg.train.schedule import poly_lr
from autoseg.train.trainer import train

CONFIG = "3d_fullres"
TINY = dict(epochs=3, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1)
BEFORE = Path(__file__).parents[1] / "fixtures" / "pre_progress_checkpoint"  # its README.md says how it was made


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _old_fold(prepared: Path, tmp_path: Path) -> Workspace:
    """A copy of the prepared workspace with the fixture's plan and its fold 0, stopped after epoch 0."""
    workspace = Workspace.at(shutil.copytree(prepared, tmp_path / "ws"))
    shutil.copy(BEFORE / "plans.json", workspace.plans_path)
    shutil.copytree(BEFORE / "fold_0", workspace.results(CONFIG, 0))
    return workspace


def test_a_fold_stopped_before_the_progress_artifact_resumes_to_the_uninterrupted_result(
    prepared: Path, tmp_path: Path
) -> None:
    """Resumed by this trainer, the old fold continues the old schedule (3 epochs x 2 iterations, the learning rate
    of steps 2..5) and ends with the weights, momentum and losses of the same run that was never interrupted (both
    written by the old trainer on one torch thread, as this test runs)."""
    workspace = _old_fold(prepared, tmp_path)
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)

    expected = read_checkpoint_file(BEFORE / "reference" / "checkpoint_final.pt", "")
    got = read_checkpoint_file(fold / "checkpoint_final.pt", "")
    assert expected["network"].keys() == got["network"].keys()
    for name, tensor in expected["network"].items():
        assert torch.equal(tensor, got["network"][name]), name
    momentum = [s["momentum_buffer"] for s in expected["optimizer"]["state"].values()]
    assert len(momentum) == len(got["optimizer"]["state"]) > 0
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(momentum, got["optimizer"]["state"].values()))

    rows, reference = _rows(fold / "metrics.jsonl"), _rows(BEFORE / "reference" / "metrics.jsonl")
    assert rows[0] == _rows(BEFORE / "fold_0" / "metrics.jsonl")[0]  # the old epoch's row, kept as it was
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in reference]
    assert [r["lr"] for r in rows] == [r["lr"] for r in reference] == [poly_lr(1e-2, s, 6) for s in (1, 3, 5)]
    run = json.loads((fold / "run.json").read_text())
    assert run["schedule"] == {"epochs": 3, "iterations_per_epoch": 2}
    assert len(run["memory_checks"]) == 1  # the resumed process's: the old one stopped before its third step
