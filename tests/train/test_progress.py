"""The trainer's progress: a fold written before it became one artifact still resumes, to the same result."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from autoseg.core.artifacts import ArtifactError
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.progress import PROGRESS_KEY, EpochPlan, RngStates, Schedule, TrainingProgress
from autoseg.train.run_config import RunConfig
from autoseg.train.run_record import RunRecord
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
    old_run = json.loads((BEFORE / "reference" / "run.json").read_text())
    assert set(run) == set(old_run) | {
        "schema_version",
        "final_validation",
        "init",
    }  # what the old readers read is there
    for key in ("fold", "config", "schedule", "degradations", "time_budget", "effective_configuration", "data"):
        assert run[key] == old_run[key], key
    assert run["distributed"] == old_run["distributed"]
    assert (
        replace(RunRecord.from_json(fold / "run.json").run, resume=False)
        == RunRecord.from_json(BEFORE / "reference" / "run.json").run
    )


def test_the_old_checkpoint_and_run_json_read_as_todays_artifacts() -> None:
    """The separate keys of the old checkpoint read as a ``TrainingProgress``, and its run.json (no schema_version,
    the testing knobs in ``run``) as a ``RunRecord``."""
    progress = load_checkpoint(BEFORE / "fold_0" / "checkpoint_latest.pt").progress
    assert (progress.epoch, progress.schedule, progress.world_size) == (0, Schedule(3, 2, 2), 1)
    assert list(progress.metrics) == _rows(BEFORE / "fold_0" / "metrics.jsonl")
    assert progress.ema == progress.best_ema == progress.metrics[0]["ema_pseudo_dice"]
    assert progress.degradations == progress.budget_decisions == progress.memory_checks == ()
    assert progress.rng is not None and len(progress.rng.numpy_global[1]) == 624

    record = RunRecord.from_json(BEFORE / "reference" / "run.json")
    assert record.run == RunConfig(**TINY)
    assert record.schedule == EpochPlan(3, 2) and record.distributed.global_batch == 2
    assert record.effective_configuration.checkpointing and record.final_validation is None


def test_progress_reads_back_as_written_and_its_random_states_continue_the_draws(tmp_path: Path) -> None:
    progress = TrainingProgress.start(epochs=4, iterations_per_epoch=3, world_size=1)
    progress = progress.with_epoch(0, {"epoch": 0, "pseudo_dice": [float("nan"), 0.5]}, 0.25, steps=3)
    progress = progress.with_degradation({"action": "halve_micro_batch", "epoch": 1, "iteration": 0})
    progress = replace(progress.with_plan((2, 3), ({"epochs": 2},)), rng=RngStates.capture())
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])

    state = {PROGRESS_KEY: progress.to_text()}
    read = TrainingProgress.from_checkpoint(state, tmp_path / "checkpoint_latest.pt")
    assert read.schedule == Schedule(2, 3, 3) and read.best_ema == 0.25 and read.degradations == progress.degradations
    assert read.metrics[0]["pseudo_dice"][1] == 0.5 and math.isnan(read.metrics[0]["pseudo_dice"][0])
    read.rng.restore()
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and [random.random() for _ in range(3)] == expected[2]


def test_a_damaged_progress_or_one_of_another_schema_is_refused_naming_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_latest.pt"
    with pytest.raises(ArtifactError, match=rf"{re.escape(str(path))}: its training progress is not valid JSON"):
        TrainingProgress.from_checkpoint({PROGRESS_KEY: '{"schema_version": 1, "epoch": '}, path)
    future = json.loads(TrainingProgress.start(2, 2, 1).to_text()) | {"schema_version": 99}
    with pytest.raises(ArtifactError, match=rf"{re.escape(str(path))} .*training progress schema_version 99"):
        TrainingProgress.from_checkpoint({PROGRESS_KEY: json.dumps(future)}, path)
    with pytest.raises(ArtifactError, match=rf"{re.escape(str(path))}: its training progress is incomplete"):
        TrainingProgress.from_checkpoint({"epoch": 0, "schedule": {"epochs": 2}}, path)  # the old keys, cut short
