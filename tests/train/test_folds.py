"""Several folds in one command: trained in turn, and an interrupted command resumed as a whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_faults import killed_after_epochs

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.train import folds as folds_module
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.folds import fold_finished, train_folds
from autoseg.train.run_config import RunConfig

CONFIG = "3d_fullres"
TINY = dict(epochs=2, iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1)


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:
    shutil.copytree(prepared, tmp_path / "ws")
    return Workspace.at(tmp_path / "ws")


def test_folds_are_trained_in_turn_and_a_resumed_command_goes_on_where_it_stopped(workspace: Workspace) -> None:
    """Fold 0 finished, fold 1 stopped after its first epoch, fold 2 not begun: ``--resume`` skips fold 0, resumes
    fold 1 from its latest checkpoint and starts fold 2; every fold ends with its final checkpoint."""
    train_folds(workspace, CONFIG, [0], RunConfig(**TINY), progress=False)
    with killed_after_epochs(1):
        train_folds(workspace, CONFIG, [1], RunConfig(**TINY), progress=False)
    assert fold_finished(workspace, CONFIG, 0, validate=False) and not fold_finished(workspace, CONFIG, 1, False)
    finished_0 = (workspace.results(CONFIG, 0) / "checkpoint_final.pt").stat().st_mtime_ns
    assert load_checkpoint(workspace.checkpoint(CONFIG, 1, "latest")).progress.epoch == 0

    calls: list[tuple[int | str, bool]] = []
    real_train = folds_module.train

    def recording_train(ws, config, fold, run, **kwargs):
        calls.append((fold, run.resume))
        return real_train(ws, config, fold, run, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(folds_module, "train", recording_train)
        outs = train_folds(workspace, CONFIG, [0, 1, 2], RunConfig(**TINY, resume=True), progress=False)
    assert calls == [(1, True), (2, False)]
    assert outs == [workspace.results(CONFIG, f) for f in (0, 1, 2)]
    assert all(fold_finished(workspace, CONFIG, f, validate=False) for f in (0, 1, 2))
    assert (workspace.results(CONFIG, 0) / "checkpoint_final.pt").stat().st_mtime_ns == finished_0  # not retrained
    assert load_checkpoint(workspace.checkpoint(CONFIG, 1, "final")).progress.epoch == 1


def test_a_validating_run_counts_a_fold_finished_only_with_its_validation_summary(workspace: Workspace) -> None:
    out = workspace.results(CONFIG, 3)
    out.mkdir(parents=True)
    (out / "run.json").write_text("{}")
    assert fold_finished(workspace, CONFIG, 3, validate=False)
    assert not fold_finished(workspace, CONFIG, 3, validate=True)  # killed during the final validation
    (out / "validation").mkdir()
    (out / "validation" / "summary.json").write_text("{}")
    assert fold_finished(workspace, CONFIG, 3, validate=True)


def test_resume_with_nothing_to_resume_is_refused_naming_the_checkpoint(workspace: Workspace) -> None:
    """``train fold 0 1 --resume`` in a workspace where neither fold began: an error naming fold 0's missing
    checkpoint and fold 1, and nothing trained or written (not a fresh run that exits 0)."""
    results = workspace.root / "results"
    before = sorted(results.rglob("*")) if results.exists() else []
    with pytest.raises(InputError) as info:
        train_folds(workspace, CONFIG, [0, 1], RunConfig(**TINY, resume=True), progress=False)
    message = str(info.value)
    assert str(workspace.checkpoint(CONFIG, 0, "latest")) in message and "fold(s) 1" in message
    assert "without --resume" in message
    assert (sorted(results.rglob("*")) if results.exists() else []) == before
