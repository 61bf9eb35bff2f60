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
from pathlib import Path

import torch

from autoseg.core.machine import MachineCache, kept_simulations
from autoseg.core.workspace import Workspace
from autoseg.model.graph_runners import GRAPH_RUNNERS
from autoseg.model.tile_runner import TileRunner
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.archive import MANIFEST, ModelManifest
from autoseg.predict.graphs import cached_graph, graph_member
from autoseg.predict.networks import Predictor, load_networks, tile_simulation
from autoseg.predict.window import WindowOptions

log = logging.getLogger("autoseg")


def load_predictor(
    workspace: Workspace,
    plans: Plans,
    config: ConfigurationPlan,
    folds: tuple[int, ...],
    checkpoint: str,
    window: WindowOptions,
) -> Predictor:
    """``config``'s folds (``checkpoint_<checkpoint>.pt`` of each of ``folds`` in ``workspace``) as a ``Predictor``
    running ``window.runtime`` in ``window.compute_precision(config)``; a fold without that checkpoint is refused
    (``load_networks``)."""
    networks = load_networks(workspace, plans, config, folds, checkpoint, window.device)
    if window.runtime == "torch":
        return Predictor.of(networks, plans, config, window)
    del networks  # loaded to check each fold's checkpoint and plan; the graphs run instead
    simulation = tile_simulation(config, window)  # the runtime's own working bytes are not measured yet
    precision = simulation.precision
    runner_type = GRAPH_RUNNERS[window.runtime]
    cache = kept_simulations() or MachineCache(None)  # the command's cache folder
    runners: list[TileRunner] = []
    for fold in folds:
        what = f"fold {fold} of {config.name}"
        graph = fold_graph(workspace, plans, config, workspace.checkpoint(config.name, fold, checkpoint), cache)
        runners.append(runner_type(graph, simulation, torch.get_num_threads(), precision, what))
    log.info(
        "%s runs %d fold(s) with %s in %s, %d thread(s)",
        config.name,
        len(runners),
        window.runtime,
        precision,
        torch.get_num_threads(),
    )
    return Predictor(tuple(runners), plans, config, window)


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
