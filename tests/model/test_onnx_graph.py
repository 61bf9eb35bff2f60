from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
from extras import require_extra
from factories import tiny_topology

from autoseg.core.errors import InputError
from autoseg.model import onnx_graph
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import INPUT_NAME, OUTPUT_NAME, check_agreement, check_io, export_graph, run_graph

require_extra("onnx")


@pytest.fixture(scope="module")
def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_network(tiny_topology(3))  # deep supervision on, training mode: as a checkpoint is built


@pytest.fixture(scope="module")
def graph(network) -> bytes:
    return export_graph(network, torch.randn(1, 1, 8, 16, 16))


def test_the_graph_has_the_named_input_and_output_and_leaves_the_network_as_it_was(network, graph):
    check_io(graph, 1, 3, 3, "g.onnx")
    assert network.training and network.deep_supervision


@pytest.mark.parametrize("runtime", onnx_graph.GRAPH_RUNTIMES)
def test_the_graph_computes_torchs_full_resolution_logits_on_other_batch_and_tile_sizes(network, graph, runtime):
    require_extra(runtime)
    tiles = torch.randn(3, 1, 16, 16, 32)  # the graph was traced on (1, 1, 8, 16, 16): its axes are dynamic
    agreement = check_agreement(network, graph, tiles, runtime)
    assert agreement.passed, agreement.describe()
    assert agreement.voxels == 3 * 16 * 16 * 32
    assert run_graph(graph, tiles.numpy(), runtime).shape == (3, 3, 16, 16, 32)


def test_a_graph_of_other_weights_fails_the_agreement_check_with_its_figures(network, graph):
    runtime = onnx_graph.available_runtime()
    other = build_network(tiny_topology(3))
    agreement = check_agreement(other, graph, torch.randn(2, 1, 8, 16, 16), runtime)
    assert not agreement.passed
    assert "argmax agrees on" in agreement.describe() and "of their range" in agreement.describe()


@pytest.mark.parametrize(
    ("in_channels", "num_outputs", "dim", "found"),
    [(2, 3, 3, f"input {INPUT_NAME!r} of shape (B, 2"), (1, 4, 3, f"output {OUTPUT_NAME!r} of shape (B, 4")],
)
def test_a_graph_of_other_channels_is_refused_naming_it(graph, in_channels, num_outputs, dim, found):
    with pytest.raises(InputError, match=rf"^g\.onnx: its .*{re.escape(found)}"):
        check_io(graph, in_channels, num_outputs, dim, "g.onnx")


def test_damaged_graph_bytes_are_refused_naming_them(graph):
    with pytest.raises(InputError, match=r"^g\.onnx: not a readable ONNX graph"):
        check_io(graph[: len(graph) // 2], 1, 3, 3, "g.onnx")


def test_running_a_graph_without_its_runtime_names_the_extra(graph, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(InputError, match=r"autoseg\[openvino\]"):
        run_graph(graph, np.zeros((1, 1, 8, 16, 16), np.float32), "openvino")


def test_onnxruntime_plans_no_memory_block_per_tile_shape(graph, monkeypatch):
    """ONNX Runtime's memory pattern keeps one arena block per input shape: a run whose cases fit tiles of several
    shapes would hold them all, beyond the one shape its working bytes are measured on."""
    onnxruntime = require_extra("onnxruntime")
    sessions = []
    real = onnxruntime.InferenceSession

    def recording(graph_bytes, options, **kwargs):
        sessions.append(options)
        return real(graph_bytes, options, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    run = onnx_graph.compile_graph(graph, "onnxruntime", threads=1)
    assert run(np.zeros((1, 1, 8, 16, 16), np.float32)).shape == (1, 3, 8, 16, 16)
    assert [s.enable_mem_pattern for s in sessions] == [False]
