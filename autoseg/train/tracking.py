"""Experiment tracking (``autoseg train ... --track tensorboard mlflow``): what metrics.jsonl holds per epoch, the
plan and the memory checks as parameters, and progress.png with run.json at the end, written by rank 0 beside the
fold's own files.

- ``tensorboard``: event files in ``<fold folder>/tensorboard`` (``tensorboard --logdir <workspace>/results``):
  each epoch's figures as scalars (each class's pseudo-Dice as ``pseudo_dice/<class>``), the plan and the memory
  checks as text, progress.png as an image.
- ``mlflow``: a local store in the workspace (``<workspace>/mlflow.db`` and its artifacts in ``<workspace>/mlruns``;
  ``mlflow ui --backend-store-uri sqlite:///<workspace>/mlflow.db`` shows it), experiment ``autoseg <dataset>``, one
  run per configuration and fold (a resumed run continues its MLflow run: its id is kept in the fold folder).
  ``$MLFLOW_TRACKING_URI`` points it at a server instead, the one way this module contacts one.

Offline by default: nothing here opens a network connection (tests/train/test_tracking.py records every connect and
name lookup of a tracked run), and MLflow's telemetry is turned off (``MLFLOW_DISABLE_TELEMETRY``) before it is
imported. Both are extras (``pip install "autoseg[tensorboard]"`` / ``"autoseg[mlflow]"``): asking for one that is
not installed is refused before the run starts (``check_trackers``).

Why not a tracker-agnostic library: each backend's own client is the well-kept code; what is ours is which figures
go where, in one place (``epoch_scalars``, ``plan_parameters``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from autoseg.core.artifacts import atomic_write_text, to_dict
from autoseg.core.errors import InputError
from autoseg.core.extras import require

log = logging.getLogger("autoseg.train.trainer")

# --track NAME -> (the module it imports, the extra installing it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
}
MLFLOW_RUN_ID = "mlflow_run_id.txt"  # in the fold folder: the MLflow run a resumed run continues
_MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value


class Tracker(Protocol):
    def parameters(self, params: dict[str, str], texts: dict[str, str]) -> None: ...
    def epoch(self, step: int, scalars: dict[str, float]) -> None: ...
    def files(self, step: int, paths: Sequence[Path]) -> None: ...
    def close(self, failed: bool) -> None: ...


def check_trackers(names: Sequence[str]) -> None:
    """Refuse, before any work, a tracker that is unknown or whose extra is not installed."""
    for name in names:
        if name not in TRACKERS:
            raise InputError(f"--track {name}: unknown tracker; choose from {', '.join(TRACKERS)}")
        if name == "mlflow":
            _mlflow_telemetry_off()
        require(*TRACKERS[name], f"--track {name}")


def _mlflow_telemetry_off() -> None:
    """MLflow's telemetry off (unless the user set it), before mlflow is first imported."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def epoch_scalars(row: dict[str, Any], class_names: Sequence[str]) -> dict[str, float]:
    """A metrics.jsonl row as named numbers: every numeric field, each class's pseudo-Dice as
    ``pseudo_dice/<class>`` (a class without a name by its index); None and NaN are left out."""
    scalars: dict[str, float] = {}
    for key, value in row.items():
        if key == "pseudo_dice":
            for i, dice in enumerate(value):
                name = class_names[i] if i < len(class_names) else str(i)
                scalars[f"pseudo_dice/{name}"] = float(dice)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "epoch":
            scalars[key] = float(value)
    return {k: v for k, v in scalars.items() if math.isfinite(v)}


def plan_parameters(config: Any, memory_checks: Sequence[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """The configuration's plan as flat parameters (``network.features_per_stage`` -> its JSON), and the plan and the
    memory checks as whole JSON texts."""
    plan = to_dict(config)
    params: dict[str, str] = {}

    def flatten(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            params[prefix] = json.dumps(value)[:_MLFLOW_PARAM_CHARS]

    flatten("", plan)
    texts = {"plan": json.dumps(plan, indent=1), "memory_checks": json.dumps(list(memory_checks), indent=1)}
    return params, texts


class TensorBoardTracker:
    """Event files in ``folder`` (torch's ``SummaryWriter``, which writes through the tensorboard package)."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def parameters(self, params: dict[str, str], texts: dict[str, str]) -> None:
        for name, text in texts.items():
            self.writer.add_text(name, f"```\n{text}\n```", global_step=0)

    def epoch(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def files(self, step: int, paths: Sequence[Path]) -> None:
        import matplotlib.image

        for path in paths:
            if path.suffix == ".png" and path.is_file():
                picture = matplotlib.image.imread(str(path))[..., :3]  # RGBA floats in [0, 1]
                self.writer.add_image(path.stem, picture, global_step=step, dataformats="HWC")
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run in ``uri``'s store (a local sqlite file unless ``$MLFLOW_TRACKING_URI`` says otherwise),
    continued when ``run_id_file`` names one."""

    def __init__(self, uri: str, artifacts: Path, experiment: str, run_name: str, run_id_file: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(experiment, artifact_location=artifacts.as_uri())
        )
        previous = run_id_file.read_text().strip() if run_id_file.is_file() else ""
        if previous and self._exists(previous):
            self.run_id = previous
            self.client.update_run(previous, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            atomic_write_text(run_id_file, self.run_id + "\n")

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def parameters(self, params: dict[str, str], texts: dict[str, str]) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params  # a resumed run logged them already
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=new[start : start + 100])
        for name, text in texts.items():
            self.client.log_text(self.run_id, text, f"{name}.json")

    def epoch(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name.replace("/", "."), value, now, step) for name, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def files(self, step: int, paths: Sequence[Path]) -> None:
        for path in paths:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def open_trackers(names: Sequence[str], workspace_root: Path, out: Path, experiment: str) -> list[Tracker]:
    """The trackers ``names`` asks for, writing about the fold whose folder is ``out``."""
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(out / "tensorboard"))
        elif name == "mlflow":
            _mlflow_telemetry_off()
            uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{workspace_root / 'mlflow.db'}"
            run_name = f"{out.parent.name} {out.name}"
            trackers.append(MlflowTracker(uri, workspace_root / "mlruns", experiment, run_name, out / MLFLOW_RUN_ID))
    return trackers


class Tracking:
    """The run's trackers: the plan at the start, each epoch's row, the memory checks once reported, and the fold's
    pictures and record at the end."""

    def __init__(self, trackers: list[Tracker], class_names: Sequence[str]) -> None:
        self.trackers, self.class_names = trackers, tuple(class_names)
        self._checks_logged = 0

    def start(self, config: Any, memory_checks: Sequence[dict[str, Any]]) -> None:
        params, texts = plan_parameters(config, memory_checks)
        for tracker in self.trackers:
            tracker.parameters(params, texts)
        self._checks_logged = len(memory_checks)

    def epoch(self, row: dict[str, Any], config: Any, memory_checks: Sequence[dict[str, Any]]) -> None:
        if len(memory_checks) > self._checks_logged:  # the first steps' memory check reported in this epoch
            self.start(config, memory_checks)
        scalars = epoch_scalars(row, self.class_names)
        for tracker in self.trackers:
            tracker.epoch(int(row["epoch"]), scalars)

    def finish(self, step: int, paths: Sequence[Path]) -> None:
        for tracker in self.trackers:
            tracker.files(step, paths)


@contextmanager
def tracked(names: Sequence[str], workspace_root: Path, out: Path, experiment: str, classes: Sequence[str]) -> Iterator:
    """``Tracking`` over ``open_trackers`` for the ``with`` block (None when ``names`` is empty); each tracker closed
    at its end, an MLflow run marked failed when the block raised."""
    if not names:
        yield None
        return
    tracking = Tracking(open_trackers(names, workspace_root, out, experiment), classes)
    log.info("tracking with %s (%s)", " and ".join(names), out)
    failed = True
    try:
        yield tracking
        failed = False
    finally:
        for tracker in tracking.trackers:
            tracker.close(failed)
