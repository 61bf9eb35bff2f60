"""A fold's network as an ONNX graph, and the check that the graph computes what torch computes.

``export_graph`` writes the network in its inference form (eval mode, no deep supervision: the full-resolution
logits only) as ONNX bytes with torch's TorchScript exporter (opset ``OPSET``): input ``INPUT_NAME``
``(B, C, *tile)`` float32, output ``OUTPUT_NAME`` ``(B, K, *tile)``, the batch and every spatial axis dynamic, so
one graph runs any tile batch the sliding window plans. ``check_io`` reads a graph's inputs and outputs against
what the plan says (names, rank, channel counts).

``compile_graph`` makes a graph callable on a tile batch with ONNX Runtime, or OpenVINO in fp32 when ONNX Runtime
is not installed: the agreement check runs the graph through it, and a runtime's tile runner can reuse it.
``check_agreement`` compares the graph's logits on real tiles with torch's (``Agreement``: the largest difference
against the logits' range, and the share of voxels whose argmax agrees).

The ONNX packages are optional extras (``autoseg.core.extras``): they are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from autoseg.core.errors import InputError
from autoseg.core.extras import RUNTIMES, installed, require

INPUT_NAME = "tiles"
OUTPUT_NAME = "logits"
OPSET = 17
GRAPH_RUNTIMES = tuple(r for r in RUNTIMES if r != "torch")  # the first installed one runs the agreement check
MAX_DIFFERENCE_OF_RANGE = 1e-3  # the graph's logits may differ from torch's by this share of their range
MIN_ARGMAX_AGREEMENT = 0.9999  # share of voxels whose argmax must agree
OPENVINO_PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}  # autoseg's precision -> OpenVINO's inference hint


@contextlib.contextmanager
def _inference_form(network: nn.Module) -> Iterator[nn.Module]:
    """Within: ``network`` in eval mode returning the full-resolution logits only; its mode and deep supervision are
    restored afterwards."""
    was_training, deep = network.training, getattr(network, "deep_supervision", False)
    network.eval()
    if deep:
        network.deep_supervision = False
    try:
        yield network
    finally:
        network.train(was_training)
        if deep:
            network.deep_supervision = deep


def export_graph(network: nn.Module, example: torch.Tensor) -> bytes:
    """``network`` (on the CPU) in its inference form as ONNX bytes; ``example`` ``(B, C, *tile)`` float32, a tile
    batch it takes (its shape is traced; the batch and spatial axes stay dynamic)."""
    require("onnx", "onnx", "exporting a network as an ONNX graph")
    axes = {0: "batch", **{2 + i: f"spatial_{i}" for i in range(example.ndim - 2)}}
    buffer = io.BytesIO()
    # traced with autograd on: without it the network takes its memory-releasing path (``forward_releasing``), whose
    # in-place reuse of freed maps the tracer records wrongly (the graph's logits then differ from torch's)
    with _inference_form(network), torch.enable_grad(), warnings.catch_warnings():
        # the network's Python-side shape checks are traced away (TracerWarning): they are not part of the graph
        warnings.simplefilter("ignore")
        torch.onnx.export(
            network,
            (example.float(),),
            buffer,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: axes, OUTPUT_NAME: axes},
            opset_version=OPSET,
            dynamo=False,
        )
    return buffer.getvalue()


def check_io(graph: bytes, in_channels: int, num_outputs: int, dim: int, where: str) -> None:
    """Refuse (``InputError`` naming ``where``) a graph that does not parse, or whose one input and one output are not
    ``INPUT_NAME`` ``(B, in_channels, *dim axes)`` and ``OUTPUT_NAME`` ``(B, num_outputs, *dim axes)``."""
    onnx = require("onnx", "onnx", "checking an ONNX graph")
    try:
        model = onnx.load_from_string(graph)
        onnx.checker.check_model(model)
    except Exception as e:  # onnx raises its own errors and protobuf's DecodeError
        raise InputError(f"{where}: not a readable ONNX graph ({type(e).__name__}: {str(e)[:200]})") from e
    for kind, values, name, channels in (
        ("input", model.graph.input, INPUT_NAME, in_channels),
        ("output", model.graph.output, OUTPUT_NAME, num_outputs),
    ):
        found = [(v.name, [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]) for v in values]
        if len(found) != 1 or found[0][0] != name or len(found[0][1]) != dim + 2 or found[0][1][1] != channels:
            raise InputError(
                f"{where}: its {kind}s are {found}, the plan's network has one {kind} {name!r} of shape "
                f"(B, {channels}, {dim} spatial axes)"
            )


def available_runtime() -> str | None:
    """The first of ``GRAPH_RUNTIMES`` that is installed; None when none is."""
    return next((r for r in GRAPH_RUNTIMES if installed(r)), None)


def compile_graph(
    graph: bytes, runtime: str, threads: int = 1, precision: str = "fp32"
) -> Callable[[np.ndarray], np.ndarray]:
    """``graph`` compiled by ``runtime`` ("onnxruntime" in fp32, or "openvino" in ``precision``: a key of
    ``OPENVINO_PRECISION_HINTS``) on the CPU with ``threads`` threads: a function from a tile batch ``(B, C, *tile)``
    float32 to its logits ``(B, K, *tile)`` float32."""
    module = require(*RUNTIMES[runtime], f"running an ONNX graph with {runtime}")
    if runtime == "onnxruntime":
        options = module.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # No memory pattern: it plans one block per input shape and the arena keeps every block, so a run whose
        # cases fit tiles of several shapes would hold them all (docs/memory.md, "Graph runtimes")
        options.enable_mem_pattern = False
        session = module.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        return lambda batch: session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(batch, np.float32)})[0]
    core = module.Core()
    compiled = core.compile_model(
        core.read_model(graph),
        "CPU",
        {"INFERENCE_PRECISION_HINT": OPENVINO_PRECISION_HINTS[precision], "INFERENCE_NUM_THREADS": threads},
    )
    return lambda batch: compiled(np.ascontiguousarray(batch, np.float32))[OUTPUT_NAME]


def run_graph(graph: bytes, tile_batch: np.ndarray, runtime: str, threads: int = 1) -> np.ndarray:
    """The logits ``(B, K, *tile)`` float32 of ``tile_batch`` ``(B, C, *tile)`` through ``graph`` run by
    ``runtime`` (compiled for this one call: a runner keeps ``compile_graph``'s function instead)."""
    return np.asarray(compile_graph(graph, runtime, threads)(tile_batch), dtype=np.float32)


@dataclass(frozen=True)
class Agreement:
    """How a graph's logits compare with torch's on the same tiles."""

    runtime: str  # what ran the graph
    voxels: int  # voxels compared (tiles x tile voxels)
    max_difference: float  # the largest absolute difference of a logit
    logits_range: float  # max - min of torch's logits
    argmax_agreement: float  # share of voxels whose argmax over the channels agrees

    @property
    def passed(self) -> bool:
        within = self.max_difference <= MAX_DIFFERENCE_OF_RANGE * max(self.logits_range, 1e-12)
        return within and self.argmax_agreement >= MIN_ARGMAX_AGREEMENT

    def describe(self) -> str:
        return (
            f"{self.runtime}'s logits differ from torch's by at most {self.max_difference:.3g} "
            f"({self.max_difference / max(self.logits_range, 1e-12):.2e} of their range {self.logits_range:.3g}, "
            f"limit {MAX_DIFFERENCE_OF_RANGE:g}); argmax agrees on {100 * self.argmax_agreement:.4f}% of "
            f"{self.voxels} voxels (limit {100 * MIN_ARGMAX_AGREEMENT:g}%)"
        )


def check_agreement(network: nn.Module, graph: bytes, tiles: torch.Tensor, runtime: str) -> Agreement:
    """Run ``tiles`` ``(B, C, *tile)`` float32 through ``network`` (torch fp32, inference form) and through
    ``graph`` (``runtime``) and compare their logits."""
    with _inference_form(network), torch.inference_mode():
        expected = network(tiles.float()).float().numpy()
    found = run_graph(graph, tiles.float().numpy(), runtime)
    if found.shape != expected.shape:
        raise InputError(f"the graph's logits are {found.shape}, torch's {expected.shape}")
    return Agreement(
        runtime=runtime,
        voxels=int(expected[:, 0].size),
        max_difference=float(np.abs(found - expected).max()),
        logits_range=float(expected.max() - expected.min()),
        argmax_agreement=float((found.argmax(1) == expected.argmax(1)).mean()),
    )
