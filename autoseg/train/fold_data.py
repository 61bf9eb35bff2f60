"""What one fold trains on: its cases (``fold_cases``) and, for a cascade stage, each case's previous-stage label
map (``prepare_previous_stage``).

A cascade stage (``3d_cascade_fullres``, ``ConfigurationPlan.previous_stage`` ``3d_lowres``) takes the one-hot of
its previous stage's predicted label map as extra input channels. For a training case that map must be an
out-of-fold prediction, as nnU-Net's "predicted_next_stage" is: a previous-stage model that saw the case would be
right about it more often than it will be about a new scan, and the cascade would learn to trust it too much. So
each case's map is the final-validation label map of the previous-stage fold that validated it
(``results/3d_lowres/fold_k/validation/<case><ending>``; splits.json puts every case in exactly one fold's
validation set). Training cascade fold N therefore needs every previous-stage fold whose validation set holds one of
fold N's cases (train and validation): with five folds, all five (fold N's validation cases come from fold N). The
maps are put on the grid of the preprocessed case (``labels_on_grid``, as a training label is) once, and kept in
``preprocessed/<cascade>/`` (``autoseg.preprocess.store``) with the file and digest they were made from, so a
retrained previous-stage fold's new predictions replace them at the next start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.workspace import Splits, Workspace, load_or_create_splits
from autoseg.dataset.imageio import read_image
from autoseg.plan.plans import Plans
from autoseg.plan.run import file_hash
from autoseg.preprocess.preprocessor import labels_on_grid
from autoseg.preprocess.store import (
    PreviousStageSource,
    list_cases,
    missing_files,
    read_previous_stage_source,
    read_properties,
    write_previous_stage,
)

log = logging.getLogger("autoseg.train.trainer")


def fold_cases(workspace: Workspace, data_config: str, fold: int | str) -> tuple[list[str], list[str]]:
    """(train, val) case ids of ``preprocessed/<data_config>/`` (a configuration's ``data_configuration``); fold
    "all" trains on every case and validates on all of them too."""
    folder = workspace.require(workspace.preprocessed(data_config), "plan_and_preprocess")
    case_ids = list_cases(folder)
    if not case_ids:
        raise InputError(f"{folder}: no preprocessed cases; run `{workspace.advice('plan_and_preprocess')}` first")
    for case_id in case_ids:  # a case never silently leaves the folds
        if missing := missing_files(folder, case_id):
            raise InputError(
                f"{folder}: case {case_id!r} is missing {', '.join(p.name for p in missing)}; "
                f"run `{workspace.advice('plan_and_preprocess')}` again (it redoes incomplete cases)"
            )
    splits = load_or_create_splits(workspace, case_ids)
    if fold == "all":
        return case_ids, case_ids
    if not 0 <= int(fold) < len(splits.folds):
        raise InputError(f"fold {fold} does not exist; {workspace.splits_path} has folds 0..{len(splits.folds) - 1}")
    split = splits.folds[int(fold)]
    return list(split.train), list(split.val)


def previous_stage_label_file(workspace: Workspace, plans: Plans, config_name: str, case_id: str) -> Path:
    """The previous stage's out-of-fold label map of ``case_id`` (in the image's grid): the final-validation output
    of the previous-stage fold that validated it (splits.json)."""
    stage = plans.configuration(config_name).previous_stage
    splits = Splits.from_json(workspace.require(workspace.splits_path, f"train fold 0 -c {stage}"))
    fold = next((k for k, f in enumerate(splits.folds) if case_id in f.val), None)
    if fold is None:
        raise InputError(f"case {case_id!r} is in no validation fold of {workspace.splits_path}")
    return workspace.results(stage, fold) / "validation" / f"{case_id}{plans.file_ending}"


def prepare_previous_stage(workspace: Workspace, plans: Plans, config_name: str, case_ids: list[str]) -> Path | None:
    """For a cascade stage: write (or keep, when made from the same file) each case's previous-stage label map on the
    grid of its preprocessed case; returns their folder (None for any other configuration). Refuses, before writing
    anything, when a previous-stage fold is not trained or its final validation lacks a case, naming the folds and
    the command that trains them."""
    config = plans.configuration(config_name)
    if not config.previous_stage:
        return None
    files = {c: previous_stage_label_file(workspace, plans, config_name, c) for c in case_ids}
    _check_previous_folds(workspace, config_name, config.previous_stage, files)
    data, folder = workspace.preprocessed(config.data_configuration), workspace.preprocessed(config_name)
    written = 0
    for case_id, path in files.items():
        props = read_properties(data, case_id)
        source = PreviousStageSource(
            label_file=str(path.relative_to(workspace.root)),
            label_digest=file_hash(path),
            crop_bbox=props.crop_bbox,
            shape_zyx=props.shape_after_resample,
        )
        if read_previous_stage_source(folder, case_id) == source:
            continue
        labels, _ = read_image(path, dtype=None)
        write_previous_stage(folder, case_id, labels_on_grid(labels, props), source)
        written += 1
    log.info(
        "%s: %d case(s)' %s label maps on the %s grid in %s (%d written now, the others kept)",
        config_name,
        len(files),
        config.previous_stage,
        config.data_configuration,
        folder,
        written,
    )
    return folder


def _check_previous_folds(workspace: Workspace, config_name: str, stage: str, files: dict[str, Path]) -> None:
    """Raise ``InputError`` naming every previous-stage fold that is not trained, or trained without the final
    validation outputs the cascade reads, and the commands that write them."""
    untrained: set[int] = set()
    incomplete: dict[int, list[str]] = {}
    for case_id, path in files.items():
        fold_dir = path.parent.parent
        fold = int(fold_dir.name.removeprefix("fold_"))
        if not (fold_dir / "checkpoint_final.pt").is_file():
            untrained.add(fold)
        elif not path.is_file():
            incomplete.setdefault(fold, []).append(case_id)
    if not untrained and not incomplete:
        return
    problems = []
    if untrained:
        folds = " ".join(map(str, sorted(untrained)))
        problems.append(
            f"{stage} fold(s) {folds} not trained: run `autoseg train fold {folds} -c {stage} -w {workspace.root}`"
        )
    for fold, cases in sorted(incomplete.items()):
        problems.append(
            f"{stage} fold {fold}'s final validation has no label map of case(s) {', '.join(cases)} "
            f"(reduced by a time budget, or trained with --no-validation): run `autoseg train fold {fold} "
            f"-c {stage} -w {workspace.root} --resume` (a finished fold runs its validation again; move "
            f"{workspace.results(stage, fold) / 'validation'} aside first if it holds summary.json)"
        )
    raise InputError(
        f"{config_name} takes {stage}'s prediction of every case it trains and validates on, predicted "
        f"by the {stage} fold that held the case out (its final validation); missing:\n  " + "\n  ".join(problems)
    )
