"""Training checkpoints: everything a run needs to continue bit for bit, loadable with ``weights_only=True``.

A checkpoint holds the network, optimizer and grad-scaler state dicts, the schedule position (``epoch``:
the last finished epoch; ``schedule``: total epochs and iterations per epoch), the EMA and best pseudo-Dice,
the metrics so far (JSON text), the degradations made after out-of-memory errors (per-rank micro-batches),
the memory checks of the run so far (``autoseg.train.memory_check``, JSON text), the number of processes
(``world_size``), the plan configuration it was trained with (JSON text) and the
state of every random generator the trainer touches (torch CPU and CUDA, numpy's global and Python's
``random``). The data loaders need no state: the trainer re-creates them at every epoch from
``loader_seed(run seed, epoch, degradations, rank)``, so a resumed run draws the same batches.
Only tensors, numbers, strings, lists and dicts are stored, so ``torch.load(weights_only=True)`` reads it;
the file itself (version, atomic write, a corrupt file refused by name) is ``autoseg.model.checkpoint_file``'s.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoseg.core.artifacts import to_dict
from autoseg.core.errors import InputError
from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file
from autoseg.plan.plans import INFERENCE_ONLY_KEYS, ConfigurationPlan, upgrade_network_payload


def loader_seed(run_seed: int, epoch: int, stream: int, generation: int = 0, rank: int = 0) -> int:
    """Seed of a loader: ``stream`` 0 for training, 1 for the pseudo-Dice patches; ``generation`` counts
    the loader rebuilds after out-of-memory degradations; ``rank``: the process of a distributed run (rank 0
    draws what a single process draws). Independent streams via ``SeedSequence``."""
    entropy = [run_seed, epoch, stream, generation] + ([rank] if rank else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def plan_configuration_json(config: ConfigurationPlan) -> str:
    """The configuration as canonical JSON text (what a resumed run must match)."""
    return json.dumps(to_dict(config), sort_keys=True)


def rng_states() -> dict[str, Any]:
    """The state of every global generator, as tensors and plain lists."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["torch_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(
    path: Path,
    network: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    config: ConfigurationPlan,
    config_name: str,
    progress: dict[str, Any],
) -> None:
    """Write atomically (temp file, then rename). ``config``: the plan's configuration as planned (before
    degradations); ``progress``: epoch, schedule, ema / best_ema, metrics, degradations, time_budget."""
    state = {
        "network": network.state_dict(),
        "optimizer": optimizer.state_dict(),
        "grad_scaler": scaler.state_dict(),
        "config": config_name,
        "plan_configuration": plan_configuration_json(config),
        "epoch": int(progress["epoch"]),
        "schedule": dict(progress["schedule"]),
        "ema_dice": -1.0 if progress["ema"] is None else float(progress["ema"]),
        "best_ema_dice": float(progress["best_ema"]),
        "metrics_json": json.dumps(progress["metrics"]),
        "degradations_json": json.dumps(progress["degradations"]),
        "time_budget_json": json.dumps(progress.get("time_budget")),
        "world_size": int(progress.get("world_size", 1)),
        "memory_checks_json": json.dumps(progress.get("memory_checks", [])),
        "rng": rng_states(),
    }
    write_checkpoint_file(path, state)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (``weights_only=True``); JSON fields decoded."""
    if not path.is_file():
        raise InputError(f"{path} not found: nothing to resume; start the fold without --resume")
    state = read_checkpoint_file(
        path, f"copy one of them onto {path.name} to resume from it, or train the fold again without --resume"
    )
    state["metrics"] = json.loads(state.pop("metrics_json"))
    state["degradations"] = json.loads(state.pop("degradations_json"))
    state["time_budget"] = json.loads(state.pop("time_budget_json"))
    state["ema"] = None if state["ema_dice"] < 0 else state["ema_dice"]
    state.setdefault("world_size", 1)  # written before distributed training
    state["memory_checks"] = json.loads(state.pop("memory_checks_json", "[]"))  # written before memory checks
    return state


def check_same_plan(state: dict[str, Any], config: ConfigurationPlan, config_name: str, path: Path) -> None:
    """Raise ``ValueError`` naming the fields where plans.json's configuration differs from the checkpoint's."""
    if state["config"] != config_name:
        raise InputError(f"{path} belongs to configuration {state['config']!r}, not {config_name!r}")
    saved, now = json.loads(state["plan_configuration"]), json.loads(plan_configuration_json(config))
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
