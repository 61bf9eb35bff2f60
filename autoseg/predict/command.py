"""``autoseg predict`` as one call: ``predict_command`` takes the command's request (``PredictRequest``) and predicts
from a workspace (``-w``) or a model archive (``-m``: checked, unpacked as a temporary workspace and removed
afterwards, ``autoseg.predict.archive_reader.open_model_archive``) through the same ``predict_in_workspace``: without a
configuration asked, a workspace with ``inference.json`` is followed (``autoseg.predict.chosen``), else one
configuration is predicted (``autoseg.predict.predictor.predict``). What the model is, and how it is resolved, is
``autoseg.predict.segmenter``'s (``opened_model``, ``followed_choice``), as ``Segmenter.load`` resolves it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from autoseg.core.workspace import Workspace
from autoseg.predict.chosen import predict_chosen
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.predict.segmenter import fold_numbers, followed_choice, opened_model
from autoseg.predict.window import WindowOptions


@dataclass(frozen=True)
class PredictRequest:
    """What ``autoseg predict`` is asked: where the model is (``workspace``, or a ``model`` archive), the inputs and
    the output folder, which configuration, folds (``--folds`` as given: numbers or "all") and checkpoint (None:
    inference.json's, else the plan's default, every trained fold, final), how the sliding window runs and what else
    predict does."""

    inputs: str | Path
    output_dir: str | Path
    workspace: str | Path = "."
    model: str | Path | None = None  # a model archive from `autoseg export-model`, instead of the workspace
    config_name: str | None = None
    folds: tuple[str, ...] | None = None
    checkpoint: str | None = None
    window: WindowOptions = WindowOptions()
    options: PredictOptions = PredictOptions()


def predict_command(request: PredictRequest) -> list[Path]:
    """The label maps ``autoseg predict`` writes for ``request``: from its model archive (its configuration, the
    requested folds if it holds them, its checkpoint) or from its workspace (``opened_model``), each through
    ``predict_in_workspace``."""
    with opened_model(request.workspace, request.model, request.config_name, request.folds, request.checkpoint) as (
        workspace,
        config,
        folds,
        checkpoint,
    ):
        return predict_in_workspace(workspace, replace(request, config_name=config, folds=folds, checkpoint=checkpoint))


def predict_in_workspace(workspace: Workspace, request: PredictRequest) -> list[Path]:
    """Predict ``request`` with ``workspace``'s model: following its inference.json (``autoseg find-best``'s
    configuration or ensemble, folds, checkpoint and postprocessing; said on stdout) when no configuration is asked
    and it has one (``followed_choice``), else the asked configuration (or the plan's default) without
    postprocessing."""
    folds = fold_numbers(request.folds)
    if (choice := followed_choice(workspace, request.config_name)) is not None:
        print(
            f"following {workspace.inference_path}: {' + '.join(choice.configurations)}, fold(s) "
            f"{' '.join(map(str, folds or choice.folds))}, postprocessing: {choice.postprocessing.describe()} "
            "(-c CONFIG predicts one configuration without it)"
        )
        return predict_chosen(
            workspace,
            choice,
            request.inputs,
            request.output_dir,
            folds=folds,
            checkpoint=request.checkpoint,
            window=request.window,
            options=request.options,
        )
    return predict(
        workspace,
        request.inputs,
        request.output_dir,
        config_name=request.config_name,
        folds=folds,
        checkpoint=request.checkpoint or "final",
        window=request.window,
        options=request.options,
    )
