"""`autoseg plan_and_preprocess`, its second half: each planned configuration preprocessed into the workspace,
in as many processes as the plan's RAM budget holds."""

from __future__ import annotations

import logging
import resource

from autoseg.core.resources import cpu_count, processes_for
from autoseg.core.units import GiB, KiB, MiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.raw import load_dataset
from autoseg.plan.plans import Plans
from autoseg.plan.run import load_fingerprint
from autoseg.preprocess.precompute import PrecomputeConfig
from autoseg.preprocess.preprocessor import case_peak_bytes, preprocess

log = logging.getLogger("autoseg")


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
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB  # this process's peak so far (ru_maxrss is in KiB)
    n = processes_for(plans.host_ram_bytes - held, peaks[largest], cpus)
    log.info("preprocess %s: %d process(es) fit: min(%d CPUs, (RAM budget %.1f GiB - %.2f GiB held here) "
             "// largest case's predicted peak %.0f MiB (%s))", config_name, n, cpus,
             plans.host_ram_bytes / GiB, held / GiB, peaks[largest] / MiB, largest)
    if plans.preprocessing_processes > 1 and plans.preprocessing_processes < n:
        n = plans.preprocessing_processes
        log.info("preprocess %s: %d process(es), as plans.json says", config_name, n)
    if peaks[largest] > plans.host_ram_bytes:
        log.warning("preprocess %s: case %s is predicted to need %.1f GiB, more than the RAM budget of "
                    "%.1f GiB", config_name, largest, peaks[largest] / GiB, plans.host_ram_bytes / GiB)
    return n
