"""``autoseg train --track tensorboard mlflow`` (autoseg.train.tracking): what metrics.jsonl holds per epoch, the plan
and the memory checks, progress.png and run.json reach TensorBoard's event files and a local MLflow store, read back
here; a resumed run continues its MLflow run; no network connection is opened; a missing extra is refused before any
work."""

from __future__ import annotations

import json
import shutil
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from extras import require_extra
from train_faults import killed_after_epochs

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.plan.plans import Plans
from autoseg.train.run_config import RunConfig
from autoseg.train.tracking import MLFLOW_RUN_ID, check_trackers, epoch_scalars
from autoseg.train.trainer import train

require_extra("tensorboard")
require_extra("mlflow")

TINY = dict(iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1, loader_workers=0)


class _NoNetwork:
    """Records every connection and name lookup the process makes (and lets none through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: list[object] = []

        def refuse(*args, **kwargs):
            self.attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
            raise OSError("no network in this test")

        monkeypatch.setattr(socket.socket, "connect", refuse)
        monkeypatch.setattr(socket.socket, "connect_ex", refuse)
        monkeypatch.setattr(socket, "getaddrinfo", refuse)
        monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:
    return Workspace.at(Path(shutil.copytree(prepared, tmp_path / "ws")))


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}, events


@pytest.mark.slow  # two tiny trainings and MLflow's first store (its tables: 5-25 s)
def test_a_tracked_run_logs_every_epoch_the_plan_and_its_pictures_offline(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed after 2 of 3 epochs (its MLflow run marked failed), then resumed: every epoch once in both
    trackers, in the same MLflow run; the plan, the memory checks, progress.png and run.json; no connection."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    network = _NoNetwork(monkeypatch)
    run = RunConfig(epochs=3, track=("tensorboard", "mlflow"), **TINY)
    with killed_after_epochs(2):
        train(workspace, "3d_fullres", 0, run, False)
    out = workspace.results("3d_fullres", 0)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workspace.root / 'mlflow.db'}")
    run_id = (out / MLFLOW_RUN_ID).read_text().strip()
    assert client.get_run(run_id).info.status == "FAILED"
    train(workspace, "3d_fullres", 0, replace(run, resume=True), False)
    assert network.attempts == []

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    names = Plans.from_json(workspace.plans_path).label_scheme.names
    scalars, events = _scalars(out / "tensorboard")
    assert scalars["train_loss"] == [(r["epoch"], pytest.approx(r["train_loss"])) for r in rows]
    assert scalars[f"pseudo_dice/{names[0]}"] == [(r["epoch"], pytest.approx(r["pseudo_dice"][0])) for r in rows]
    assert {"plan/text_summary", "memory_checks/text_summary"} <= set(events.Tags()["tensors"])
    assert events.Tags()["images"] == ["progress"]

    tracked = client.get_run(run_id)
    assert tracked.info.status == "FINISHED" and tracked.info.run_name == "3d_fullres fold_0"
    history = client.get_metric_history(run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r["val_loss"])) for r in rows]
    assert json.loads(tracked.data.params["patch_size"]) == [8, 16, 16]
    assert {"progress.png", "run.json", "plan.json", "memory_checks.json"} <= {
        a.path for a in client.list_artifacts(run_id)
    }


def test_a_tracker_without_its_extra_is_refused_before_any_work(workspace: Workspace, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
    with pytest.raises(InputError, match=r"autoseg\[mlflow\]"):
        train(workspace, "3d_fullres", 0, RunConfig(epochs=1, track=("mlflow",), **TINY), False)
    assert not workspace.results("3d_fullres", 0).exists()


def test_an_unknown_tracker_is_refused_naming_the_flag_and_the_choices() -> None:
    with pytest.raises(InputError, match=r"--track wandb: unknown tracker; choose from tensorboard, mlflow"):
        check_trackers(["wandb"])


def test_epoch_scalars_name_each_class_and_leave_out_what_is_not_a_number() -> None:
    row = {"epoch": 3, "train_loss": 0.5, "pseudo_dice": [0.25, 0.75], "lr": 1e-3, "planned_run_seconds": None}
    row |= {"ema_pseudo_dice": float("nan"), "degraded": False}
    assert epoch_scalars(row, ("liver", "tumour")) == {
        "train_loss": 0.5,
        "pseudo_dice/liver": 0.25,
        "pseudo_dice/tumour": 0.75,
        "lr": 1e-3,
    }
