"""The stages chained over a workspace: what `autoseg plan`, `plan_and_preprocess` and `demo` run."""

from __future__ import annotations

import logging
import math
import resource
import time
from pathlib import Path

from autoseg.core.resources import cpu_count
from autoseg.core.workspace import Workspace, WorkspaceInfo
from autoseg.dataset.imageio import read_geometry
from autoseg.dataset.raw import RawDataset, check_integrity, load_dataset
from autoseg.memory.host import preprocess_worker_bytes
from autoseg.plan.fingerprint import Fingerprint, fingerprint
from autoseg.plan.planner import Budget, plan
from autoseg.plan.plans import Plans
from autoseg.preprocess.precompute import PrecomputeConfig
from autoseg.preprocess.preprocessor import case_peak_bytes, preprocess, processes_for

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
                 cfg.memory.get("predicted_peak_bytes", 0) / 2**30)
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
             n, "x".join(map(str, largest)), peak / 2**20, budget.host_ram_bytes / 2**30)
    return n


def preprocess_workspace(workspace: Workspace, configs: list[str] | None = None, processes: int | None = None,
                         progress: bool = True, precompute_augmentations: int = 0) -> None:
    """Preprocess each configuration into ``preprocessed/<config>/``; ``processes=None`` derives the count
    from the plan's RAM budget (``preprocessing_processes_for``). Also writes
    ``preprocessed/<config>_report.json`` (per-case predicted and measured peak memory, seconds, disk)."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan"))
    dataset = load_dataset(workspace.dataset_root())
    precompute = PrecomputeConfig(num_copies=precompute_augmentations)
    for name in configs or list(plans.configurations):
        n = processes or preprocessing_processes_for(workspace, plans, name, precompute_augmentations)
        out_dir = workspace.preprocessed(name)
        preprocess(dataset, plans, name, out_dir, processes=n, progress=progress, precompute=precompute,
                   report_path=out_dir.with_name(f"{name}_report.json"))
        log.info("preprocessed %s into %s (%d process(es))", name, out_dir, n)


def preprocessing_processes_for(workspace: Workspace, plans: Plans, config_name: str,
                                num_augmentations: int = 0) -> int:
    """Processes for preprocessing ``config_name``: as many as fit the plan's RAM budget (less what this
    process holds) given the largest case's predicted peak (``case_peak_bytes`` over the fingerprint's
    shapes, augmented copies included), at most the CPU count, and at most the plan's
    ``preprocessing_processes`` when that is above 1 (it may have been lowered by hand). Logs the numbers."""
    fp = load_fingerprint(workspace)
    config = plans.configuration(config_name)
    peaks = {c.case_id: case_peak_bytes(c.shape_zyx, c.spacing_mm, config, len(fp.channel_names),
                                        plans.num_label_values, num_augmentations) for c in fp.cases}
    largest = max(peaks, key=lambda c: peaks[c])
    cpus = cpu_count()
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process's peak so far (KiB)
    n = processes_for(plans.host_ram_bytes - held, peaks[largest], cpus)
    log.info("preprocess %s: %d process(es) fit: min(%d CPUs, (RAM budget %.1f GiB - %.2f GiB held here) "
             "// largest case's predicted peak %.0f MiB (%s))", config_name, n, cpus,
             plans.host_ram_bytes / 2**30, held / 2**30, peaks[largest] / 2**20, largest)
    if plans.preprocessing_processes > 1 and plans.preprocessing_processes < n:
        n = plans.preprocessing_processes
        log.info("preprocess %s: %d process(es), as plans.json says", config_name, n)
    if peaks[largest] > plans.host_ram_bytes:
        log.warning("preprocess %s: case %s is predicted to need %.1f GiB, more than the RAM budget of "
                    "%.1f GiB", config_name, largest, peaks[largest] / 2**30, plans.host_ram_bytes / 2**30)
    return n


def load_fingerprint(workspace: Workspace) -> Fingerprint:
    return Fingerprint.from_json(workspace.require(workspace.fingerprint_path, "plan"))
