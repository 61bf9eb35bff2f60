"""``find_best.json`` (every candidate's cross-validation figures) and ``find_best.md`` (the same as tables), and
the command that predicts with the choice."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoseg.core.artifacts import Artifact
from autoseg.predict.choice import InferenceChoice


@dataclass(frozen=True)
class CandidateFigures:
    name: str  # "3d_fullres", or "2d+3d_fullres" for the ensemble of two
    configurations: tuple[str, ...]
    mean_dice: float | None  # mean foreground Dice (null: undefined)
    class_dice: dict[str, float | None]


@dataclass(frozen=True)
class FindBestReport(Artifact):
    """``find_best.json``: every candidate's figures before postprocessing (``candidates``, in the order tried:
    configurations, then pairs), the chosen one (``best``) and its figures after postprocessing
    (``best_postprocessed``); postprocessing is searched for the best candidate only, as nnU-Net does."""

    SCHEMA_VERSION = 1
    KIND = "find-best report"

    folds: tuple[int, ...]
    num_cases: int
    candidates: tuple[CandidateFigures, ...]
    best: str
    best_postprocessed: CandidateFigures


def predict_command(workspace_root: str) -> str:
    """What the user runs next: ``autoseg predict`` without ``--config`` follows inference.json."""
    return f"autoseg predict -w {workspace_root} -i INPUT_FOLDER -o OUTPUT_FOLDER"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def format_markdown(report: FindBestReport, choice: InferenceChoice, workspace_root: str) -> str:
    """The candidates' table, the postprocessing steps tried and the command to predict with."""
    names = list(report.best_postprocessed.class_dice)
    head = "| candidate | mean Dice | " + " | ".join(names) + " |"
    lines = [
        f"# autoseg find-best: folds {' '.join(map(str, report.folds))}, {report.num_cases} validation cases",
        "",
        "Cross-validation Dice (mean over the validation cases of every fold, per class; mean Dice: the "
        "mean of the classes), before postprocessing.",
        "",
        head,
        "|" + " --- |" * (len(names) + 2),
    ]
    for c in report.candidates:
        mark = " **(chosen)**" if c.name == report.best else ""
        lines.append(
            f"| {c.name}{mark} | {_fmt(c.mean_dice)} | " + " | ".join(_fmt(c.class_dice[n]) for n in names) + " |"
        )
    pp = report.best_postprocessed
    lines.append(
        f"| {pp.name} postprocessed | {_fmt(pp.mean_dice)} | "
        + " | ".join(_fmt(pp.class_dice[n]) for n in names)
        + " |"
    )
    lines += [
        "",
        f"Postprocessing of {report.best} (keep only the largest connected component):",
        "",
        "| step | Dice before | Dice after | applied |",
        "| --- | --- | --- | --- |",
    ]
    for step in choice.steps:
        what = "all foreground as one (mean Dice)" if step.target == "foreground" else f"{step.target} (its Dice)"
        lines.append(
            f"| {what} | {_fmt(step.dice_before)} | {_fmt(step.dice_after)} | {'yes' if step.applied else 'no'} |"
        )
    lines += [
        "",
        f"Chosen: {' + '.join(choice.configurations)}"
        f"{' (ensemble: probabilities averaged)' if len(choice.configurations) > 1 else ''}, folds "
        f"{' '.join(map(str, choice.folds))}, postprocessing: {choice.postprocessing.describe()}; "
        f"mean Dice {_fmt(choice.cv_dice)} -> {_fmt(choice.cv_dice_postprocessed)} after postprocessing.",
        "",
        "Predict with it:",
        "",
        f"    {predict_command(workspace_root)}",
        "",
    ]
    return "\n".join(lines)
