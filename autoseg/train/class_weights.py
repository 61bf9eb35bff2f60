"""Fitting a fold's class decision weights (``autoseg.predict.class_weights``) on its final validation.

After the final validation has written each case's probabilities (``{case}.npz``, the input's own grid) beside its
label map, ``fit_after_validation`` searches one factor per foreground class on ``WEIGHT_GRID``: class by class
(coordinate ascent, one pass in the order of the dataset's labels), the factor that gives the highest mean
foreground Dice over the validation cases (``autoseg evaluate``'s definition: each class's mean over the cases
where it is defined, then their mean), the other classes' factors held. A factor other than 1 is kept only when it
raises that mean by at least ``MIN_GAIN``: a class the network already calibrates keeps 1, and chance gains on a few
cases are not taken. The result is written as ``class_weights.json`` beside the checkpoint (temporary name, then
renamed) and logged.

Memory: one case's probabilities at a time as read (float16, K x 2 bytes a voxel), the weighted running argmax of
``labels_from_probabilities`` over them (a float32 map, a bool mask and the labels: 6 bytes a voxel), the reference
and ``case_dice``'s 8 bytes a voxel (not in the host-RAM plan yet). Each case is read once per foreground class
(all factors of the grid are scored on one read), and twice more for the figures before and after. Regions
(thresholded at 0.5 each, not compared) and cascade stages get no weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from autoseg.core.workspace import Workspace
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.files import read_label_map
from autoseg.evaluate.metrics import case_dice, mean_dice
from autoseg.plan.plans import Plans
from autoseg.predict.class_weights import ClassWeights, class_weights_path, output_factors
from autoseg.predict.graphs import file_digest
from autoseg.predict.probabilities import labels_from_probabilities, read_probabilities

log = logging.getLogger("autoseg.train.trainer")  # the fold's train.log, as the final validation's lines

# Factors tried per class: about 2.5x apart from 1 to 1000 (the benchmark's lesions needed 100; 30 found none of them,
# 300 lost Dice to false positives: docs/prediction.md, "Class decision weights").
WEIGHT_GRID = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
MIN_GAIN = 0.01  # the least rise of the mean foreground validation Dice for a factor other than 1 to be kept


def fit_weights(
    cases: list[tuple[Path, Path]], scheme: LabelScheme, grid: tuple[float, ...] = WEIGHT_GRID
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The factor per foreground class (name -> factor) for the validation ``cases`` ((probabilities npz, reference
    label file) pairs) of plain labels ``scheme``, and each class's mean Dice before and after."""
    weights = {name: 1.0 for name in scheme.names}
    ((before, best_mean),) = _scores(cases, scheme, [weights])
    for name in scheme.names:
        tried = [{**weights, name: factor} for factor in grid if factor != 1.0]
        means = [mean for _, mean in _scores(cases, scheme, tried)]
        best = int(np.argmax(means))  # the first of equals: the smallest factor
        if means[best] >= best_mean + MIN_GAIN:
            weights, best_mean = tried[best], means[best]
    ((after, _),) = _scores(cases, scheme, [weights])
    return weights, before, after


def _scores(
    cases: list[tuple[Path, Path]], scheme: LabelScheme, candidates: list[dict[str, float]]
) -> list[tuple[dict[str, float], float]]:
    """For each candidate (class name -> factor): each class's mean Dice and the mean foreground Dice of the cases'
    weighted argmax. Each case is read once for all candidates."""
    foreground = dict(zip(scheme.names, (v[0] for v in scheme.foreground_values), strict=True))
    per_case: list[list[dict[str, float]]] = [[] for _ in candidates]
    for npz, reference_path in cases:
        probabilities = read_probabilities(npz, scheme)  # float16 (K, Z, Y, X)
        reference, _ = read_label_map(reference_path, "reference")
        for i, candidate in enumerate(candidates):
            labels = labels_from_probabilities(probabilities, scheme, output_factors(scheme, candidate))
            per_case[i].append(case_dice(labels, reference, foreground, scheme.ignore_value, where=str(npz)))
        del probabilities, reference
    return [mean_dice(dice) for dice in per_case]


def fit_after_validation(
    workspace: Workspace, plans: Plans, config_name: str, fold: int | str, validation: Path, case_ids: tuple[str, ...]
) -> ClassWeights | None:
    """Fit, write and log the fold's weights from its final validation in ``validation`` (checkpoint_final.pt);
    None (with a log line) for regions and cascade stages."""
    config = plans.configuration(config_name)
    if plans.label_scheme.has_regions or config.previous_stage:
        log.info("class decision weights of fold %s of %s: not fitted (regions or a cascade stage)", fold, config_name)
        return None
    dataset = load_dataset(workspace.dataset_root())
    by_id = {c.case_id: c for c in dataset.cases}
    cases = [(validation / f"{case_id}.npz", by_id[case_id].label_path) for case_id in case_ids]
    weights, before, after = fit_weights(cases, plans.label_scheme)
    checkpoint = workspace.checkpoint(config_name, fold, "final")
    fitted = ClassWeights(
        configuration=config_name,
        fold=fold,
        checkpoint="final",
        checkpoint_sha256=file_digest(checkpoint),
        case_ids=tuple(case_ids),
        weights=weights,
        dice_before=_defined(before),
        dice_after=_defined(after),
    )
    fitted.to_json(class_weights_path(checkpoint))
    log.info("class decision weights of fold %s of %s: %s", fold, config_name, fitted.describe())
    return fitted


def _defined(dice: dict[str, float]) -> dict[str, float | None]:
    return {name: None if np.isnan(value) else float(value) for name, value in dice.items()}
