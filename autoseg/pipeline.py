"""The stages chained over a workspace: what `autoseg plan`, `plan_and_preprocess` and `demo` run."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from autoseg.dataset import check_integrity, load_dataset
from autoseg.fingerprint import Fingerprint, fingerprint
from autoseg.planner import Budget, plan
from autoseg.plans import Plans
from autoseg.preprocess import preprocess
from autoseg.workspace import Workspace, WorkspaceInfo

log = logging.getLogger("autoseg")


def plan_dataset(dataset_root: str | Path, workspace: Workspace, budget: Budget, progress: bool = True) -> Plans:
    """Integrity check, fingerprint and plan; writes workspace.json, fingerprint.json, plans.json."""
    dataset = load_dataset(dataset_root)
    t0 = time.perf_counter()
    check_integrity(dataset)  # raises before anything is written
    log.info("dataset %s: %d cases, %d channel(s) %s, labels %s (integrity checked in %.1f s)", dataset.name,
             len(dataset.cases), dataset.num_channels, list(dataset.channel_names), dataset.labels,
             time.perf_counter() - t0)
    workspace.root.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(dataset, progress=progress)
    WorkspaceInfo(dataset_root=str(dataset.root)).to_json(workspace.info_path)
    fp.to_json(workspace.fingerprint_path)
    plans = plan(fp, budget)
    plans.to_json(workspace.plans_path)
    for name, cfg in plans.configurations.items():
        log.info("plan %s: spacing %s mm, patch %s, batch %d x %d, features %s, strides %s, predicted peak %.2f GiB",
                 name, tuple(round(s, 3) for s in cfg.spacing_mm), cfg.patch_size, cfg.batch_size,
                 cfg.accumulation_steps, cfg.network.features_per_stage, cfg.network.strides,
                 cfg.memory.get("predicted_peak_bytes", 0) / 2**30)
        for note in cfg.notes:
            log.warning("plan %s: %s", name, note)
    return plans


def preprocess_workspace(workspace: Workspace, configs: list[str] | None = None, processes: int | None = None,
                         progress: bool = True) -> None:
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan"))
    dataset = load_dataset(workspace.dataset_root())
    for name in configs or list(plans.configurations):
        n = processes or plans.preprocessing_processes
        out = preprocess(dataset, plans, name, workspace.preprocessed(name), processes=n, progress=progress)
        log.info("preprocessed %s into %s (%d process(es))", name, out, n)


def load_fingerprint(workspace: Workspace) -> Fingerprint:
    return Fingerprint.from_json(workspace.require(workspace.fingerprint_path, "plan"))
