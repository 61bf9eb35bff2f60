"""Per-class decision weights a fold carries: a factor on each class's probability before the label map's argmax,
fitted on the fold's own validation cases at the end of training (``autoseg.train.class_weights``).

Why: a network trained briefly separates a small, rare class from its surroundings well before it is calibrated.
On the small-structures benchmark (issue 28, 30 minutes on 2 cores) the lesions' logits stood 7-13 above the
surrounding organ's relative to elsewhere, yet their probability peaked at 1-2%: the argmax never chose them
(lesion Dice 0.000, 0 of 11 found). A factor of 100 on their probability, chosen on the fold's 4 validation cases,
gave the 4 held-out test cases lesion Dice 0.719 with 10 of 11 found, organ and tubes unchanged (docs/prediction.md,
"Class decision weights"). nnU-Net has no such step; it trains 250,000 iterations, where the calibration comes by
itself.

``ClassWeights`` is the artifact (``results/<config>/fold_<k>/class_weights.json``, and the model archive's member of
that name), bound to the checkpoint whose validation it was fitted on (its sha256): a fold trained again, or
predicted with the other checkpoint, gets no weights. ``fold_weights`` gives a configuration's folds' weights as one
factor per output: the geometric mean over the folds (a fold without a file counts as 1 for every class), since
the folds' probabilities are averaged before the argmax. Weights apply to plain classes only (regions are
thresholded at 0.5 each, not compared); probabilities written with ``--save-probabilities`` are the network's,
unweighted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import Artifact
from autoseg.core.errors import InputError
from autoseg.dataset.labels import LabelScheme
from autoseg.predict.graphs import file_digest

log = logging.getLogger("autoseg")

CLASS_WEIGHTS_FILE = "class_weights.json"  # beside checkpoint_<which>.pt: results/<config>/fold_<k>/


@dataclass(frozen=True)
class ClassWeights(Artifact):
    """One fold's decision weights: ``weights`` (foreground class name -> factor on its probability; every
    foreground class is listed, 1.0 where none helped), fitted on ``case_ids`` (the fold's final validation) for
    checkpoint_<checkpoint>.pt of ``checkpoint_sha256``; the mean validation Dice per class without and with them
    (None where the class is in neither prediction nor reference of any case)."""

    SCHEMA_VERSION = 1
    KIND = "class decision weights"

    configuration: str
    fold: int | str
    checkpoint: str
    checkpoint_sha256: str
    case_ids: tuple[str, ...]
    weights: dict[str, float]
    dice_before: dict[str, float | None]
    dice_after: dict[str, float | None]

    def describe(self) -> str:
        """E.g. "lesions x100 (validation Dice 0.000 -> 0.650)", or "none" when every factor is 1."""
        changed = [name for name, w in self.weights.items() if w != 1.0]
        return (
            ", ".join(
                f"{name} x{self.weights[name]:g} (validation Dice {_fmt(self.dice_before.get(name))} -> "
                f"{_fmt(self.dice_after.get(name))})"
                for name in changed
            )
            or "none"
        )


def _fmt(dice: float | None) -> str:
    return "-" if dice is None else f"{dice:.3f}"


def class_weights_path(checkpoint_path: Path) -> Path:
    """Where the weights of the fold of ``checkpoint_path`` are kept (beside it)."""
    return checkpoint_path.parent / CLASS_WEIGHTS_FILE


def stored_weights(checkpoint_path: Path) -> ClassWeights | None:
    """The weights beside ``checkpoint_path`` where they were fitted for that very file (its sha256), else None; a
    damaged file or an unknown schema is refused naming it."""
    path = class_weights_path(checkpoint_path)
    if not path.is_file():
        return None
    weights = ClassWeights.from_json(path)
    bad = {name: w for name, w in weights.weights.items() if not (isinstance(w, (int, float)) and 0 < w < math.inf)}
    if bad:
        raise InputError(
            f"{path}: class weights must be positive finite factors, got {bad}; delete the file (the fold then "
            "predicts with the plain argmax) or train the fold again to fit it anew"
        )
    if weights.checkpoint_sha256 != file_digest(checkpoint_path):
        log.info("%s: fitted for another checkpoint (the fold was trained again): not applied", path)
        return None
    return weights


def output_factors(scheme: LabelScheme, weights: dict[str, float]) -> np.ndarray:
    """float32, one factor per output of plain labels ``scheme``: each class's of ``weights`` (name -> factor; 1
    where a class is not named), background 1."""
    factors = np.ones(scheme.num_outputs, dtype=np.float32)
    for name, channel in zip(scheme.names, scheme.foreground_channels, strict=True):
        factors[channel] = weights.get(name, 1.0)
    return factors


def fold_weights(checkpoint_paths: list[Path], scheme: LabelScheme) -> np.ndarray | None:
    """One factor per output of ``scheme`` (background 1) for the folds of ``checkpoint_paths`` predicted together:
    the geometric mean of their stored weights (1 for a fold without weights). None when no factor differs from 1
    or the outputs are regions."""
    if scheme.has_regions:
        return None
    logs = np.zeros(scheme.num_outputs)
    for path in checkpoint_paths:
        stored = stored_weights(path)
        if stored is not None:
            logs += np.log(output_factors(scheme, stored.weights))
    factors = np.exp(logs / max(len(checkpoint_paths), 1))
    if np.allclose(factors, 1.0):
        return None
    log.info(
        "class decision weights from the folds' validation: %s",
        ", ".join(
            f"{name} x{factors[channel]:.3g}"
            for name, channel in zip(scheme.names, scheme.foreground_channels, strict=True)
            if not np.isclose(factors[channel], 1.0)
        ),
    )
    return factors
