"""Training checkpoints: everything a run needs to continue bit for bit, loadable with ``weights_only=True``.

A checkpoint holds the network, optimizer and grad-scaler state dicts, the configuration's name and the plan
configuration it was trained with (JSON text, before degradations: what a resumed run's plan must match), what its
network's input depends on in the plan (``model_input``: ``autoseg.preprocess.plan_fields.model_input_fields``, JSON
text; prediction refuses a plans.json that differs from it), and the
run's ``TrainingProgress`` (``autoseg.train.progress``, JSON text): the last finished epoch, the schedule, the
metrics, EMA and best pseudo-Dice, the degradations (per-rank micro-batches), the time budget's decisions, the
memory checks, the number of processes and the state of every random generator the trainer touches. The data
loaders need no state: the trainer re-creates them at every epoch from ``loader_seed(run seed, epoch,
degradations, rank)``, so a resumed run draws the same batches. Only tensors, numbers, strings, lists and dicts are
stored, so ``torch.load(weights_only=True)`` reads it; the file itself (version, atomic write, a corrupt file
refused by name) is ``autoseg.model.checkpoint_file``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoseg.core.artifacts import ArtifactError, to_dict
from autoseg.core.errors import InputError
from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file
from autoseg.model.step import TrainStep
from autoseg.plan.plans import INFERENCE_ONLY_KEYS, ConfigurationPlan, upgrade_network_payload
from autoseg.preprocess.plan_fields import MODEL_INPUT_KEY
from autoseg.train.progress import PROGRESS_KEY, RngStates, TrainingProgress


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as read back (``load_checkpoint``): the state dicts, what it was trained with, its progress."""

    path: Path
    network: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    grad_scaler: dict[str, Any]
    config_name: str
    plan_configuration: str  # plan_configuration_json of the configuration as planned
    progress: TrainingProgress  # with the generators' states (``rng``)


def loader_seed(run_seed: int, epoch: int, stream: int, generation: int = 0, rank: int = 0) -> int:
    """Seed of a loader: ``stream`` 0 for training, 1 for the pseudo-Dice patches; ``generation`` counts
    the loader rebuilds after out-of-memory degradations; ``rank``: the process of a distributed run (rank 0
    draws what a single process draws). Independent streams via ``SeedSequence``."""
    entropy = [run_seed, epoch, stream, generation] + ([rank] if rank else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def plan_configuration_json(config: ConfigurationPlan) -> str:
    """The configuration as canonical JSON text (what a resumed run must match)."""
    return json.dumps(to_dict(config), sort_keys=True)


def save_checkpoint(
    path: Path,
    step: TrainStep,
    config: ConfigurationPlan,
    config_name: str,
    progress: TrainingProgress,
    model_input: dict[str, Any],
) -> None:
    """Write atomically (temp file, then rename) the step's network, optimizer and grad scaler, ``config`` (the plan's
    configuration as planned, before degradations), ``model_input`` (``model_input_fields``: what prediction checks
    plans.json against) and ``progress`` with the generators' states of this moment."""
    state = {
        "network": step.network.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "grad_scaler": step.scaler.state_dict(),
        "config": config_name,
        "plan_configuration": plan_configuration_json(config),
        MODEL_INPUT_KEY: json.dumps(model_input, sort_keys=True),
        PROGRESS_KEY: replace(progress, rng=RngStates.capture()).to_text(),
    }
    write_checkpoint_file(path, state)


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint`` (``weights_only=True``), or by a trainer that kept the
    progress under separate keys (``TrainingProgress.from_checkpoint``)."""
    if not path.is_file():
        raise InputError(f"{path} not found: nothing to resume; start the fold without --resume")
    state = read_checkpoint_file(
        path, f"copy one of them onto {path.name} to resume from it, or train the fold again without --resume"
    )
    progress = TrainingProgress.from_checkpoint(state, path)
    if progress.rng is None:
        raise ArtifactError(
            f"{path}: its training progress has no random generator states, so a resumed run could not draw what "
            "the interrupted one would have; resume from another checkpoint of the fold, or train it again without "
            "--resume"
        )
    return Checkpoint(
        path,
        state["network"],
        state["optimizer"],
        state["grad_scaler"],
        state["config"],
        state["plan_configuration"],
        progress,
    )


def check_same_plan(checkpoint: Checkpoint, config: ConfigurationPlan, config_name: str) -> None:
    """Raise ``ValueError`` naming the fields where plans.json's configuration differs from the checkpoint's."""
    path = checkpoint.path
    if checkpoint.config_name != config_name:
        raise InputError(f"{path} belongs to configuration {checkpoint.config_name!r}, not {config_name!r}")
    saved, now = json.loads(checkpoint.plan_configuration), json.loads(plan_configuration_json(config))
    upgrade_network_payload(saved.get("network", {}))  # a checkpoint written before plans schema 3
    for key in INFERENCE_ONLY_KEYS:  # training does not read them (and checkpoints before plans schema 4 lack them)
        saved.pop(key, None)
        now.pop(key, None)
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if changed:
        details = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:4])
        raise InputError(
            f"plans.json's configuration {config_name!r} differs from the one {path} was trained "
            f"with ({details}); restore the plan, or train the fold again without --resume"
        )
