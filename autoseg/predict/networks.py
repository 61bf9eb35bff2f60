"""The trained networks a prediction runs: each fold's checkpoint loaded into the planned network, run as tile
runners (``torch_runners``: ``autoseg.model.torch_runner.TorchTileRunner``, their working bytes the memory model's
simulation of their tile batch), and a ``Predictor``: one configuration's runners with its plan and the command's
window options, what every case-level function of ``autoseg.predict.case`` takes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.memory.inference import TileSimulation
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.tile_runner import TileRunner
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.plan_fields import MODEL_INPUT_KEY, field_changes, model_input_fields

log = logging.getLogger("autoseg")
SHOWN_CHANGES = 6


def load_trained_network(
    checkpoint_path: Path, plans: Plans, config: ConfigurationPlan, device: str
) -> torch.nn.Module:
    """``config``'s network with the weights of ``checkpoint_path``, in eval mode on ``device``; refused when the
    checkpoint is missing or unreadable, its weights do not fit, or it was trained with another plan
    (``check_trained_with``)."""
    if not checkpoint_path.is_file():
        raise InputError(f"{checkpoint_path} not found; train this fold first, or predict with --folds naming others")
    state = read_checkpoint_file(
        checkpoint_path,
        "predict with --checkpoint naming another one (best, final, latest), or train this fold again",
        mmap=True,
    )  # reads the weights only
    if not isinstance(state, dict) or not isinstance(state.get("network"), dict):
        raise InputError(
            f"{checkpoint_path}: holds no network weights; train this fold again or predict with another --checkpoint"
        )
    check_trained_with(state, plans, config, checkpoint_path)
    network = build_network(config.network)
    try:
        network.load_state_dict(state["network"])
    except (RuntimeError, TypeError) as e:  # missing, unexpected or mis-shaped weights
        raise InputError(
            f"{checkpoint_path}: its weights do not fit the planned network of {config.name} "
            f"({str(e).splitlines()[0]}); it was trained with another plan: train this fold "
            "again, or predict with the workspace it was trained in"
        ) from e
    return network.to(device).eval()


def check_trained_with(state: dict, plans: Plans, config: ConfigurationPlan, path: Path) -> None:
    """Refuse, naming the fields, a checkpoint (``state``, read from ``path``) whose record of the plan it was trained
    with (``model_input_fields``) differs from ``plans``: a hand-edited normalization, spacing or network would feed it
    inputs it never learned from, and its outputs would no longer be the model's. A checkpoint written before the
    record existed is predicted as before, with a warning that it cannot be checked."""
    recorded = state.get(MODEL_INPUT_KEY)
    if recorded is None:
        log.warning(
            "%s was written before autoseg recorded the plan a fold is trained with: plans.json's normalization, "
            "spacing and network cannot be checked against it (a fold trained again is checked)",
            path,
        )
        return
    try:
        trained_with = json.loads(recorded)
    except (TypeError, ValueError) as e:
        raise InputError(f"{path}: its record of the plan it was trained with is not JSON ({e}); train it again") from e
    changes = field_changes(trained_with, model_input_fields(plans, config.name))
    if changes:
        raise InputError(
            f"{path}: {path.parent.name.replace('_', ' ')} of {config.name} was trained with another plan than "
            f"plans.json holds now ({'; '.join(changes[:SHOWN_CHANGES])}"
            f"{f'; and {len(changes) - SHOWN_CHANGES} more' if len(changes) > SHOWN_CHANGES else ''}): its input would "
            "not be what it learned from; restore these values in plans.json, or train the fold again with the plan as "
            "it is"
        )


def load_networks(
    workspace: Workspace,
    plans: Plans,
    config: ConfigurationPlan,
    folds: tuple[int, ...],
    checkpoint: str,
    device: str,
) -> list[torch.nn.Module]:
    """``config``'s network of each of ``folds`` (``results/<config>/fold_<k>/checkpoint_<checkpoint>.pt``); a fold
    without that checkpoint is refused, advising the command that trains it."""
    for fold in folds:
        if not (path := workspace.checkpoint(config.name, fold, checkpoint)).is_file():
            raise InputError(
                f"{path} not found; train this fold first (`{workspace.advice(f'train fold {fold} -c {config.name}')}`)"
                " or predict with --folds naming trained ones"
            )
    return [
        load_trained_network(workspace.checkpoint(config.name, f, checkpoint), plans, config, device) for f in folds
    ]


def tile_simulation(config: ConfigurationPlan, window: WindowOptions) -> TileSimulation:
    """The memory model's simulation of ``config``'s tile batch as ``window``'s sliding window runs it (its
    precision, mirror variants and accumulator): what a runner reports as its working bytes (``TileSimulation``)."""
    return TileSimulation(
        config.network,
        window.compute_precision(config),
        window.mirror_axes(config),
        window.num_variants(config),
        window.accumulator,
        window.device,
    )


def torch_runners(
    networks: list[torch.nn.Module], config: ConfigurationPlan, window: WindowOptions
) -> tuple[TorchTileRunner, ...]:
    """``networks`` (``config``'s folds, on ``window.device``) as tile runners in ``window``'s precision for
    ``config``; each reports the memory model's simulation of its tile batch (``tile_simulation``) when the memory
    plan asks for its working bytes."""
    simulation = tile_simulation(config, window)
    device = torch.device(window.device)
    return tuple(TorchTileRunner(n, device, simulation.precision, simulation) for n in networks)


@dataclass(frozen=True)
class Predictor:
    """One configuration's folds ready to predict: their tile runners (one ensemble: each tile runs through every
    fold and their logits are averaged), the plan, the configuration and the command's window options.
    ``class_weights``: the folds' class decision weights (``autoseg.predict.class_weights.fold_weights``, one factor
    per output for the label map's argmax), None where they have none (and in a fold's own validation)."""

    runners: tuple[TileRunner, ...]
    plans: Plans
    config: ConfigurationPlan
    window: WindowOptions
    class_weights: np.ndarray | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls, networks: list[torch.nn.Module], plans: Plans, config: ConfigurationPlan, window: WindowOptions
    ) -> Predictor:
        """``networks`` (``config``'s folds, on ``window.device``) as torch runners (``torch_runners``)."""
        return cls(torch_runners(networks, config, window), plans, config, window)
