"""The ONNX Runtime and OpenVINO tile runners: the sliding window over a network's graph with each agrees with the
torch runner; an unsupported precision is refused naming the flag; a runtime's failure on a tile is a RunError with
its message; working bytes come from the source it is built with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extras import require_extra
from factories import tiny_topology

from autoseg.core.errors import InputError, RunError
from autoseg.model.graph_runners import GRAPH_RUNNERS, OnnxRuntimeTileRunner
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import export_graph
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tile_runner import TileBatchBytes
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow

require_extra("onnx")
FIGURES = TileBatchBytes(1, 2, 3, 4, 5)


class _Figures:
    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        return FIGURES


@pytest.fixture(scope="module")
def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_network(tiny_topology(3))


@pytest.fixture(scope="module")
def graph(network) -> bytes:
    return export_graph(network, torch.randn(1, 1, 8, 16, 16))


@pytest.mark.parametrize("runtime", sorted(GRAPH_RUNNERS))
def test_the_sliding_window_with_a_graph_runner_agrees_with_torch(network, graph, runtime):
    require_extra(runtime)
    data = np.random.default_rng(0).standard_normal((1, 12, 20, 20)).astype(np.float32)
    window = SlidingWindow((8, 16, 16), 3, mirror_axes=(0, 1, 2), tta=2, tile_batch_size=2, accumulator_dtype="float32")
    graph_runner = GRAPH_RUNNERS[runtime](graph, _Figures(), threads=1)
    expected = sliding_window_predict([TorchTileRunner(network, torch.device("cpu"))], data, window)
    found = sliding_window_predict([graph_runner], data, window)
    assert found.shape == expected.shape == (3, 12, 20, 20)
    assert (found - expected).abs().max() <= 1e-3  # probabilities: their range is 1
    tiles = torch.from_numpy(data[None, :, :8, :16, :16].copy())
    logits = graph_runner(tiles)
    with torch.inference_mode():
        network.eval()
        torch_logits = network(tiles)[0]
    assert logits.dtype == torch.float32 and logits.shape == (1, 3, 8, 16, 16)
    assert (logits - torch_logits).abs().max() <= 1e-3 * float(torch_logits.max() - torch_logits.min())
    assert graph_runner.device == torch.device("cpu") and graph_runner.working_bytes(2, (8, 16, 16)) == FIGURES


def test_onnxruntime_in_bf16_is_refused_naming_the_flag(graph):
    with pytest.raises(InputError, match="onnxruntime runs fold 0 in fp32, not 'bf16'.*--precision fp32"):
        OnnxRuntimeTileRunner(graph, _Figures(), precision="bf16", what="fold 0")


def test_a_runtime_failing_on_a_tile_stops_with_its_message(graph):
    require_extra("onnxruntime")
    runner = OnnxRuntimeTileRunner(graph, _Figures(), what="fold 0 of 3d_fullres")
    with pytest.raises(
        RunError, match=r"onnxruntime failed on a tile batch \(1, 2, 8, 16, 16\) of fold 0 of 3d_fullres"
    ):
        runner(torch.zeros(1, 2, 8, 16, 16))  # two channels: the graph takes one
