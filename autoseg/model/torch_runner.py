"""A torch module as a ``TileRunner`` (``autoseg.model.tile_runner``): the folds' networks as prediction runs them.

Each tile batch runs in eval mode (the module's mode is restored afterwards), under ``inference_mode`` and the
precision's autocast, with the large convolutions in slabs on the CPU (``autoseg.model.slabs``) and every fp32 3D
convolution through oneDNN there (``autoseg.model.cpu_conv``); a deep-supervision network's outputs are reduced to
the full-resolution one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from autoseg.core.precision import autocast_dtype
from autoseg.model.cpu_conv import onednn_convolutions
from autoseg.model.slabs import slabs_on
from autoseg.model.tile_runner import TileBatchBytes, WorkingBytesSource


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(precision)
    if dtype is None or (dtype == torch.float16 and device.type == "cpu"):
        return contextlib.nullcontext()  # fp16 autocast is not meaningful on CPU: run fp32
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def _in_eval_mode(module: nn.Module) -> Iterator[None]:
    """Within: ``module`` in eval mode (dropout off, norms on their running statistics); its mode is restored."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


@dataclass(frozen=True, eq=False)
class TorchTileRunner:
    """``module`` (already on ``device``) running tile batches in ``precision`` ("fp32", "bf16" or "fp16"; fp16 runs
    fp32 on the CPU). ``bytes_source``: what answers its ``working_bytes`` (``autoseg.memory.inference.TileSimulation``,
    the simulation of this tile batch; None: a runner the memory plan cannot ask)."""

    module: nn.Module
    device: torch.device
    precision: str = "fp32"
    bytes_source: WorkingBytesSource | None = None

    def __call__(self, tile_batch: torch.Tensor) -> torch.Tensor:
        """The logits ``(B, K, *tile)`` of ``tile_batch`` ``(B, C, *tile)`` fp32, in the compute dtype (bf16/fp16
        under autocast)."""
        with (
            torch.inference_mode(),
            _autocast(self.precision, tile_batch.device),
            slabs_on([self.module], self.device),  # CPU: large convolutions in slabs
            onednn_convolutions([self.module], self.device),  # CPU: oneDNN's kernels at a tile batch of 1 too
            _in_eval_mode(self.module),
        ):
            out = self.module(tile_batch)
        if isinstance(out, (list, tuple)):  # deep supervision: full resolution first
            out = out[0]
        return out

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        if self.bytes_source is None:
            raise ValueError(
                "this TorchTileRunner has no source of working bytes; build it with "
                "autoseg.predict.networks.torch_runners, which binds the memory model's tile simulation"
            )
        return self.bytes_source.working_bytes(tile_batch_size, tile)
