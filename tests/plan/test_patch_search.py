from __future__ import annotations

import math

import pytest

from autoseg.core.units import GiB
from autoseg.plan.patch_search import SearchSpace, family_shape, search
from autoseg.plan.step_cost import Limits, Setting, StepCost, rough_training_peak_bytes
from autoseg.plan.throughput import StepRates
from autoseg.plan.topology_rules import pools_per_axis, topology_for

# --- family_shape -------------------------------------------------------------------------------------


def test_family_shape_is_a_cube_in_mm() -> None:
    z, y, x = family_shape((3.0, 0.75, 0.75), (400, 400, 400), voxels=16 * 64 * 64)
    assert z * 3.0 == pytest.approx(y * 0.75) == pytest.approx(x * 0.75)
    assert (z, y, x) == pytest.approx((16, 64, 64))


def test_family_shape_caps_axes_at_the_median_and_gives_their_share_to_the_others() -> None:
    z, y, x = family_shape((1.0, 1.0, 1.0), (20, 400, 400), voxels=20 * 100 * 100)
    assert z == 20 and y == pytest.approx(100) and x == pytest.approx(100)
    assert family_shape((1.0, 1.0, 1.0), (20, 40, 40), voxels=1e9) == (20.0, 40.0, 40.0)
    assert family_shape((0.5, 0.5), (100, 300), voxels=200 * 100) == pytest.approx((100.0, 200.0))


# --- topology_for with pooling caps -----------------------------------------------------------------


def test_pooling_caps_give_a_finer_grid() -> None:
    topo, patch = topology_for((160, 160, 160), (1.0, 1.0, 1.0), 1, 2, 32, 320)
    assert pools_per_axis(topo) == (5, 5, 5) and topo.patch_divisor() == (32, 32, 32)
    capped, patch = topology_for((150, 160, 160), (1.0, 1.0, 1.0), 1, 2, 32, 320, (4, 5, 5))
    assert pools_per_axis(capped) == (4, 5, 5) and capped.patch_divisor() == (16, 32, 32)
    assert patch == (160, 160, 160) and capped.strides[-1] == (1, 2, 2)


# --- search -------------------------------------------------------------------------------------------


def _space(median: tuple[int, ...] = (100, 340, 340), spacing: tuple[float, ...] = (3.0, 0.8, 0.8)) -> SearchSpace:
    return SearchSpace(spacing, median, in_channels=1, num_outputs=3, dataset_voxels=20 * math.prod(median))


def _rough(topology, batch, patch, precision, checkpointing, accumulation_steps) -> int:
    return rough_training_peak_bytes(topology, batch, patch, precision, checkpointing, accumulation_steps)


AMP = Setting(base_features=32, max_features=320, precision="fp16", checkpointing=False, single=False)


@pytest.mark.parametrize("gib", [1, 3, 6, 12])
def test_search_fills_the_memory_limit(gib: int) -> None:
    space, limit = _space(), gib * GiB
    found = search(space, AMP, StepCost(_rough, AMP, Limits(limit, None, StepRates(1e13), fill_bytes=0.86 * limit)))
    assert found is not None and found.batch == 2 and found.coverage < 1
    assert 0.86 * limit <= found.peak_bytes <= limit
    assert found.peak_bytes == _rough(found.topology, 2, found.patch, "fp16", False, 1)
    # the patch's own network, or one pooling an axis less (a finer grid to fill the memory with)
    own = topology_for(found.patch, space.spacing_mm, 1, 3, 32, 320)[0]
    assert all(a <= b for a, b in zip(pools_per_axis(found.topology), pools_per_axis(own)))
    assert all(p % d == 0 for p, d in zip(found.patch, found.topology.patch_divisor()))
    # the shape follows the spacing: the patch is roughly as long in mm along each axis
    extent_mm = [p * s for p, s in zip(found.patch, space.spacing_mm)]
    assert max(extent_mm) / min(extent_mm) < 2.0, (found.patch, extent_mm)


def test_search_grows_the_batch_once_the_patch_covers_the_median_image() -> None:
    space = SearchSpace((1.0, 1.0, 1.0), (40, 100, 100), 1, 3, dataset_voxels=1000 * 40 * 100 * 100)
    limit = 8 * GiB
    found = search(space, AMP, StepCost(_rough, AMP, Limits(limit, None, StepRates(1e13))))
    assert found.coverage == 1 and found.patch == (40, 112, 112)
    assert 2 < found.batch < found.max_batch
    assert found.peak_bytes <= limit < _rough(found.topology, found.batch + 1, found.patch, "fp16", False, 1)


def test_search_respects_the_time_limit_without_counting_bytes() -> None:
    space, setting = _space(), Setting(16, 320, "fp32", False, False)
    limits = Limits(memory_bytes=1.0, seconds=1.0, rates=StepRates(20e9))  # 1 byte: ignored without use_memory
    found = search(space, setting, StepCost(_rough, setting, limits, use_memory=False))
    assert found is not None and found.peak_bytes == 0
    assert 0.5 * 20e9 < found.flops <= 20e9


def test_search_returns_none_when_nothing_fits() -> None:
    assert search(_space(), AMP, StepCost(_rough, AMP, Limits(1000, None, StepRates(1e13)))) is None


def test_micro_batch_one_setting_accumulates() -> None:
    setting = Setting(32, 320, "fp16", True, True)
    found = search(_space(), setting, StepCost(_rough, setting, Limits(2 * GiB, None, StepRates(1e13))))
    assert found.batch == 1 and found.accumulation_steps == 2
    assert found.peak_bytes == _rough(found.topology, 1, found.patch, "fp16", True, 2)


def _buildable_only(topology, batch, patch, precision, checkpointing, accumulation_steps) -> int:
    """Like the simulated peak: a network of one stage cannot be built, so asking for its peak fails."""
    assert topology.num_stages >= 2, f"asked for the peak of an unbuildable {topology.num_stages}-stage network"
    return _rough(topology, batch, patch, precision, checkpointing, accumulation_steps)


def test_a_one_stage_network_never_fits_and_its_peak_is_never_asked() -> None:
    one_stage, _ = topology_for((2, 2, 2), (1.0, 1.0, 1.0), 1, 3, 32, 320)
    assert one_stage.num_stages == 1
    assert not StepCost(_buildable_only, AMP, Limits(1e15, None, StepRates(1e13))).fits(one_stage, 1, (2, 2, 2))
    # a budget too small for anything: the search tries ever smaller patches, down to unpoolable ones
    assert search(_space(), AMP, StepCost(_buildable_only, AMP, Limits(1000, None, StepRates(1e13)))) is None
