"""``inference.json``: what ``autoseg find-best`` chose from cross-validation, the one file prediction follows
when no configuration is named (docs/find_best.md documents the format).

Read with ``InferenceChoice.from_json(workspace.inference_path)``: an unknown ``schema_version`` or key fails with
the file's path (``autoseg.core.artifacts``). Dice values are ``null`` where a class was absent from every
prediction and reference (undefined).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoseg.core.artifacts import Artifact
from autoseg.predict.postprocessing import Postprocessing


@dataclass(frozen=True)
class PostprocessingStep:
    """One tried step and the cross-validation Dice behind its decision: ``target`` is ``foreground`` (all
    foreground classes as one) or a class/region name; ``dice_before``/``dice_after``: the mean foreground Dice
    (foreground step) or that class's mean Dice (class step), without and with the step."""

    target: str
    dice_before: float | None
    dice_after: float | None
    applied: bool


@dataclass(frozen=True)
class InferenceChoice(Artifact):
    """``inference.json`` (``schema_version`` 1). The model to predict with: ``configurations`` (one, or two
    whose probabilities are averaged per case before the label map is made: argmax, or regions at 0.5), each
    with ``folds`` (the folds' models averaged, as ``autoseg predict`` does) and ``checkpoint``; then
    ``postprocessing`` on the label map (``autoseg.predict.postprocessing.apply_postprocessing``).

    The figures behind the choice: ``cv_dice`` / ``class_dice`` (mean foreground Dice and per class or region,
    cross-validation over every validation case of ``folds``) before postprocessing, ``cv_dice_postprocessed`` /
    ``class_dice_postprocessed`` after it, ``steps`` (every postprocessing step tried) and ``candidates`` (every
    candidate's mean foreground Dice; names like ``3d_fullres`` or ``2d+3d_fullres``)."""

    configurations: tuple[str, ...]
    folds: tuple[int, ...]
    checkpoint: str
    postprocessing: Postprocessing
    cv_dice: float | None
    cv_dice_postprocessed: float | None
    class_dice: dict[str, float | None]
    class_dice_postprocessed: dict[str, float | None]
    steps: tuple[PostprocessingStep, ...]
    candidates: dict[str, float | None]
    num_cases: int  # validation cases the figures are over

    SCHEMA_VERSION = 1
    KIND = "inference choice"

    @property
    def is_ensemble(self) -> bool:
        return len(self.configurations) > 1

    def applied(self, folds: tuple[int, ...] | None, checkpoint: str | None) -> InferenceChoice:
        """The choice as a prediction applies it: its folds and checkpoint unless others are given."""
        return replace(self, folds=self.folds if folds is None else folds, checkpoint=checkpoint or self.checkpoint)


def nan_to_none(value: float) -> float | None:
    """JSON has no NaN: an undefined Dice is written as null."""
    return None if math.isnan(value) else float(value)
