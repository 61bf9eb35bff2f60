"""`autoseg plan_and_preprocess`, its second half: each planned configuration preprocessed into the workspace,
in as many processes as the plan's RAM budget holds; and what keeps preprocessed data tied to its sources.

A configuration that trains on another's data (``preprocessed_as``: 3d_cascade_fullres on 3d_fullres's) has no
folder of its own and is never preprocessed; naming it preprocesses the configuration it reads.

Preprocessed cases are never mixed with stale ones: ``preprocessed/<config>_source.json`` records the plan
fields (``preprocessing_fields``) and the raw files (per case, a digest) the folder's cases are made from.
A case made from other files, a case no longer in the dataset, or a folder made with other plan fields is
stale (``stale_preprocessed``): refused, or deleted and redone with ``overwrite``. Training checks the
same (``check_preprocessed``) before it starts.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.lock import hold, this_process
from autoseg.core.resources import cpu_count, processes_for
from autoseg.core.units import GiB, KiB, MiB
from autoseg.core.workspace import DatasetSource, Workspace, dataset_source
from autoseg.dataset.raw import RawDataset, load_dataset
from autoseg.plan.budget import Budget
from autoseg.plan.like import PlanTemplate
from autoseg.plan.plans import Plans
from autoseg.plan.run import check_dataset, load_fingerprint, make_plan, write_plan
from autoseg.preprocess.parallel import PreprocessOptions, case_peak_bytes, preprocess
from autoseg.preprocess.plan_fields import field_changes, preprocessing_fields
from autoseg.preprocess.precompute import PrecomputeConfig
from autoseg.preprocess.stale_results import set_aside_results, stale_results
from autoseg.preprocess.store import PreprocessedSource, delete_case, read_source, source_path, stored_case_ids

log = logging.getLogger("autoseg")
SHOWN_REASONS = 8


@dataclass(frozen=True)
class PreprocessRequest:
    """What `autoseg plan_and_preprocess` preprocesses once the plan is written (``preprocess_workspace``'s
    arguments): ``configs`` (None: every planned configuration), in ``processes`` processes (None: as many as
    the plan's RAM budget holds), with ``precompute_augmentations`` augmented copies per case."""

    configs: tuple[str, ...] | None = None
    processes: int | None = None
    precompute_augmentations: int = 0


EVERY_CONFIGURATION = PreprocessRequest()
PLAN_PART = "the plan and preprocessed data"  # what the plan lock's record says its holder writes


def plan_and_preprocess(
    dataset: str | Path | RawDataset,
    workspace: Workspace,
    budget: Budget,
    *,
    preprocessing: PreprocessRequest | None = EVERY_CONFIGURATION,
    progress: bool = True,
    overwrite: bool = False,
    command: str = "",
    like: PlanTemplate | None = None,
) -> Plans:
    """`autoseg plan` (``preprocessing`` None) and `autoseg plan_and_preprocess` (``like``: with a trained model's
    network, ``autoseg.plan.like``): plan, then refuse (or with
    ``overwrite`` delete) stale preprocessed cases and set aside trained folds of a changed plan or dataset, all
    before anything is written; then write the plan and preprocess what ``preprocessing`` asks for. Holds the
    workspace's plan lock throughout (``command``: what the lock names, "" this process's command line): another
    writer of the plan is refused, and so is a fold that must be set aside while it is being trained."""
    with hold(workspace.plan_lock, this_process(PLAN_PART, command, replacing=overwrite)):
        planned = make_plan(dataset, workspace, budget, progress, overwrite, like)
        stale = stale_preprocessed(
            workspace, planned.plans, planned.dataset, planned.source, unknown_is_stale=bool(planned.dataset_changes)
        )
        if stale and not overwrite:
            raise InputError(_stale_message(workspace, planned.dataset.root, stale))
        if overwrite:
            set_aside_results(workspace, planned, stale_results(planned, {s.config for s in stale}), command)
            _delete_stale(stale)
        write_plan(workspace, planned)
        if preprocessing is not None:
            preprocess_workspace(
                workspace,
                None if preprocessing.configs is None else list(preprocessing.configs),
                preprocessing.processes,
                progress=progress,
                precompute_augmentations=preprocessing.precompute_augmentations,
                overwrite=overwrite,
            )
        return planned.plans


def preprocess_workspace(
    workspace: Workspace,
    configs: list[str] | None = None,
    processes: int | None = None,
    progress: bool = True,
    precompute_augmentations: int = 0,
    overwrite: bool = False,
) -> None:
    """Preprocess each configuration into ``preprocessed/<config>/``; ``processes=None`` derives the count
    from the plan's RAM budget (``preprocessing_processes_for``). Also writes
    ``preprocessed/<config>_report.json`` (per-case predicted and measured peak memory, seconds, disk) and,
    before the cases, ``<config>_source.json``. Stale cases (``stale_preprocessed``) are refused, or deleted
    and redone with ``overwrite``."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan"))
    dataset = load_dataset(workspace.dataset_root())
    source = dataset_source(dataset.root)
    check_dataset(workspace, dataset.root, source)  # a dataset changed since planning is refused
    names = preprocessed_configurations(plans, configs)
    stale = stale_preprocessed(workspace, plans, dataset, source, names)
    if stale and not overwrite:
        raise InputError(_stale_message(workspace, dataset.root, stale))
    _delete_stale(stale)
    digests = case_digests(dataset, source)
    precompute = PrecomputeConfig(num_copies=precompute_augmentations)
    cropped = {c.case_id: c.cropped_shape_zyx for c in load_fingerprint(workspace).cases}
    for name in names:
        n = processes or preprocessing_processes_for(workspace, plans, name, precompute_augmentations)
        out_dir = workspace.preprocessed(name)
        # before the cases: every case in the folder is made from what it says (stale ones were deleted)
        PreprocessedSource(preprocessing_fields(plans, name), digests).to_json(source_path(out_dir))
        report_path = out_dir.with_name(f"{name}_report.json")
        options = PreprocessOptions(
            processes=n, progress=progress, precompute=precompute, report_path=report_path, cropped=cropped
        )
        preprocess(dataset, plans, name, out_dir, options)
        log.info("preprocessed %s into %s (%d process(es))", name, out_dir, n)


def preprocessed_configurations(plans: Plans, configs: list[str] | None = None) -> list[str]:
    """The configurations with a ``preprocessed/<config>/`` folder among ``configs`` (default: every planned one): each
    one's ``data_configuration`` (a cascade stage's is the configuration it reads), each once, in plan order."""
    wanted = {plans.configuration(c).data_configuration for c in (configs or list(plans.configurations))}
    return [c for c in plans.configurations if c in wanted]


def case_digests(dataset: RawDataset, source: DatasetSource) -> dict[str, str]:
    """Case id -> the digest of its image and label files in ``source`` (``DatasetSource.digest_of``)."""

    def name(path: Path) -> str:
        return path.relative_to(dataset.root).as_posix()

    return {
        c.case_id: source.digest_of([name(p) for p in (*c.image_paths, c.label_path) if p is not None])
        for c in dataset.cases
    }


@dataclass(frozen=True)
class StalePreprocessed:
    """Cases of one configuration's folder that are not made from the dataset and plan as they are now."""

    config: str
    folder: Path
    reasons: tuple[str, ...]  # one line each
    cases: tuple[str, ...]  # to delete (every case of the folder when the plan changed)


def stale_preprocessed(
    workspace: Workspace,
    plans: Plans,
    dataset: RawDataset,
    source: DatasetSource,
    configs: list[str] | None = None,
    unknown_is_stale: bool = False,
) -> list[StalePreprocessed]:
    """The stale cases of each configuration (default: every planned one) with a folder. A folder without
    ``<config>_source.json`` (an older autoseg) is taken as current unless ``unknown_is_stale`` (the dataset
    changed since the workspace was made)."""
    digests = case_digests(dataset, source)
    stale = []
    for name in preprocessed_configurations(plans, configs):
        folder = workspace.preprocessed(name)
        stored = stored_case_ids(folder) if folder.is_dir() else []
        record = read_source(folder) if stored else None
        if not stored or (record is None and not unknown_is_stale):
            continue
        if record is None:
            reasons = ["made by an older autoseg, which did not record the files it was made from"]
        else:
            reasons = [
                f"made with another plan: {c}"
                for c in field_changes(record.plan_fields, preprocessing_fields(plans, name))
            ]
        if reasons:
            stale.append(StalePreprocessed(name, folder, tuple(reasons), tuple(stored)))
            continue
        gone = [c for c in stored if c not in digests]
        redo = [c for c in stored if c in digests and record.cases.get(c) != digests[c]]
        reasons = [f"case {c}: no longer in the dataset" for c in gone] + [
            f"case {c}: made from other files" for c in redo
        ]
        if reasons:
            stale.append(StalePreprocessed(name, folder, tuple(reasons), tuple(gone + redo)))
    return stale


def check_preprocessed(workspace: Workspace, plans: Plans, config_name: str, needs_dataset: bool = False) -> None:
    """Before training on ``preprocessed/<config_name>/``: refuse when the dataset changed since the workspace
    was made from it, or the folder was preprocessed with other plan fields than plans.json's. A dataset
    folder that is gone is no error (training reads the preprocessed data only) unless ``needs_dataset``
    (the final validation predicts the raw images). A cascade stage's folder is the one it trains on."""
    config_name = plans.configuration(config_name).data_configuration
    folder = workspace.preprocessed(config_name)
    root = workspace.dataset_root()
    if (root / "dataset.json").is_file():
        check_dataset(workspace, root, dataset_source(root))
    elif needs_dataset:
        raise InputError(
            f"dataset {root}, which {workspace.root} was made from, is gone; the final validation "
            "predicts its images: restore it there, or train with --no-validation"
        )
    else:
        log.info("dataset %s not found; training from the preprocessed data in %s", root, folder)
    record = read_source(folder)
    if record is None:
        log.info("%s: no record of the plan it was preprocessed with (an older autoseg); taken as plans.json's", folder)
        return
    changes = field_changes(record.plan_fields, preprocessing_fields(plans, config_name))
    if changes:
        raise InputError(
            f"{folder} was preprocessed with another plan than {workspace.plans_path} says "
            f"({'; '.join(changes[:SHOWN_REASONS])}); run `autoseg plan_and_preprocess {root} -w "
            f"{workspace.root} --overwrite` to preprocess it again with the plan as it is"
        )


def _stale_message(workspace: Workspace, root: Path, stale: list[StalePreprocessed]) -> str:
    lines = [f"{s.folder.name}: {r}" for s in stale for r in s.reasons]
    more = len(lines) - SHOWN_REASONS
    return (
        f"preprocessed data in {workspace.root / 'preprocessed'} no longer matches the dataset and plan: "
        f"{'; '.join(lines[:SHOWN_REASONS])}{f'; and {more} more' if more > 0 else ''}. Run `autoseg "
        f"plan_and_preprocess {root} -w {workspace.root} --overwrite` to redo the stale cases"
    )


def _delete_stale(stale: list[StalePreprocessed]) -> None:
    for s in stale:
        log.warning(
            "--overwrite: deleting %d stale preprocessed case(s) of %s to redo them (%s)",
            len(s.cases),
            s.folder,
            "; ".join(s.reasons[:SHOWN_REASONS]),
        )
        for case_id in s.cases:
            delete_case(s.folder, case_id)


def preprocessing_processes_for(
    workspace: Workspace, plans: Plans, config_name: str, num_augmentations: int = 0
) -> int:
    """Processes for preprocessing ``config_name``: as many as fit the plan's RAM budget (less what this
    process holds) given the largest case's predicted peak (``case_peak_bytes`` over the fingerprint's
    shapes and crops, augmented copies included), at most the CPU count, and at most the plan's
    ``preprocessing_processes`` when that is above 1 (it may have been lowered by hand). Logs the numbers."""
    fp = load_fingerprint(workspace)
    config = plans.configuration(config_name)
    peaks = {
        c.case_id: case_peak_bytes(
            c.shape_zyx,
            c.spacing_mm,
            config,
            len(fp.channel_names),
            plans.num_label_values,
            num_augmentations,
            cropped_zyx=c.cropped_shape_zyx,
        )
        for c in fp.cases
    }
    largest = max(peaks, key=lambda c: peaks[c])
    cpus = cpu_count()
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB  # this process's peak so far (ru_maxrss is in KiB)
    n = processes_for(plans.host_ram_bytes - held, peaks[largest], cpus)
    log.info(
        "preprocess %s: %d process(es) fit: min(%d CPUs, (RAM budget %.1f GiB - %.2f GiB held here) "
        "// largest case's predicted peak %.0f MiB (%s))",
        config_name,
        n,
        cpus,
        plans.host_ram_bytes / GiB,
        held / GiB,
        peaks[largest] / MiB,
        largest,
    )
    if plans.preprocessing_processes > 1 and plans.preprocessing_processes < n:
        n = plans.preprocessing_processes
        log.info("preprocess %s: %d process(es), as plans.json says", config_name, n)
    if peaks[largest] > plans.host_ram_bytes:
        log.warning(
            "preprocess %s: case %s is predicted to need %.1f GiB, more than the RAM budget of %.1f GiB",
            config_name,
            largest,
            peaks[largest] / GiB,
            plans.host_ram_bytes / GiB,
        )
    return n
