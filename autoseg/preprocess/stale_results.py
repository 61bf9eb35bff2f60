"""What ``plan_and_preprocess --overwrite`` sets aside: the trained folds made from what it changes (the dataset's case
files, a configuration's plan or its preprocessed data), moved to ``results/<config>.stale-<n>/`` and never deleted,
and a splits.json whose cases are no longer the dataset's.

A configuration's results are moved only while no process trains any of its folds: the lock of each of its folds
(``Workspace.fold_locks``) is taken first, so a fold being trained is refused naming its trainer and nothing is moved.
"""

from __future__ import annotations

import logging
from typing import Any

from autoseg.core.artifacts import to_dict
from autoseg.core.lock import hold_all, this_process
from autoseg.core.workspace import Splits, Workspace
from autoseg.plan.plans import ConfigurationPlan
from autoseg.plan.run import PlannedWorkspace

log = logging.getLogger("autoseg")

# a configuration's fields that describe the machine it runs on, not the network trained or its data: a plan
# that differs only in these (another RAM budget) leaves trained folds as they are
MACHINE_FIELDS = (
    "memory",
    "notes",
    "limited_by",
    "predicted_seconds_per_iteration",
    "flops_per_iteration",
    "loader_workers",
    "loader_queue_depth",
    "loader_worker_bytes",
)


def _trained_on(config: ConfigurationPlan) -> dict[str, Any]:
    return {k: v for k, v in to_dict(config).items() if k not in MACHINE_FIELDS}


def _files_changed(planned: PlannedWorkspace) -> bool:
    """Whether the dataset's case files changed (not only dataset.json): every trained fold was trained on them."""
    return any(not c.startswith("dataset.json") for c in planned.dataset_changes)


def stale_results(planned: PlannedWorkspace, stale_configs: set[str]) -> list[str]:
    """The configurations whose trained folds ``planned`` makes stale: every one when the dataset's case files changed,
    else those whose plan changed or whose preprocessed data is stale (``stale_configs``), and the cascade stages
    that read them."""
    files_changed = _files_changed(planned)
    previous = planned.previous_plans.configurations if planned.previous_plans and planned.write_plans else {}
    configs = planned.plans.configurations
    changed = {
        name
        for name, config in configs.items()
        if files_changed
        or name in stale_configs
        or (name in previous and _trained_on(previous[name]) != _trained_on(config))
    }
    # a cascade stage was trained on its previous stage's predictions and on the data it reads: changed with them
    changed |= {name for name, c in configs.items() if {c.previous_stage, c.preprocessed_as} & changed}
    return sorted(changed)


def set_aside_results(workspace: Workspace, planned: PlannedWorkspace, configs: list[str], command: str) -> None:
    """Move the results of ``configs`` (``stale_results``) aside, holding the lock of each of their folds while it
    does (``InputError`` naming the trainer, nothing moved, when one is held); then a splits.json of other cases."""
    locks = [
        (path, this_process(f"results/{name} (moving it aside)", command, replacing=True))
        for name in configs
        for path in workspace.fold_locks(name)
    ]
    trained_on = "dataset" if _files_changed(planned) else "plan"
    with hold_all(locks):
        for name in configs:
            moved = workspace.set_aside(workspace.results(name, 0).parent)
            if moved is not None:
                log.warning(
                    "--overwrite: %s was trained on the %s before this change; moved to %s (autoseg no "
                    "longer uses it; delete it when you no longer need it)",
                    moved.with_name(name),
                    trained_on,
                    moved,
                )
    if workspace.splits_path.is_file():
        splits = Splits.from_json(workspace.splits_path)
        if {c for f in splits.folds for c in f.val} != {c.case_id for c in planned.dataset.cases}:
            log.warning(
                "--overwrite: %s splits other cases than the dataset has now; moved to %s",
                workspace.splits_path,
                workspace.set_aside(workspace.splits_path),
            )
