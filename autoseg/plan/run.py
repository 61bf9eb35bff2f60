"""`autoseg plan`: integrity check, fingerprint and plan of a dataset, written into the workspace."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from autoseg.core.resources import cpu_count, processes_for
from autoseg.core.units import GiB, MiB
from autoseg.core.workspace import Workspace, WorkspaceInfo
from autoseg.dataset.imageio import read_geometry
from autoseg.dataset.raw import RawDataset, check_integrity, load_dataset
from autoseg.memory.host import preprocess_worker_bytes
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import Fingerprint, fingerprint
from autoseg.plan.planner import plan
from autoseg.plan.plans import Plans

log = logging.getLogger("autoseg")


def plan_dataset(dataset: str | Path | RawDataset, workspace: Workspace, budget: Budget,
                 progress: bool = True) -> Plans:
    """Integrity check, fingerprint and plan of the dataset (its root, or as ``load_dataset`` read it);
    writes workspace.json, fingerprint.json, plans.json."""
    if not isinstance(dataset, RawDataset):
        dataset = load_dataset(dataset)
    t0 = time.perf_counter()
    check_integrity(dataset, read_voxels=False)  # files and headers; the fingerprint checks the voxels
    log.info("dataset %s: %d cases, %d channel(s) %s, labels %s (files and headers checked in %.1f s)", dataset.name,
             len(dataset.cases), dataset.num_channels, list(dataset.channel_names), dataset.labels,
             time.perf_counter() - t0)
    workspace.root.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(dataset, progress=progress, processes=fingerprint_processes(dataset, budget))
    WorkspaceInfo(dataset_root=str(dataset.root)).to_json(workspace.info_path)
    fp.to_json(workspace.fingerprint_path)
    plans = plan(fp, budget)
    plans.to_json(workspace.plans_path)
    for name, cfg in plans.configurations.items():
        log.info("plan %s: spacing %s mm, patch %s, batch %d x %d, features %s, strides %s, predicted peak %.2f GiB",
                 name, tuple(round(s, 3) for s in cfg.spacing_mm), cfg.patch_size, cfg.batch_size,
                 cfg.accumulation_steps, cfg.network.features_per_stage, cfg.network.strides,
                 cfg.memory.get("predicted_peak_bytes", 0) / GiB)
        for note in cfg.notes:
            log.warning("plan %s: %s", name, note)
    return plans


def fingerprint_processes(dataset: RawDataset, budget: Budget) -> int:
    """Processes for the fingerprint: as many as the RAM budget fits (at most the CPUs), each bounded by a
    preprocessing worker's predicted peak on the largest case (the fingerprint does less: no resampling)."""
    largest = max((read_geometry(c.label_path).shape_zyx for c in dataset.cases), key=math.prod)
    peak = preprocess_worker_bytes(largest, largest, dataset.num_channels)["total"]
    n = processes_for(budget.host_ram_bytes, peak, budget.cpu_count or cpu_count())
    log.info("fingerprint: %d process(es) (largest case %s needs at most %.0f MiB, RAM budget %.1f GiB)",
             n, "x".join(map(str, largest)), peak / MiB, budget.host_ram_bytes / GiB)
    return n


def load_fingerprint(workspace: Workspace) -> Fingerprint:
    return Fingerprint.from_json(workspace.require(workspace.fingerprint_path, "plan"))
