"""A fold's checked ONNX graph (``autoseg.model.onnx_graph``) as a ``TileRunner`` (``autoseg.model.tile_runner``) on the
CPU: ``OnnxRuntimeTileRunner`` (fp32) and ``OpenVinoTileRunner`` (fp32, or bf16 through OpenVINO's
``INFERENCE_PRECISION_HINT``). Each compiles its graph once (``compile_graph``) with the thread count prediction
uses, and returns a tile batch's logits as float32 torch tensors, as ``TorchTileRunner`` does.

``working_bytes`` is answered by the ``bytes_source`` it is built with (``model`` may not import ``memory`` or
``predict``): in prediction, the runtime's own figures, measured once in a fresh process running this runner's call
and kept per machine (``autoseg.predict.runtime_memory.RuntimeWorkingBytes``, bound in
``autoseg.predict.runners.load_predictor``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from autoseg.core.errors import InputError, RunError
from autoseg.model.onnx_graph import compile_graph
from autoseg.model.tile_runner import TileBatchBytes, WorkingBytesSource


@dataclass(frozen=True, eq=False)
class _GraphTileRunner:
    """``graph`` (ONNX bytes) run by ``runtime`` on the CPU with ``threads`` threads in ``precision``; ``bytes_source``
    answers ``working_bytes``; ``what`` names the fold in a runtime's failure ("fold 0 of 3d_fullres")."""

    runtime: ClassVar[str]
    precisions: ClassVar[tuple[str, ...]]  # the precisions this runtime computes in

    graph: bytes = field(repr=False)
    bytes_source: WorkingBytesSource
    threads: int = 1
    precision: str = "fp32"
    what: str = "the network"
    _run: Callable[[np.ndarray], np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.precision not in self.precisions:
            raise InputError(
                f"{self.runtime} runs {self.what} in {' or '.join(self.precisions)}, not {self.precision!r}; "
                f"predict with --precision {self.precisions[0]}, or another --runtime"
            )
        object.__setattr__(self, "_run", compile_graph(self.graph, self.runtime, self.threads, self.precision))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __call__(self, tile_batch: torch.Tensor) -> torch.Tensor:
        """The logits ``(B, K, *tile)`` float32 of ``tile_batch`` ``(B, C, *tile)`` float32; a runtime's failure is a
        ``RunError`` carrying its message."""
        try:
            logits = self._run(tile_batch.detach().float().cpu().numpy())
        except Exception as e:  # each runtime raises its own exception types
            raise RunError(
                f"{self.runtime} failed on a tile batch {tuple(tile_batch.shape)} of {self.what}: "
                f"{type(e).__name__}: {str(e)[:300]}; predict with --runtime torch"
            ) from e
        return torch.from_numpy(np.asarray(logits, dtype=np.float32))

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        """The ``bytes_source``'s figure for this tile batch."""
        return self.bytes_source.working_bytes(tile_batch_size, tile)


@dataclass(frozen=True, eq=False)
class OnnxRuntimeTileRunner(_GraphTileRunner):
    """A graph run by ONNX Runtime's CPU execution provider, in fp32."""

    runtime: ClassVar[str] = "onnxruntime"
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)


@dataclass(frozen=True, eq=False)
class OpenVinoTileRunner(_GraphTileRunner):
    """A graph run by OpenVINO on the CPU, in fp32 or bf16 (``INFERENCE_PRECISION_HINT``: bf16 where the CPU has
    native bf16, which ``autoseg.core.precision`` decides before the runner is built)."""

    runtime: ClassVar[str] = "openvino"
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16")


GRAPH_RUNNERS: dict[str, type[_GraphTileRunner]] = {r.runtime: r for r in (OnnxRuntimeTileRunner, OpenVinoTileRunner)}
