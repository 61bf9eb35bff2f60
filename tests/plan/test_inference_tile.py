"""The planned inference tile: a valid tile for the network, from the patch up to the median image (at most
``MAX_TILE_MULTIPLE`` patches), as large as the memory model lets the sliding window fit the inference budget."""

from __future__ import annotations

import math

import pytest
from factories import tiny_plans

from autoseg.core.units import GiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.inference import InferenceSetting, inference_memory
from autoseg.model.tile_buffers import PREDICTION_ACCUMULATOR
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.inference_tile import (
    MAX_TILE_MULTIPLE,
    inference_budget_share,
    plan_inference_tile,
    tile_candidates,
    tile_for_image,
)
from autoseg.plan.planner import plan
from autoseg.plan.plans import IntensityProperties


def test_candidates_run_from_the_median_image_down_to_the_patch() -> None:
    assert tile_candidates((16, 40, 40), (4, 8, 8), (17, 47, 47)) == [(20, 48, 48), (16, 48, 48), (16, 40, 40)]
    patch, divisor = (8, 16, 24), (2, 8, 4)
    tiles = tile_candidates(patch, divisor, (100, 20, 30))
    assert tiles[0] == (16, 24, 32)  # z: 2 patches; y: 20 rounded up to 8s; x: 30 rounded up to 4s
    assert tiles[-1] == patch and len(set(tiles)) == len(tiles)
    assert [math.prod(t) for t in tiles] == sorted((math.prod(t) for t in tiles), reverse=True)
    for tile in tiles:
        assert all(t % d == 0 and p <= t <= MAX_TILE_MULTIPLE * p for t, p, d in zip(tile, patch, divisor))
    assert tile_candidates(patch, divisor, (4, 8, 8)) == [patch]  # an image smaller than the patch


def _peak(config, tile) -> int:
    setting = InferenceSetting(
        config.network,
        tile,
        config.median_shape_zyx,
        3,
        mirror_axes=(0, 1, 2),
        accumulator_dtype=PREDICTION_ACCUMULATOR,
    )
    mem = inference_memory(setting, 1)  # as the planner counts it
    return predict_device_peak(mem, "cpu")["total"]


def test_the_tile_is_the_largest_candidate_the_budget_holds() -> None:
    config = tiny_plans().configuration("3d_fullres").with_(median_shape_zyx=(30, 60, 60))  # patch 8x16x16
    tiles = tile_candidates(config.patch_size, config.network.patch_divisor(), config.median_shape_zyx)
    assert tiles[0] == (16, 32, 32)
    assert plan_inference_tile(config, 16 * GiB) == (16, 32, 32)
    middle = len(tiles) // 2
    assert _peak(config, tiles[middle - 1]) > _peak(config, tiles[middle]) > _peak(config, tiles[middle + 1])
    memory = 2 * _peak(config, tiles[middle])  # half is the CPU inference budget: tiles[middle] fits, no larger one
    assert plan_inference_tile(config, memory) == tiles[middle]
    assert plan_inference_tile(config, memory - 10) == tiles[middle + 1]
    assert plan_inference_tile(config, 1000) == config.patch_size  # nothing fits: the patch


def test_the_inference_budget_share_is_the_predictors() -> None:
    assert inference_budget_share("cpu", 10 * GiB) == 5 * GiB
    assert inference_budget_share("cuda:1", 10 * GiB) == 9 * GiB


@pytest.mark.slow
def test_a_cpu_plan_records_a_valid_tile_covering_the_median_image() -> None:
    """Images of 20x52x52 at 1 mm: the plan's tile covers them (one tile per case), a multiple of the strides."""
    cases = tuple(
        CaseFingerprint(f"c{i}", (1.0, 1.0, 1.0), (20, 52, 52), (20, 52, 52), (40000, 500, 500)) for i in range(10)
    )
    fp = Fingerprint(
        "Dataset005_Tile",
        ("MRI",),
        {"background": 0, "a": 1, "b": 2},
        ".nii.gz",
        3,
        cases,
        (IntensityProperties(0.0, 1.0, -1.0, 1.0),),
        1.0,
    )
    plans = plan(
        fp,
        Budget(gpu_memory_bytes=8 * GiB, host_ram_bytes=8 * GiB, device="cpu", cpu_flops_per_second=2e9, cpu_count=2),
    )
    plans.check()
    for config in plans.configurations.values():
        tile, patch, median = config.inference_patch_size, config.patch_size, config.median_shape_zyx[-config.dim :]
        assert all(t % d == 0 and t >= p for t, p, d in zip(tile, patch, config.network.patch_divisor()))
        assert all(t >= min(m, MAX_TILE_MULTIPLE * p) for t, m, p in zip(tile, median, patch)), (tile, median)
        assert tile == tile_candidates(patch, config.network.patch_divisor(), median)[0]


def test_each_image_gets_the_cheapest_tile_no_larger_than_itself() -> None:
    """Per axis: between the patch and the planned tile, a multiple of the strides' product, never past the image
    (its zero padding cost Dice), the fewest voxels predicted (tiles x size), the larger on a tie."""
    config = tiny_plans().configuration("3d_fullres").with_(patch_size=(8, 40, 40), inference_patch_size=(16, 80, 80))
    assert config.network.patch_divisor() == (2, 2, 2)
    # y 94 (steps of at most tile - 20): 40 -> 4 tiles (160 voxels), 56 -> 3 (168), 58 -> 2 (116, the fewest),
    # 80 -> 2 (160); x 47: 40 -> 2 (80), 46 -> 2 (92), 48 would pass the image; z 8: the patch covers it
    assert tile_for_image(config, (8, 94, 47)) == (8, 58, 40)
    assert tile_for_image(config, (16, 80, 80)) == (16, 80, 80)  # one tile each
    # z 15: 10 -> 2 (20) beats 8 -> 3 (24) and 14 -> 2 (28); y 79: 50 -> 2 (100); x 81: 52 -> 2 (104), 80 -> 2 (160)
    assert tile_for_image(config, (15, 79, 81)) == (10, 50, 52)
    # z, y smaller than the patch: the patch, padded; x 200: 80 -> 3 (240), 66 -> 4 (264)
    assert tile_for_image(config, (4, 20, 200)) == (8, 40, 80)
    assert tile_for_image(config, (16, 80, 80), "patch") == (8, 40, 40)
    assert tile_for_image(config.with_(inference_patch_size=()), (16, 80, 80)) == (8, 40, 40)
    for shape in ((9, 50, 61), (30, 130, 97), (12, 41, 44)):
        tile = tile_for_image(config, shape)
        assert all(p <= t <= max(p, s) and t % 2 == 0 for t, p, s in zip(tile, (8, 40, 40), shape)), (shape, tile)
