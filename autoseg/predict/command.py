"""``autoseg predict`` as one call: ``predict_command`` takes the command's request (``PredictRequest``) and predicts
from a workspace (``-w``) or a model archive (``-m``: checked, unpacked as a temporary workspace and removed
afterwards, ``autoseg.predict.archive_reader.open_model_archive``) through the same ``predict_in_workspace``: without a
configuration asked, a workspace with ``inference.json`` is followed (``autoseg.predict.chosen``), else one
configuration is predicted (``autoseg.predict.predictor.predict``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from autoseg.core.lock import refuse_while_held
from autoseg.core.workspace import Workspace
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.chosen import predict_chosen
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.predict.window import WindowOptions

READS = "`autoseg predict -w` reads the plan and the trained folds (`-m MODEL.zip` reads an exported model instead)"


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
    requested folds if it holds them, its checkpoint; ``OpenedModel.select``) or from its workspace, each through
    ``predict_in_workspace``. A workspace whose plan and folds `plan_and_preprocess --overwrite` is replacing is
    refused naming it (``autoseg.core.lock``): each file is replaced whole, but not all of them at once."""
    if request.model is None:
        workspace = Workspace.at(request.workspace)
        refuse_while_held(workspace.plan_lock, workspace.root, READS, only_replacing=True)
        return predict_in_workspace(workspace, request)
    with open_model_archive(request.model, load_checkpoints=False) as model:  # predict loads them: read once
        config, folds = model.select(request.config_name, None if request.folds is None else list(request.folds))
        archived = replace(
            request,
            config_name=config,
            folds=None if folds is None else tuple(folds),
            checkpoint=model.manifest.checkpoint,
        )
        return predict_in_workspace(model.workspace, archived)


def predict_in_workspace(workspace: Workspace, request: PredictRequest) -> list[Path]:
    """Predict ``request`` with ``workspace``'s model: following its inference.json (``autoseg find-best``'s
    configuration or ensemble, folds, checkpoint and postprocessing; said on stdout) when no configuration is asked
    and it has one, else the asked configuration (or the plan's default) without postprocessing."""
    folds = None if request.folds is None else tuple(int(f) if f.isdigit() else f for f in request.folds)
    if request.config_name is None and workspace.inference_path.is_file():
        choice = InferenceChoice.from_json(workspace.inference_path)
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
