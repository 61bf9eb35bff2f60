"""Several folds in one command (``autoseg train fold 0 1 2 3 4``): each fold trained in turn by ``trainer.train``,
the run resumable as a whole.

With ``--resume`` each fold goes on from where an interrupted command left it: a fold that finished (its
``run.json`` written and, when the run validates, its ``validation/summary.json``) is skipped, one with a
``checkpoint_latest.pt`` resumes from it, one without starts from its first epoch. When no fold asked for has
either, there is nothing to resume: refused naming the missing checkpoint, not started over. Without ``--resume``
every fold starts from its first epoch, as one fold does. ``--time-budget`` applies to each fold.

The command holds the lock of every fold it trains for its lifetime (``fold_locks``; under torchrun rank 0 holds them
for every rank): a second command training one of them is refused naming the first, and `plan_and_preprocess
--overwrite` refuses to move them aside. It starts only while no command writes the plan or the preprocessed data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.lock import hold_all, refuse_while_held, this_process
from autoseg.core.workspace import Workspace
from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

log = logging.getLogger("autoseg")


def fold_finished(workspace: Workspace, config_name: str, fold: int | str, validate: bool) -> bool:
    """Whether ``fold`` of ``config_name`` ran to its end: ``run.json`` (written after the last epoch) and, when
    the run validates, the final validation's ``summary.json``."""
    out = workspace.results(config_name, fold)
    return (out / "run.json").is_file() and (not validate or (out / "validation" / "summary.json").is_file())


def train_folds(
    workspace: Workspace,
    config_name: str,
    folds: Sequence[int | str],
    run: RunConfig,
    progress: bool = True,
    distributed: DistributedContext = SINGLE_PROCESS,
    command: str = "",
) -> list[Path]:
    """Train ``folds`` one after the other (``train``), holding their locks (``fold_locks``; ``command``: what the
    locks name, "" this process's command line); returns their results folders, finished ones included.
    ``run.resume``: skip finished folds, resume the others from their latest checkpoint where they have one."""
    with fold_locks(workspace, config_name, folds, command) if distributed.is_main else nullcontext():
        return _train_in_turn(workspace, config_name, folds, run, progress, distributed)


@contextmanager
def fold_locks(workspace: Workspace, config_name: str, folds: Sequence[int | str], command: str) -> Iterator[None]:
    """Hold the lock of each of ``folds`` for the block, then check that no command writes the plan or the
    preprocessed data (taken in this order, a `plan_and_preprocess` starting at the same time either sees the fold
    locks or is seen here). ``InputError`` naming the holder otherwise, before anything is written."""
    locks = [
        (workspace.fold_lock(config_name, f), this_process(f"results/{config_name}/fold_{f}", command)) for f in folds
    ]
    with hold_all(locks):
        refuse_while_held(
            workspace.plan_lock,
            workspace.root,
            f"`autoseg train` trains on them ({config_name}, fold(s) {' '.join(map(str, folds))})",
        )
        yield


def _train_in_turn(
    workspace: Workspace,
    config_name: str,
    folds: Sequence[int | str],
    run: RunConfig,
    progress: bool,
    distributed: DistributedContext,
) -> list[Path]:
    if run.resume:
        _check_something_to_resume(workspace, config_name, folds, run.validate)
    done = []
    for i, fold in enumerate(folds):
        out = workspace.results(config_name, fold)
        if run.resume and fold_finished(workspace, config_name, fold, run.validate):
            log.info("fold %s (%d of %d): finished before (%s); skipped", fold, i + 1, len(folds), out / "run.json")
            done.append(out)
            continue
        resume = run.resume and workspace.checkpoint(config_name, fold, "latest").is_file()
        if len(folds) > 1:
            how = "resuming from its latest checkpoint" if resume else "from its first epoch"
            log.info("fold %s (%d of %d): %s", fold, i + 1, len(folds), how)
        done.append(
            train(workspace, config_name, fold, replace(run, resume=resume), progress=progress, distributed=distributed)
        )
    return done


def _check_something_to_resume(
    workspace: Workspace, config_name: str, folds: Sequence[int | str], validate: bool
) -> None:
    """``--resume`` where no fold asked for has a checkpoint or finished: an error naming the missing checkpoint
    (a typo in the workspace, the configuration or the fold would otherwise train from scratch and exit 0)."""
    started = [
        f
        for f in folds
        if fold_finished(workspace, config_name, f, validate)
        or workspace.checkpoint(config_name, f, "latest").is_file()
    ]
    if not started:
        missing = workspace.checkpoint(config_name, folds[0], "latest")
        others = f" (nor for fold(s) {' '.join(map(str, folds[1:]))})" if len(folds) > 1 else ""
        raise InputError(
            f"--resume: {missing} not found{others}: nothing of configuration {config_name} to resume in "
            f"{workspace.root}; train without --resume to start, or check -w, --config and the fold"
        )
