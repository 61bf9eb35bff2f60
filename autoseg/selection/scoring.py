"""Cross-validation Dice of every candidate (each configuration, each pair of configurations as an ensemble) and
the postprocessing search for the best one.

The definition is nnU-Net's (``find_best_configuration``: the validation predictions of all folds pooled in one
folder and evaluated): per class or region, the mean Dice over every validation case of the folds where it is
defined (in the prediction or the reference), then the mean foreground Dice: the mean of those class means
(``autoseg.evaluate.metrics.case_dice`` and ``mean_dice``, the definition of ``autoseg evaluate``). Not the mean of
the folds' means, and not the mean over cases of each case's mean: a class missing from a case does not pull the
case's other classes with it.

A configuration's label map of a case is the one its final validation wrote; an ensemble's is made from the mean
of its two configurations' ``{case}.npz`` probabilities (argmax, or regions at 0.5). One case at a time: its
reference (int16), one candidate's label map and, for an ensemble, the probability sum
(``autoseg.predict.probabilities.ensemble_case_bytes``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from autoseg.core.errors import InputError
from autoseg.evaluate.files import read_label_map
from autoseg.evaluate.metrics import case_dice, mean_dice
from autoseg.predict.choice import PostprocessingStep, nan_to_none
from autoseg.predict.postprocessing import FOREGROUND, Postprocessing, apply_postprocessing
from autoseg.predict.probabilities import labels_from_probabilities, mean_probabilities
from autoseg.selection.sources import CrossValidation, ValidationCase


@dataclass(frozen=True)
class Candidate:
    configurations: tuple[str, ...]  # one, or two averaged

    @property
    def name(self) -> str:
        return "+".join(self.configurations)


@dataclass(frozen=True)
class Figures:
    """A candidate's cross-validation Dice: per class or region (NaN: undefined in every case), and their mean."""

    class_dice: dict[str, float]
    mean_dice: float


def candidates(configurations: tuple[str, ...]) -> list[Candidate]:
    """Each configuration alone, then every pair (an ensemble of two), in the configurations' order."""
    return [Candidate((c,)) for c in configurations] + [
        Candidate(pair) for pair in itertools.combinations(configurations, 2)
    ]


def candidate_labels(cv: CrossValidation, candidate: Candidate, case: ValidationCase) -> np.ndarray:
    """The candidate's label map (Z, Y, X) of a validation case."""
    if len(candidate.configurations) == 1:
        return read_label_map(cv.label_map(candidate.configurations[0], case), "prediction")[0]
    mean = mean_probabilities([cv.probabilities(c, case) for c in candidate.configurations], cv.scheme)
    return labels_from_probabilities(mean, cv.scheme)


def _score(
    cv: CrossValidation, labels: np.ndarray, ref: np.ndarray, case: ValidationCase, what: str
) -> dict[str, float]:
    if labels.shape != ref.shape:
        raise InputError(
            f"{what} of case {case.case_id} (fold {case.fold}) has shape {labels.shape}, its reference "
            f"{case.reference} {ref.shape}; the validation outputs are not of this dataset: train the "
            "fold again"
        )
    return case_dice(labels, ref, cv.foreground, cv.ignore, where=case.case_id)


def _over_cases(
    cv: CrossValidation, per_case: Callable[[ValidationCase, np.ndarray], None], desc: str, progress: bool
) -> None:
    for case in tqdm(cv.cases, desc=desc, unit="case", disable=not progress):
        ref = read_label_map(case.reference, "reference")[0]  # int16 (Z, Y, X)
        per_case(case, ref)


def score_candidates(cv: CrossValidation, cands: list[Candidate], progress: bool = False) -> dict[str, Figures]:
    """Every candidate's cross-validation Dice, one case (and one candidate's label map) at a time."""
    dice: dict[str, list[dict[str, float]]] = {c.name: [] for c in cands}

    def per_case(case: ValidationCase, ref: np.ndarray) -> None:
        for cand in cands:
            dice[cand.name].append(_score(cv, candidate_labels(cv, cand, case), ref, case, cand.name))

    _over_cases(cv, per_case, "candidates", progress)
    return {name: Figures(*mean_dice(scores)) for name, scores in dice.items()}


def search_postprocessing(
    cv: CrossValidation, best: Candidate, progress: bool = False
) -> tuple[Postprocessing, tuple[PostprocessingStep, ...]]:
    """nnU-Net's search (``determine_postprocessing``), on ``best``'s label maps:

    1. keep only the largest component of all foreground as one: applied when it raises the mean foreground Dice
       and lowers no class's mean Dice;
    2. with more than one class or region, for each: keep only its largest component (on top of step 1 when
       applied): applied when it raises that class's mean Dice. Each class is decided on the same label maps (those
       after step 1); for plain classes that is the same as nnU-Net's one after the other (removing class c's
       voxels changes only class c's Dice), for overlapping regions it may differ slightly.

    "Raises" is strictly: a tie keeps the label map as it is."""
    names = cv.scheme.names if len(cv.scheme.names) > 1 else ()
    dice: dict[tuple[str, str], list[dict[str, float]]] = {}

    def per_case(case: ValidationCase, ref: np.ndarray) -> None:
        labels = candidate_labels(cv, best, case)
        fg = apply_postprocessing(labels, Postprocessing(largest_foreground_component=True), cv.scheme)
        for source, base in (("", labels), (FOREGROUND, fg)):
            dice.setdefault((source, ""), []).append(_score(cv, base, ref, case, best.name))
            for name in names:
                one = apply_postprocessing(base, Postprocessing(largest_component_of=(name,)), cv.scheme)
                dice.setdefault((source, name), []).append(_score(cv, one, ref, case, best.name))

    _over_cases(cv, per_case, "postprocessing", progress)
    means = {key: mean_dice(scores) for key, scores in dice.items()}
    (before, mean_before), (after, mean_after) = means[("", "")], means[(FOREGROUND, "")]
    use_fg = mean_after > mean_before and not any(after[n] < before[n] for n in before)
    steps = [PostprocessingStep(FOREGROUND, nan_to_none(mean_before), nan_to_none(mean_after), use_fg)]
    source = FOREGROUND if use_fg else ""
    chosen = []
    for name in names:
        class_before, class_after = means[(source, "")][0][name], means[(source, name)][0][name]
        applied = class_after > class_before  # False when NaN (undefined in every case)
        steps.append(PostprocessingStep(name, nan_to_none(class_before), nan_to_none(class_after), applied))
        if applied:
            chosen.append(name)
    return Postprocessing(use_fg, tuple(chosen)), tuple(steps)


def score_postprocessed(
    cv: CrossValidation, best: Candidate, postprocessing: Postprocessing, progress: bool = False
) -> Figures:
    """``best``'s cross-validation Dice with ``postprocessing`` applied as prediction will apply it."""
    scores: list[dict[str, float]] = []

    def per_case(case: ValidationCase, ref: np.ndarray) -> None:
        labels = apply_postprocessing(candidate_labels(cv, best, case), postprocessing, cv.scheme)
        scores.append(_score(cv, labels, ref, case, best.name))

    _over_cases(cv, per_case, "postprocessed", progress)
    return Figures(*mean_dice(scores))
