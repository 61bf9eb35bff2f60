from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from extras import require_extra

from autoseg.core.errors import RunError
from autoseg.core.machine import MachineCache
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import export_graph
from autoseg.plan.plans import Plans
from autoseg.predict import graphs
from autoseg.predict.graphs import CACHE_FOLDER, cached_graph, check_tiles, checked_graph

require_extra("onnx")
CONFIG = "3d_fullres"


@pytest.fixture()
def workspace(trained: Path, tmp_path: Path) -> Workspace:
    return Workspace.at(shutil.copytree(trained, tmp_path / "ws"))


def _exports(monkeypatch) -> list[int]:
    """Count the graphs exported from now on."""
    calls: list[int] = []

    def counted(network, example):
        calls.append(1)
        return export_graph(network, example)

    monkeypatch.setattr(graphs, "export_graph", counted)
    return calls


def test_the_check_tiles_are_patches_of_a_preprocessed_case(trained: Path):
    ws = Workspace.at(trained)
    config = Plans.from_json(ws.plans_path).configuration(CONFIG)
    tiles = check_tiles(ws, config)
    assert tiles.shape == (2, 1, *config.patch_size) and tiles.dtype == torch.float32
    assert tiles.std() > 0.1  # real, normalized intensities: not the zero padding


def test_without_a_preprocessed_case_the_check_tiles_are_seeded_noise_of_a_cases_scale(workspace: Workspace):
    config = Plans.from_json(workspace.plans_path).configuration(CONFIG)
    shutil.rmtree(workspace.preprocessed(CONFIG))  # as in a model archive
    tiles = check_tiles(workspace, config)
    assert tiles.shape == (2, 1, *config.patch_size) and tiles.dtype == torch.float32
    assert abs(float(tiles.std()) - 1) < 0.1 and torch.equal(tiles, check_tiles(workspace, config))


def test_a_checkpoints_graph_is_kept_in_the_machine_cache_until_the_checkpoint_changes(
    workspace, tmp_path, monkeypatch
):
    plans = Plans.from_json(workspace.plans_path)
    config, path = plans.configuration(CONFIG), workspace.checkpoint(CONFIG, 0, "final")
    cache, exports = MachineCache(tmp_path / "cache"), _exports(monkeypatch)
    first = cached_graph(workspace, plans, config, path, cache)
    assert cached_graph(workspace, plans, config, path, cache) == first and len(exports) == 1
    assert len(list((tmp_path / "cache" / CACHE_FOLDER).iterdir())) == 1
    assert not list(workspace.root.rglob("*.onnx"))  # never written to the workspace

    state = read_checkpoint_file(path, "")
    state["network"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in state["network"].items()}
    write_checkpoint_file(path, state)
    changed = cached_graph(workspace, plans, config, path, cache)
    assert len(exports) == 2 and changed != first


def test_a_graph_that_computes_otherwise_fails_the_export_naming_the_fold_and_figures(trained: Path, monkeypatch):
    ws = Workspace.at(trained)
    plans = Plans.from_json(ws.plans_path)
    config = plans.configuration(CONFIG)
    monkeypatch.setattr(
        graphs, "export_graph", lambda net, example: export_graph(build_network(config.network), example)
    )
    with pytest.raises(RunError, match=r"ONNX graph of fold 0 of 3d_fullres .* differ .* argmax agrees on"):
        checked_graph(ws.checkpoint(CONFIG, 0, "final"), plans, config, check_tiles(ws, config), "fold 0 of 3d_fullres")
