"""What runs a configuration's folds in ``autoseg predict``: ``load_predictor`` builds one ``Predictor`` whose tile
runners are the command's ``--runtime`` (``WindowOptions.runtime``) in its precision (``WindowOptions.
compute_precision``): torch modules (``autoseg.predict.networks.torch_runners``), or each fold's checked ONNX graph
run by ONNX Runtime or OpenVINO (``autoseg.model.graph_runners``). The sliding window, TTA, the accumulator and the
export that follow are the same code for every runtime.

Where a fold's graph comes from (``fold_graph``): an unpacked model archive's own (``results/<config>/fold_<k>/
network.onnx``, listed in its manifest and checked when the archive was opened); else the machine cache's, made from
the checkpoint on first use and checked against torch (``autoseg.predict.graphs.cached_graph``), never written to
the workspace. An archive exported without the onnx extra therefore runs a graph runtime too.

A graph runner compiles with the thread count torch has when it is built: ``predict`` sets prediction's threads
(``autoseg.core.machine.use_cpu_threads``) before calling ``load_predictor``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from autoseg.core.errors import InputError
from autoseg.core.machine import MachineCache, kept_simulations, machine_key
from autoseg.core.precision import native_bf16_flag
from autoseg.core.workspace import Workspace
from autoseg.model.graph_runners import GRAPH_RUNNERS
from autoseg.model.tile_runner import TileRunner
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.archive import MANIFEST, ModelManifest
from autoseg.predict.class_weights import fold_weights
from autoseg.predict.graphs import cached_graph, file_digest, graph_member
from autoseg.predict.networks import Predictor, load_networks, tile_simulation, torch_runners
from autoseg.predict.precision_check import checkpoint_bf16_verdict
from autoseg.predict.runtime_choice import (
    CHOICE_VERSION,
    Candidate,
    RuntimeChoice,
    candidates,
    runtime_versions,
    time_candidates,
    timing_tiles,
)
from autoseg.predict.runtime_memory import RuntimeWorkingBytes
from autoseg.predict.window import AUTO, WindowOptions

log = logging.getLogger("autoseg")


@dataclass(frozen=True)
class LoadedFold:
    """One fold of ``config`` in ``workspace``: its checkpoint's path and its network, loaded once (checked against
    the plan: ``load_trained_network``); every runner of the fold is built from it (``runner``)."""

    workspace: Workspace
    plans: Plans
    config: ConfigurationPlan
    path: Path  # results/<config>/fold_<k>/checkpoint_<which>.pt
    network: torch.nn.Module

    @property
    def what(self) -> str:
        """The fold as messages name it: "fold 0 of 3d_fullres"."""
        return f"{self.path.parent.name.replace('_', ' ')} of {self.config.name}"

    def runner(self, window: WindowOptions) -> TileRunner:
        """The fold as ``window.runtime`` runs it, in ``window``'s precision, with torch's thread count; its working
        bytes are, for torch, the memory model's simulation of its tile batch (``tile_simulation``), for a graph
        runtime that runtime's own, measured in a fresh process and kept (``RuntimeWorkingBytes``: a
        configuration's folds share the measurement, their graphs differing in their weights only)."""
        if window.runtime == "torch":
            return torch_runners([self.network], self.config, window)[0]
        simulation = tile_simulation(self.config, window)
        cache = kept_simulations() or MachineCache(None)
        graph = fold_graph(self.workspace, self.plans, self.config, self.path, cache)
        threads = torch.get_num_threads()
        measured = RuntimeWorkingBytes(graph, window.runtime, threads, simulation, cache)
        return GRAPH_RUNNERS[window.runtime](graph, measured, threads, simulation.precision, self.what)


def load_predictor(
    workspace: Workspace,
    plans: Plans,
    config: ConfigurationPlan,
    folds: tuple[int, ...],
    checkpoint: str,
    window: WindowOptions,
) -> Predictor:
    """``config``'s folds (``checkpoint_<checkpoint>.pt`` of each of ``folds`` in ``workspace``, each loaded once)
    as a ``Predictor`` running ``window.runtime`` in ``window.compute_precision(config)``, ``auto`` ones chosen
    first (``resolve_auto``; the predictor's window holds the choice). A fold without that checkpoint, or trained
    with another plan, is refused (``load_networks``)."""
    networks = load_networks(workspace, plans, config, folds, checkpoint, window.device)
    loaded = [
        LoadedFold(workspace, plans, config, workspace.checkpoint(config.name, fold, checkpoint), network)
        for fold, network in zip(folds, networks)
    ]
    del networks  # a graph runtime's runners do not hold them
    window = resolve_auto(loaded, window)
    runners = tuple(fold.runner(window) for fold in loaded)
    log.info(
        "%s runs %d fold(s) with %s in %s, %d thread(s)",
        config.name,
        len(runners),
        window.runtime,
        window.compute_precision(config),
        torch.get_num_threads(),
    )
    return Predictor(runners, plans, config, window, fold_weights([f.path for f in loaded], plans.label_scheme))


def resolve_auto(loaded: Sequence[LoadedFold], window: WindowOptions) -> WindowOptions:
    """``window`` with ``--runtime auto`` and ``--precision auto`` made concrete for the ``loaded`` folds: on CUDA,
    torch in the plan's precision; on the CPU, the fastest candidate timed on this machine with the first fold
    (``autoseg.predict.runtime_choice``; bf16 only where every fold's agreement check allows it), said on stdout."""
    if AUTO not in (window.runtime, window.precision):
        return window
    if window.device != "cpu":
        return replace(
            window,
            runtime="torch" if window.runtime == AUTO else window.runtime,
            precision=None if window.precision == AUTO else window.precision,
        )
    config = loaded[0].config
    found = candidates(window, native_bf16_flag() is not None)
    found, bf16 = _bf16_eligible(loaded, found)
    if not found:
        raise InputError(
            f"--runtime {window.runtime} --precision {window.precision}: nothing on this machine runs "
            f"{config.name} so ({bf16 or 'no installed runtime computes in that precision'}); predict with "
            "--precision fp32"
        )
    tiles = timing_tiles(config, window)
    if len(found) == 1:
        seconds, source = {found[0].name: math.nan}, "the only candidate: not timed"
    else:
        seconds, source = _timed(loaded[0], window, found, tiles)
    choice = RuntimeChoice.fastest(seconds, found, tuple(tiles.shape), source, bf16)
    log.info("%s: %s", config.name, choice.describe())
    print(f"{config.name}: {choice.describe()}")
    return replace(window, runtime=choice.chosen.runtime, precision=choice.chosen.precision)


def _timed(
    fold: LoadedFold, window: WindowOptions, found: tuple[Candidate, ...], tiles: torch.Tensor
) -> tuple[dict[str, float], str]:
    """Each of ``found`` timed on ``tiles`` with ``fold``'s network (``time_candidates``), kept per machine and
    model in the command's cache; (seconds by candidate name, where they came from)."""
    key = {
        "version": CHOICE_VERSION,
        **machine_key(),
        "checkpoint_sha256": file_digest(fold.path),
        "candidates": [c.name for c in found],
        "tile_batch": list(tiles.shape),
        "threads": torch.get_num_threads(),
        "runtimes": runtime_versions(found),
    }

    def build(candidate: Candidate) -> TileRunner:
        return fold.runner(replace(window, runtime=candidate.runtime, precision=candidate.precision))

    cache = kept_simulations() or MachineCache(None)
    return cache.measured("runtime_seconds", key, lambda: time_candidates(found, build, tiles))


def _bf16_eligible(loaded: Sequence[LoadedFold], found: tuple[Candidate, ...]) -> tuple[tuple[Candidate, ...], str]:
    """``found`` without the bf16 candidates whose runtime some fold's agreement check does not allow
    (``bf16_verdict``), and why bf16 is or is not eligible ("" when no candidate computes in bf16)."""
    runtimes = sorted({c.runtime for c in found if c.precision == "bf16"})
    if not runtimes:
        return found, ""
    refused, said = set(), []
    for runtime in runtimes:
        verdicts = [bf16_verdict(fold, runtime) for fold in loaded]
        allowed = all(ok for ok, _ in verdicts)
        said.append(f"{runtime} {'eligible' if allowed else 'refused'}: {'; '.join(why for _, why in verdicts)}")
        if not allowed:
            refused.add(runtime)
    kept = tuple(c for c in found if c.precision != "bf16" or c.runtime not in refused)
    return kept, " / ".join(said)


def bf16_verdict(fold: LoadedFold, runtime: str) -> tuple[bool, str]:
    """Whether ``fold``'s stored agreement check lets ``runtime`` compute it in bf16, and why
    (``checkpoint_bf16_verdict``: the check beside its checkpoint, made for that very file)."""
    allowed, why = checkpoint_bf16_verdict(fold.path, runtime)
    return allowed, why if fold.what in why else f"{fold.what}: {why}"


def fold_graph(
    workspace: Workspace, plans: Plans, config: ConfigurationPlan, checkpoint_path: Path, cache: MachineCache
) -> bytes:
    """The ONNX graph of the fold whose checkpoint is ``checkpoint_path``: the unpacked archive's member beside it
    when ``workspace`` is an archive that holds one (``archived_graphs``), else ``cached_graph``'s."""
    member = graph_member(checkpoint_path.relative_to(workspace.root).as_posix())
    if member in archived_graphs(workspace):
        return (workspace.root / member).read_bytes()
    return cached_graph(workspace, plans, config, checkpoint_path, cache)


def archived_graphs(workspace: Workspace) -> frozenset[str]:
    """The graph members of the model archive ``workspace`` was unpacked from (its manifest, which
    ``autoseg.predict.archive_reader.open_model_archive`` writes beside them); none in a workspace."""
    path = workspace.root / MANIFEST
    return frozenset(ModelManifest.from_json(path).graphs) if path.is_file() else frozenset()
