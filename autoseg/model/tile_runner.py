"""The seam between the sliding window and what runs its tiles: ``TileRunner``, the one interface through which
``autoseg.model.sliding_window`` calls a fold's network, and ``TileBatchBytes``, what a runner reports to the memory
plan about a tile batch.

A runner takes a batch of tiles ``(B, C, *tile)`` float32 on its ``device`` and returns their logits
``(B, K, *tile)`` (in its compute dtype); ``precision`` names that compute dtype (a key of
``autoseg.core.precision.PRECISIONS``). Everything around the call, the tiles' layout, the mirror variants, the
Gaussian, the accumulator and the export, is the sliding window's and the same for every runner. Torch modules run
as ``autoseg.model.torch_runner.TorchTileRunner``; another runtime (ONNX Runtime, OpenVINO) is another class with
these members.

``working_bytes(tile_batch_size, tile)`` is what the memory plan (``autoseg.memory.inference_plan.plan_inference``) asks
a runner for. ``model`` may not import ``memory``, so a runner does not compute it itself: whoever builds the
runner hands it the figures' source (the torch runner: ``autoseg.memory.inference.TileSimulation``, a simulation of
its tile batch, bound in ``autoseg.predict.networks.torch_runners``).

This module imports no torch: the planner sizes a plan with ``TileBatchBytes`` without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TileBatchBytes:
    """Bytes of one tile batch of a runner, as the memory plan counts them (``InferenceMemory``)."""

    parameter_bytes: int  # the runner's weights, held for the whole prediction
    tile_bytes: int  # the batch's peak beyond the weights and the sliding window's buffers
    largest_conv_output_bytes: int  # CUDA: the convolution workspace term (``predict_device_peak``)
    live_allocations_at_peak: int  # CUDA: the allocator-rounding term, buffers included
    heap_retained_bytes: int  # CPU: what glibc's heap holds beyond the tensors at the peak (0 elsewhere)
    # of ``tile_bytes``, what the runner still holds after the call, for the rest of the prediction: a graph runtime's
    # arena and buffers, each fold's its own (``inference_memory`` adds the other folds'); 0 for torch, whose freed
    # tensors go back to the heap every fold shares
    held_bytes: int = 0


class WorkingBytesSource(Protocol):
    """What the memory plan asks of a runner (``autoseg.memory.inference.inference_memory``): every ``TileRunner``,
    and ``autoseg.memory.inference.TileSimulation``, a network's tile batch simulated before any runner exists."""

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        """The bytes a batch of ``tile_batch_size`` tiles of ``tile`` takes (``TileBatchBytes``)."""
        ...


class TileRunner(WorkingBytesSource, Protocol):
    """What the sliding window needs of a fold's network: run a tile batch, say where and in which precision it
    runs, and (``WorkingBytesSource``) how many bytes a tile batch takes."""

    @property
    def device(self) -> torch.device:
        """Where the tile batches it takes live (the sliding window's padded input goes there)."""
        ...

    @property
    def precision(self) -> str:
        """Its compute precision: a key of ``autoseg.core.precision.PRECISIONS``."""
        ...

    def __call__(self, tile_batch: torch.Tensor) -> torch.Tensor:
        """The logits ``(B, K, *tile)`` of ``tile_batch`` ``(B, C, *tile)`` float32 on ``device``."""
        ...
