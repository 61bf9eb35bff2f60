"""A tile larger than the training patch keeps the overlap of consecutive tiles, in voxels, at half a training patch
(``overlap_step_fractions``): fewer tiles, and for the patch itself exactly the half-patch steps as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tiles import overlap_step_fractions, tile_layout
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow


def _predict(networks, data, tile, num_outputs, precision="fp32", device="cpu", on_slab=None, **settings):
    """``sliding_window_predict`` with ``networks`` (one or a list) as torch runners on ``device`` and the
    ``SlidingWindow`` of ``tile``, ``num_outputs`` and ``settings``."""
    networks = networks if isinstance(networks, (list, tuple)) else [networks]
    runners = [TorchTileRunner(n, torch.device(device), precision) for n in networks]
    return sliding_window_predict(runners, data, SlidingWindow(tuple(tile), num_outputs, **settings), on_slab)


def test_the_patch_steps_half_itself_and_a_larger_tile_keeps_half_a_patch_of_overlap() -> None:
    assert overlap_step_fractions((16, 40, 40), (16, 40, 40)) == (0.5, 0.5, 0.5)
    assert overlap_step_fractions((16, 80, 60), (16, 40, 40)) == pytest.approx((0.5, 0.75, 1 - 20 / 60))
    assert overlap_step_fractions((96, 80), (32, 40), step_fraction=0.75) == pytest.approx((1 - 8 / 96, 0.875))
    with pytest.raises(ValueError, match="as many axes"):
        overlap_step_fractions((16, 40), (16, 40, 40))


@pytest.mark.parametrize(
    ("image", "patch", "tile"),
    [
        ((40, 100, 100), (16, 40, 40), (32, 80, 80)),
        ((17, 47, 47), (16, 40, 40), (20, 48, 48)),  # the demo: one tile instead of 8
        ((30, 104, 90), (16, 40, 40), (16, 48, 56)),  # 104 - 48 = 2 steps of exactly 28 (a float lands at 27.99...)
    ],
)
def test_a_larger_tile_needs_fewer_tiles_and_overlaps_by_at_least_half_a_patch(image, patch, tile) -> None:
    steps = overlap_step_fractions(tile, patch)
    larger, patches = tile_layout(image, tile, steps), tile_layout(image, patch, 0.5)
    assert larger.num_tiles < patches.num_tiles
    for starts, t, p, size in zip(larger.axis_starts, tile, patch, larger.padded_shape_zyx, strict=True):
        assert starts[0] == 0 and starts[-1] == size - t
        assert all(0 < b - a <= t - p // 2 for a, b in zip(starts, starts[1:]))  # overlap >= half a patch
        # no more tiles than that overlap needs: one fewer would have to step further than t - p / 2
        assert size == t if len(starts) == 1 else size - t > (len(starts) - 2) * (t - p / 2)
    assert tile_layout((30, 104, 90), (16, 48, 56), overlap_step_fractions((16, 48, 56), (16, 40, 40))).axis_starts[
        1
    ] == (0, 28, 56)


def test_per_axis_steps_are_checked() -> None:
    with pytest.raises(ValueError, match="one per patch axis"):
        tile_layout((10, 20, 20), (8, 16, 16), (0.5, 0.5))
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        tile_layout((10, 20, 20), (8, 16, 16), (0.5, 0.0, 0.5))


def test_per_axis_steps_of_one_half_predict_exactly_as_the_scalar_step() -> None:
    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.InstanceNorm3d(4), torch.nn.Conv3d(4, 3, 3, padding=1)
    )
    data = np.random.default_rng(0).standard_normal((1, 12, 30, 26)).astype(np.float32)
    scalar = _predict(network, data, (8, 16, 16), 3, step_fraction=0.5)
    per_axis = _predict(network, data, (8, 16, 16), 3, step_fraction=overlap_step_fractions((8, 16, 16), (8, 16, 16)))
    assert torch.equal(scalar, per_axis)
