"""``predict --runtime``: each graph runtime predicts what torch predicts through the same sliding window, from a
workspace (the graph made once into the machine cache, never into the workspace) and from a model archive (its own
graph); a runtime failing on a tile stops the run naming the runtime and the case; a missing extra is refused
before any work."""

from __future__ import annotations

import logging
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from extras import require_extra

from autoseg.cli.main import main
from autoseg.core.errors import RunError
from autoseg.core.workspace import Workspace
from autoseg.model import graph_runners
from autoseg.model.graph_runners import GRAPH_RUNNERS
from autoseg.predict import graphs, runners
from autoseg.predict.archive import export_model
from autoseg.predict.command import PredictRequest, predict_command
from autoseg.predict.window import WindowOptions

require_extra("onnx")
CONFIG = "3d_fullres"


@pytest.fixture()
def workspace(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "ws"))


def _labels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: sitk.GetArrayFromImage(sitk.ReadImage(str(p))) for p in sorted(folder.glob("*.nii.gz"))}


def _predict(workspace: Path, inputs: Path, out: Path, *flags: str) -> dict[str, np.ndarray]:
    assert main(["predict", "-w", str(workspace), "-i", str(inputs), "-o", str(out), "--tta", "2", *flags]) == 0
    return _labels(out)


@pytest.mark.parametrize("runtime", sorted(GRAPH_RUNNERS))
def test_a_graph_runtime_predicts_what_torch_predicts_and_keeps_its_graph_in_the_cache(
    workspace: Path, inputs: Path, tmp_path: Path, runtime: str, caplog
) -> None:
    require_extra(runtime)
    expected = _predict(workspace, inputs, tmp_path / "torch")
    with caplog.at_level(logging.INFO, logger="autoseg"):
        found = _predict(workspace, inputs, tmp_path / runtime, "--runtime", runtime)
    assert found.keys() == expected.keys() and len(found) == 2
    for name, labels in found.items():
        assert labels.shape == expected[name].shape
        assert np.mean(labels == expected[name]) >= 0.999, name
    assert f"{CONFIG} runs 1 fold(s) with {runtime} in fp32" in caplog.text
    assert not list(workspace.rglob("*.onnx"))  # the graph is the machine cache's, not the workspace's
    assert list((Path(os.environ["AUTOSEG_CACHE_DIR"]) / graphs.CACHE_FOLDER).glob("*.onnx"))


def test_a_model_archive_runs_its_own_graph(workspace: Path, inputs: Path, tmp_path: Path, monkeypatch) -> None:
    require_extra("onnxruntime")
    archive = tmp_path / "model.zip"
    export_model(Workspace.at(workspace), archive)
    assert "results/3d_fullres/fold_0/network.onnx" in zipfile.ZipFile(archive).namelist()
    window = WindowOptions(tta="2", runtime="onnxruntime")
    made: list[Path] = []
    real_cached_graph = runners.cached_graph
    monkeypatch.setattr(runners, "cached_graph", lambda *a: made.append(a[3]) or real_cached_graph(*a))
    predict_command(PredictRequest(inputs, tmp_path / "archived", model=archive, window=window))
    assert made == []  # the archive's graph ran, none was made
    assert _agree(_labels(tmp_path / "archived"), _labels(_predict_torch(workspace, inputs, tmp_path / "torch")))


def _predict_torch(workspace: Path, inputs: Path, out: Path) -> Path:
    _predict(workspace, inputs, out)
    return out


def _agree(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return found.keys() == expected.keys() and all(np.mean(found[k] == expected[k]) >= 0.999 for k in found)


def test_an_archive_exported_without_graphs_makes_them_from_its_checkpoints(
    workspace: Path, inputs: Path, tmp_path: Path, monkeypatch
) -> None:
    require_extra("onnxruntime")
    from autoseg.predict import archive

    monkeypatch.setattr(archive, "with_graphs", lambda: False)
    model = tmp_path / "model.zip"
    export_model(Workspace.at(workspace), model)
    assert not [n for n in zipfile.ZipFile(model).namelist() if n.endswith(".onnx")]
    made: list[Path] = []
    real_cached_graph = runners.cached_graph
    monkeypatch.setattr(runners, "cached_graph", lambda *a: made.append(a[3]) or real_cached_graph(*a))
    window = WindowOptions(tta="2", runtime="onnxruntime")
    predict_command(PredictRequest(inputs, tmp_path / "out", model=model, window=window))
    assert [p.name for p in made] == ["checkpoint_final.pt"]
    assert _agree(_labels(tmp_path / "out"), _labels(_predict_torch(workspace, inputs, tmp_path / "torch")))


def test_a_runtime_failing_on_a_tile_stops_the_run_naming_the_runtime_and_the_case(
    workspace: Path, inputs: Path, tmp_path: Path, monkeypatch
) -> None:
    require_extra("onnxruntime")

    def failing(graph, runtime, threads, precision):
        def run(tiles):
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : out of luck")

        return run

    monkeypatch.setattr(graph_runners, "compile_graph", failing)
    window = WindowOptions(tta="2", runtime="onnxruntime")
    with pytest.raises(RunError, match=r"case demo_005: onnxruntime failed on a tile batch .* of fold 0 of 3d_fullres"):
        predict_command(PredictRequest(inputs, tmp_path / "out", workspace=workspace, window=window))
    assert not list((tmp_path / "out").glob("*.nii.gz"))  # nothing written in place of a label map


def test_asking_for_a_runtime_whose_extra_is_missing_names_the_extra(
    workspace: Path, inputs: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "openvino", None)  # as if not installed
    out = tmp_path / "o"
    assert main(["predict", "-w", str(workspace), "-i", str(inputs), "-o", str(out), "--runtime", "openvino"]) != 0
    assert 'pip install "autoseg[openvino]"' in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())
