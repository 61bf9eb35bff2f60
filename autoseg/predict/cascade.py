"""A cascade stage's prediction (``3d_cascade_fullres``, ``ConfigurationPlan.previous_stage`` ``3d_lowres``).

Per case: the previous stage predicts first (its own preprocessing, the same folds, checkpoint and sliding-window
settings), and its label map is exported to the image's grid as any prediction is (unpostprocessed); that map is put
on the cascade's preprocessed grid as a training label is (``labels_on_grid``: crop, each label resampled linearly)
and one-hot encoded (``LabelScheme.one_hot``: one channel per predicted foreground value, 0/1) after the image's
channels (``cascade_input``); then the cascade's own sliding window. Training builds its inputs from the previous
stage's final-validation label maps (``autoseg.train.fold_data``) by the same two steps, so a network sees at
prediction what it was trained on.

In ``predict`` (``CascadePrediction``): both preprocessings run on the read-ahead threads (``prepare``); the previous
stage's sliding window runs on the main thread just before the cascade's (``segment_with``), never beside it, so
the device holds one sliding window at a time. Host memory: ``autoseg.predict.pipeline.case_memory`` with
``previous`` (``autoseg.memory.host.cascade_input_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.labels import one_hot
from autoseg.dataset.raw import Case, load_case
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.networks import Predictor
from autoseg.predict.runners import load_predictor
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.preprocessor import labels_on_grid, preprocess_case
from autoseg.preprocess.store import CaseProperties


def cascade_input(
    data: np.ndarray, previous: np.ndarray | None, props: CaseProperties, plans: Plans, config: ConfigurationPlan
) -> np.ndarray:
    """The network input of a cascade stage, float32 (C + K, Z', Y', X'): the preprocessed image ``data``
    (C, Z', Y', X'), then the one-hot of ``previous``, the previous stage's label map (Z, Y, X) in the image's
    original grid, put on the preprocessed grid (``props``) first. K = ``len(plans.previous_stage_values(config))``."""
    if previous is None:
        raise InputError(
            f"{config.name} takes {config.previous_stage}'s predicted label map of case "
            f"{props.case_id!r} as input; none was given"
        )
    values = plans.previous_stage_values(config)
    on_grid = labels_on_grid(previous, props)[0]
    out = np.empty((data.shape[0] + len(values), *data.shape[1:]), dtype=np.float32)  # (C + K) x V' x 4 bytes
    out[: data.shape[0]] = data
    one_hot(on_grid, values, out=out[data.shape[0] :])
    return out


@dataclass(frozen=True)
class CascadeCase:
    """A case read and preprocessed for both stages (``CascadePrediction.prepare``)."""

    image: np.ndarray  # (C, Z', Y', X') float32, preprocessed for the cascade stage
    previous_image: np.ndarray  # (C, z, y, x) float32, preprocessed for the previous stage
    previous_props: CaseProperties


@dataclass(frozen=True)
class CascadePrediction:
    """The previous stage of a cascade stage's prediction: its ``Predictor`` (its plan, its folds' runners, the
    command's window options) and ``labels``, ``autoseg.predict.case.predict_labels``: (preprocessed image, its
    properties, case id, predictor) -> the label map (Z, Y, X) in the image's grid."""

    config: ConfigurationPlan  # the cascade stage
    previous: Predictor  # its previous stage
    labels: Callable[..., np.ndarray]

    @property
    def plans(self) -> Plans:
        return self.previous.plans

    @property
    def stage(self) -> ConfigurationPlan:
        return self.previous.config

    @classmethod
    def load(
        cls,
        workspace: Workspace,
        cascade: Predictor,
        folds: tuple[int, ...],
        checkpoint: str,
        labels: Callable[..., np.ndarray],
        window: WindowOptions,
    ) -> CascadePrediction:
        """The previous stage's networks of ``folds`` for ``cascade``'s stage, with the command's ``window`` (an
        ``auto`` runtime or precision is chosen for this stage's own model); refused, naming them, when one is not
        trained."""
        config, plans = cascade.config, cascade.plans
        stage = plans.configuration(config.previous_stage)
        missing = [f for f in folds if not workspace.checkpoint(stage.name, f, checkpoint).is_file()]
        if missing:
            listed = " ".join(map(str, missing))
            raise InputError(
                f"{config.name} predicts with {stage.name} first, with the same folds ({list(folds)}): "
                f"{stage.name} fold(s) {listed} have no checkpoint_{checkpoint}.pt; train them "
                f"(`autoseg train fold {listed} -c {stage.name} -w {workspace.root}`) or predict with "
                "--folds naming folds both stages have"
            )
        return cls(config, load_predictor(workspace, plans, stage, folds, checkpoint, window), labels)

    def prepare(self, case: Case) -> tuple[CascadeCase, CaseProperties]:
        """Read ``case`` and preprocess it for both stages (``prepare_image``)."""
        image, _, geometry = load_case(case)
        return self.prepare_image(image, geometry, case.case_id)

    def prepare_image(self, image: np.ndarray, geometry: Geometry, case_id: str) -> tuple[CascadeCase, CaseProperties]:
        """``image`` (C, Z, Y, X) float32 preprocessed for both stages (``preprocess_case`` copies what it crops: the
        image serves both)."""
        low, _, low_props = preprocess_case(image, None, geometry, self.plans, self.stage, case_id)
        data, _, props = preprocess_case(image, None, geometry, self.plans, self.config, case_id)
        return CascadeCase(data, low, low_props), props

    def input_of(self, prepared: CascadeCase, props: CaseProperties, case_id: str) -> np.ndarray:
        """The cascade's network input of a prepared case: the previous stage's label map, then ``cascade_input``."""
        labels = self.labels(prepared.previous_image, prepared.previous_props, case_id, self.previous)
        return cascade_input(prepared.image, labels, props, self.plans, self.config)

    def segment_with(self, segment: Callable[..., Callable[[], None]]) -> Callable[..., Callable[[], None]]:
        """``segment`` (the cascade's own: a preprocessed input, its properties, the case id, the output paths)
        preceded by the previous stage's label map and ``cascade_input`` (``input_of``)."""

        def run(prepared: CascadeCase, props: CaseProperties, case_id: str, *outputs: Any) -> Callable[[], None]:
            return segment(self.input_of(prepared, props, case_id), props, case_id, *outputs)

        return run
