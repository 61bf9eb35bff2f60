"""The tile-runner seam: the sliding window runs any object with a TileRunner's members (not only a torch module), the
same tiling, mirroring, Gaussian and accumulator for each; runners on different devices are refused; a torch runner
without a source of working bytes says how to get one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tile_runner import TileBatchBytes, TileRunner
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow


class _ConstantRunner:
    """A runner that is no torch module: the same logits at every voxel, whatever the tile (another runtime's
    stand-in)."""

    def __init__(self, logits: list[float], device: str = "cpu") -> None:
        self.logits, self.device, self.precision = torch.tensor(logits), torch.device(device), "fp32"
        self.batches: list[tuple[int, ...]] = []

    def __call__(self, tile_batch: torch.Tensor) -> torch.Tensor:
        self.batches.append(tuple(tile_batch.shape))
        shape = (tile_batch.shape[0], len(self.logits), *tile_batch.shape[2:])
        return self.logits.reshape(1, -1, *([1] * (tile_batch.ndim - 2))).expand(shape)

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        return TileBatchBytes(0, 0, 0, 0, 0)


def test_any_runner_runs_the_same_window() -> None:
    """Two runners of constant logits are one ensemble (their logits averaged) through the window's own batching and
    mirror variants: 4 tiles x 2 variants in two batches of 4."""
    data = np.random.default_rng(0).standard_normal((1, 10, 8, 8)).astype(np.float32)
    runners: list[TileRunner] = [_ConstantRunner([1.0, 0.0]), _ConstantRunner([0.0, 2.0])]
    window = SlidingWindow((4, 8, 8), 2, mirror_axes=(0,), tile_batch_size=4)
    probs = sliding_window_predict(runners, data, window)
    expected = torch.softmax(torch.tensor([0.5, 1.0]), dim=0)
    torch.testing.assert_close(probs, expected[:, None, None, None].expand(2, 10, 8, 8))
    assert runners[0].batches == runners[1].batches == [(4, 1, 4, 8, 8), (4, 1, 4, 8, 8)]  # 4 tiles x 2 variants


def test_runners_on_different_devices_are_refused() -> None:
    data = np.zeros((1, 4, 4, 4), dtype=np.float32)
    runners = [_ConstantRunner([0.0, 1.0]), _ConstantRunner([0.0, 1.0], device="meta")]
    with pytest.raises(ValueError, match="different devices"):
        sliding_window_predict(runners, data, SlidingWindow((4, 4, 4), 2))
    with pytest.raises(ValueError, match="at least one network"):
        sliding_window_predict([], data, SlidingWindow((4, 4, 4), 2))


def test_no_output_needs_a_sink() -> None:
    data = np.zeros((1, 4, 4, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="give on_slab"):
        sliding_window_predict([_ConstantRunner([0.0, 1.0])], data, SlidingWindow((4, 4, 4), 2, output_dtype=None))


def test_a_torch_runner_without_a_source_of_working_bytes_says_where_to_get_one() -> None:
    runner = TorchTileRunner(torch.nn.Conv3d(1, 2, 1), torch.device("cpu"))
    with pytest.raises(ValueError, match="torch_runners"):
        runner.working_bytes(1, (4, 4, 4))
