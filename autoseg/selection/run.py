"""``autoseg find-best``: score every candidate, choose the best, search its postprocessing, write inference.json,
find_best.json and find_best.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autoseg.core.artifacts import atomic_write_text
from autoseg.core.lock import hold, refuse_while_held, this_process
from autoseg.core.workspace import Workspace
from autoseg.predict.choice import InferenceChoice, nan_to_none
from autoseg.selection.report import CandidateFigures, FindBestReport, format_markdown
from autoseg.selection.scoring import (
    Candidate,
    Figures,
    candidates,
    score_candidates,
    score_postprocessed,
    search_postprocessing,
)
from autoseg.selection.sources import collect

log = logging.getLogger("autoseg")


@dataclass(frozen=True)
class FindBestResult:
    choice: InferenceChoice  # as written to inference.json
    report: FindBestReport  # as written to find_best.json
    markdown: str  # as written to find_best.md


INFERENCE_PART = "inference.json, find_best.json and find_best.md"  # what the inference lock's holder writes


def find_best(
    workspace: Workspace,
    configs: list[str] | None = None,
    folds: tuple[int, ...] | None = None,
    progress: bool = False,
    command: str = "",
) -> FindBestResult:
    """Choose the configuration or ensemble of two with the highest cross-validation mean foreground Dice (ties:
    the first, single configurations before ensembles), then its postprocessing, over ``folds`` (None: every fold of
    splits.json); write ``inference.json``,
    ``find_best.json`` and ``find_best.md`` into the workspace (each atomically, after every figure is known).
    Holds the workspace's inference lock (``command``: what it names, "" this process's command line), and refuses
    while `plan_and_preprocess --overwrite` replaces the plan and the folds it reads."""
    with hold(workspace.inference_lock, this_process(INFERENCE_PART, command)):
        refuse_while_held(
            workspace.plan_lock, workspace.root, "`autoseg find-best` reads the plan and the trained folds", True
        )
        return _find_best(workspace, configs, folds, progress)


def _find_best(
    workspace: Workspace, configs: list[str] | None, folds: tuple[int, ...] | None, progress: bool
) -> FindBestResult:
    cv = collect(workspace, configs, folds)
    cands = candidates(cv.configurations)
    log.info(
        "find-best: %d candidate(s) (%s) over %d validation case(s) of fold(s) %s",
        len(cands),
        ", ".join(c.name for c in cands),
        len(cv.cases),
        " ".join(map(str, cv.folds)),
    )
    figures = score_candidates(cv, cands, progress)
    best = _best(cands, figures)
    postprocessing, steps = search_postprocessing(cv, best, progress)
    after = (
        figures[best.name] if postprocessing.is_identity else score_postprocessed(cv, best, postprocessing, progress)
    )
    before = figures[best.name]
    choice = InferenceChoice(
        configurations=best.configurations,
        folds=cv.folds,
        checkpoint="final",
        postprocessing=postprocessing,
        cv_dice=nan_to_none(before.mean_dice),
        cv_dice_postprocessed=nan_to_none(after.mean_dice),
        class_dice=_classes(before),
        class_dice_postprocessed=_classes(after),
        steps=steps,
        candidates={c.name: nan_to_none(figures[c.name].mean_dice) for c in cands},
        num_cases=len(cv.cases),
    )
    report = FindBestReport(
        folds=cv.folds,
        num_cases=len(cv.cases),
        candidates=tuple(_candidate_figures(c, figures[c.name]) for c in cands),
        best=best.name,
        best_postprocessed=_candidate_figures(best, after),
    )
    markdown = format_markdown(report, choice, str(workspace.root))
    report.to_json(workspace.find_best_path)
    atomic_write_text(workspace.find_best_path.with_suffix(".md"), markdown)
    choice.to_json(workspace.inference_path)  # last: predict follows it
    return FindBestResult(choice, report, markdown)


def _best(cands: list[Candidate], figures: dict[str, Figures]) -> Candidate:
    """The highest mean foreground Dice; the first on ties (the simpler model); NaN never wins."""
    scored = [c for c in cands if figures[c.name].mean_dice == figures[c.name].mean_dice]
    if not scored:
        return cands[0]
    return max(scored, key=lambda c: figures[c.name].mean_dice)  # max keeps the first of equal keys


def _classes(figures: Figures) -> dict[str, float | None]:
    return {name: nan_to_none(v) for name, v in figures.class_dice.items()}


def _candidate_figures(candidate: Candidate, figures: Figures) -> CandidateFigures:
    return CandidateFigures(candidate.name, candidate.configurations, nan_to_none(figures.mean_dice), _classes(figures))
