"""`autoseg plan`: integrity check, fingerprint and plan of a dataset, written into the workspace.

A workspace belongs to one dataset (``WorkspaceInfo.dataset``: its content, not its path). ``make_plan``
checks the dataset given against it (``check_dataset``) and plans, writing nothing; ``write_plan`` then
writes fingerprint.json, plans.json and, last, workspace.json. So a refusal or a failed plan (a budget too
small for any network) leaves the workspace as it was, and a run killed while writing is refused or
redone by the next (workspace.json still names the dataset of the files before).

plans.json is the workspace's plan: once written it is kept unless ``overwrite`` (or the dataset changed,
which needs ``overwrite``); a plans.json edited by hand (``WorkspaceInfo.plans_hash`` differs) is always
kept: delete it to plan anew.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.artifacts import to_dict
from autoseg.core.errors import InputError
from autoseg.core.resources import cpu_count, processes_for
from autoseg.core.units import GiB, MiB
from autoseg.core.workspace import DatasetSource, Workspace, WorkspaceInfo, dataset_source
from autoseg.dataset.imageio import read_geometry
from autoseg.dataset.raw import RawDataset, check_integrity, load_dataset
from autoseg.memory.host import preprocess_worker_bytes
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import Fingerprint, fingerprint
from autoseg.plan.like import PlanTemplate
from autoseg.plan.planner import plan
from autoseg.plan.plans import PROVENANCE_KEYS, Plans

log = logging.getLogger("autoseg")
SHOWN_CHANGES = 8  # lines of a change list in a message; the rest are counted


@dataclass(frozen=True)
class PlannedWorkspace:
    """What ``make_plan`` decided, before anything is written."""

    dataset: RawDataset
    source: DatasetSource
    fingerprint: Fingerprint
    plans: Plans  # the plan to use: the fresh one, or plans.json as it is
    previous_plans: Plans | None  # plans.json before this run (None: there was none)
    write_plans: bool  # False: plans.json is kept as it is
    dataset_changes: tuple[str, ...]  # what changed since the workspace was made (only with overwrite)
    plans_hash: str  # WorkspaceInfo.plans_hash to record ("" until written)


def plan_dataset(
    dataset: str | Path | RawDataset,
    workspace: Workspace,
    budget: Budget,
    progress: bool = True,
    overwrite: bool = False,
    like: PlanTemplate | None = None,
) -> Plans:
    """``make_plan`` then ``write_plan``; returns the plan in use."""
    planned = make_plan(dataset, workspace, budget, progress, overwrite, like)
    write_plan(workspace, planned)
    return planned.plans


def make_plan(
    dataset: str | Path | RawDataset,
    workspace: Workspace,
    budget: Budget,
    progress: bool = True,
    overwrite: bool = False,
    like: PlanTemplate | None = None,
) -> PlannedWorkspace:
    """Integrity check, ``check_dataset``, fingerprint and plan of the dataset (its root, or as
    ``load_dataset`` read it; ``like``: with a trained model's network, ``autoseg.plan.like``). Writes nothing;
    raises ``InputError`` for a dataset the workspace was not made from (unless ``overwrite``) or a budget too small
    for any network."""
    if not isinstance(dataset, RawDataset):
        dataset = load_dataset(dataset)
    t0 = time.perf_counter()
    check_integrity(dataset, read_voxels=False)  # files and headers; the fingerprint checks the voxels
    source = dataset_source(dataset.root)
    log.info(
        "dataset %s: %d cases, %d channel(s) %s, labels %s (files and headers checked in %.1f s)",
        dataset.name,
        len(dataset.cases),
        dataset.num_channels,
        list(dataset.channel_names),
        dataset.labels,
        time.perf_counter() - t0,
    )
    changes = check_dataset(workspace, dataset.root, source, overwrite)
    fp = reused_fingerprint(workspace, source) or fingerprint(
        dataset, progress=progress, processes=fingerprint_processes(dataset, budget)
    )
    fresh = plan(fp, budget, like=like)
    previous = _previous_plans(workspace, overwrite)
    info = workspace.info() if workspace.info_path.is_file() else None
    edited = previous is not None and info is not None and info.plans_hash not in ("", file_hash(workspace.plans_path))
    if previous is None or (not edited and (overwrite or not plan_differences(previous, fresh))):
        # the same plan keeps its record of where its figures came from (the first measurement, not the cache's copy);
        # --overwrite writes what a fresh workspace would hold
        same = previous is not None and not overwrite and not plan_differences(previous, fresh)
        return PlannedWorkspace(dataset, source, fp, previous if same else fresh, previous, True, tuple(changes), "")
    differences = plan_differences(previous, fresh)
    if edited:
        log.warning(
            "%s was edited by hand after planning: it is kept as it is%s (delete it to plan anew)",
            workspace.plans_path,
            "; it was planned for the dataset before its changes" if changes else "",
        )
    else:
        log.warning(
            "%s kept: the preprocessed data and trained folds were made with it; this run would plan "
            "differently (%s); rerun with --overwrite to use the new plan",
            workspace.plans_path,
            "; ".join(differences[:SHOWN_CHANGES]),
        )
    return PlannedWorkspace(
        dataset, source, fp, previous, previous, False, tuple(changes), info.plans_hash if info else ""
    )


def reused_fingerprint(workspace: Workspace, source: DatasetSource) -> Fingerprint | None:
    """The workspace's fingerprint.json when the dataset is the one it was made from, unchanged (``source``
    equal to workspace.json's: dataset.json, and every training file's name, size and first and last 64 KiB):
    re-planning for another budget, device or architecture then reads no image. None otherwise, or when the
    file cannot be read (it is then computed again and rewritten)."""
    if not (workspace.info_path.is_file() and workspace.fingerprint_path.is_file()):
        return None
    try:
        if workspace.info().dataset != source:
            return None
        fp = Fingerprint.from_json(workspace.fingerprint_path)
    except InputError as e:
        log.warning("%s: not reused (%s); fingerprinting the dataset again", workspace.fingerprint_path, e)
        return None
    log.info("fingerprint: %s reused (the dataset is unchanged since it was made)", workspace.fingerprint_path)
    return fp


def _previous_plans(workspace: Workspace, overwrite: bool) -> Plans | None:
    """plans.json as it is; None when there is none, or when it cannot be read and ``overwrite`` replaces it."""
    if not workspace.plans_path.is_file():
        return None
    try:
        return Plans.from_json(workspace.plans_path)
    except InputError:
        if not overwrite:
            raise
        log.warning("%s cannot be read; --overwrite replaces it with a new plan", workspace.plans_path)
        return None


def write_plan(workspace: Workspace, planned: PlannedWorkspace) -> None:
    """fingerprint.json, plans.json (unless kept), then workspace.json (last: it names the dataset the
    other files were made from)."""
    workspace.root.mkdir(parents=True, exist_ok=True)
    planned.fingerprint.to_json(workspace.fingerprint_path)
    plans_hash = planned.plans_hash
    if planned.write_plans:
        planned.plans.to_json(workspace.plans_path)
        plans_hash = file_hash(workspace.plans_path)
    WorkspaceInfo(dataset_root=str(planned.dataset.root), dataset=planned.source, plans_hash=plans_hash).to_json(
        workspace.info_path
    )
    for name, cfg in planned.plans.configurations.items():
        log.info(
            "plan %s: spacing %s mm, patch %s (inference tile %s), batch %d x %d, features %s, strides %s, "
            "predicted peak %.2f GiB",
            name,
            tuple(round(s, 3) for s in cfg.spacing_mm),
            cfg.patch_size,
            cfg.inference_tile(),
            cfg.batch_size,
            cfg.accumulation_steps,
            cfg.network.features_per_stage,
            cfg.network.strides,
            cfg.memory.get("predicted_peak_bytes", 0) / GiB,
        )
        for note in cfg.notes:
            log.warning("plan %s: %s", name, note)


def check_dataset(workspace: Workspace, root: Path, source: DatasetSource, overwrite: bool = False) -> list[str]:
    """What changed in the dataset at ``root`` (``source``) since ``workspace`` was made from it; empty when
    nothing did (a copy elsewhere counts as the same dataset) or the workspace is new. Raises
    ``InputError`` when something did, unless ``overwrite``.

    A workspace.json of schema 1 (no fingerprint): the dataset at the same folder is taken as the one it
    was made from (its fingerprint is recorded from now on); one at another folder is refused as a
    different dataset, and with ``overwrite`` everything made from the old one counts as changed."""
    if not workspace.info_path.is_file():
        return []
    info = workspace.info()
    made_from, root = Path(info.dataset_root), Path(root).resolve()
    if info.dataset is None:
        if made_from == root:
            log.warning(
                "%s: made by an older autoseg without a fingerprint of its dataset; taking %s as the "
                "dataset it was made from",
                workspace.info_path,
                root,
            )
            return []
        changes = [f"{made_from}: the workspace's dataset, whose files were not recorded (an older autoseg)"]
    else:
        changes = source.changes_since(info.dataset)
        if not changes and made_from != root:
            log.info("dataset %s has the same files as %s, which %s was made from", root, made_from, workspace.root)
    if changes and not overwrite:
        raise InputError(_changed_message(workspace, made_from, root, changes))
    if changes:
        log.warning(
            "--overwrite: redoing what %s made from the dataset before it changed: %s", workspace.root, _listed(changes)
        )
    return changes


def _changed_message(workspace: Workspace, made_from: Path, root: Path, changes: list[str]) -> str:
    redo = (
        f"`autoseg plan_and_preprocess {root} -w {workspace.root} --overwrite` redoes what is stale (trained "
        "folds of a changed plan or dataset are moved aside, not deleted)"
    )
    if made_from != root:
        return (
            f"workspace {workspace.root} was made from dataset {made_from}, and {root} is a different one "
            f"({len(changes)} difference(s): {_listed(changes[:3]) + ('; ...' if len(changes) > 3 else '')}). "
            f"Give this dataset its own workspace (-w), or: {redo}"
        )
    return (
        f"dataset {root} changed since workspace {workspace.root} was made from it: {_listed(changes)}. "
        f"Restore it, or: {redo}"
    )


def _listed(lines: list[str]) -> str:
    more = len(lines) - SHOWN_CHANGES
    return "; ".join(lines[:SHOWN_CHANGES]) + (f"; and {more} more" if more > 0 else "")


def plan_differences(before: Plans, after: Plans) -> list[str]:
    """ "field: before -> after" for each field of the plans (each configuration's, by name) that differs; where a
    figure came from (``PROVENANCE_KEYS``) is no difference: a re-plan that reads the rates a first plan measured
    plans the same."""
    old, new = to_dict(before), to_dict(after)
    lines = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(old.keys() | new.keys())
        if k not in ("configurations", *PROVENANCE_KEYS) and old.get(k) != new.get(k)
    ]
    configs_old, configs_new = old.get("configurations", {}), new.get("configurations", {})
    for name in sorted(configs_old.keys() | configs_new.keys()):
        a, b = configs_old.get(name), configs_new.get(name)
        if a is None or b is None:
            lines.append(f"configuration {name}: {'added' if a is None else 'removed'}")
            continue
        lines += [
            f"{name}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)
        ]
    return lines


def file_hash(path: Path) -> str:
    """blake2b-128 of a file's bytes (plans.json: whether it was edited since it was written)."""
    return hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()


# A dataset of fewer voxels (cases x channels) is fingerprinted in this process: it reads them in less time than
# spawned workers take to start (each imports numpy, SimpleITK and scipy before reading a case). Measured:
# docs/benchmarks.md, "Planning time".
IN_PROCESS_FINGERPRINT_VOXELS = 30_000_000


def fingerprint_processes(dataset: RawDataset, budget: Budget) -> int:
    """Processes for the fingerprint: 1 (this process) for a dataset of fewer than ``IN_PROCESS_FINGERPRINT_VOXELS``
    voxels, else as many as the RAM budget fits (at most the CPUs), each bounded by a preprocessing worker's predicted
    peak on the largest case (the fingerprint does less: no resampling)."""
    shapes = [read_geometry(c.label_path).shape_zyx for c in dataset.cases]
    largest = max(shapes, key=math.prod)
    voxels = sum(math.prod(s) for s in shapes) * dataset.num_channels
    if voxels < IN_PROCESS_FINGERPRINT_VOXELS:
        log.info(
            "fingerprint: in this process (%.1f M voxels: read in less time than worker processes take to start)",
            voxels / 1e6,
        )
        return 1
    peak = preprocess_worker_bytes(largest, largest, dataset.num_channels)["total"]
    n = processes_for(budget.host_ram_bytes, peak, budget.cpu_count or cpu_count())
    log.info(
        "fingerprint: %d process(es) (largest case %s needs at most %.0f MiB, RAM budget %.1f GiB)",
        n,
        "x".join(map(str, largest)),
        peak / MiB,
        budget.host_ram_bytes / GiB,
    )
    return n


def load_fingerprint(workspace: Workspace) -> Fingerprint:
    return Fingerprint.from_json(workspace.require(workspace.fingerprint_path, "plan"))
