"""The trained networks a prediction runs: each fold's checkpoint loaded into the planned network."""

from __future__ import annotations

from pathlib import Path

import torch

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.model.network import build_network
from autoseg.plan.plans import ConfigurationPlan


def load_trained_network(checkpoint_path: Path, config: ConfigurationPlan, device: str) -> torch.nn.Module:
    if not checkpoint_path.is_file():
        raise InputError(f"{checkpoint_path} not found; train this fold first (`autoseg train fold N`)")
    state = read_checkpoint_file(
        checkpoint_path,
        "predict with --checkpoint naming another one (best, final, latest), or train this fold again",
        mmap=True,
    )  # reads the weights only
    if not isinstance(state, dict) or not isinstance(state.get("network"), dict):
        raise InputError(
            f"{checkpoint_path}: holds no network weights; train this fold again or predict with another --checkpoint"
        )
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


def load_networks(
    workspace: Workspace, config: ConfigurationPlan, folds: tuple[int, ...], checkpoint: str, device: str
) -> list[torch.nn.Module]:
    """``config``'s network of each of ``folds`` (``results/<config>/fold_<k>/checkpoint_<checkpoint>.pt``)."""
    return [load_trained_network(workspace.checkpoint(config.name, f, checkpoint), config, device) for f in folds]
