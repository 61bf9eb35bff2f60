from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from autoseg.fingerprint import CaseFingerprint, Fingerprint
from autoseg.planner import (
    MAX_STAGES,
    Budget,
    GiB,
    plan,
    rough_training_peak_bytes,
    target_spacing,
    topology_for,
)
from autoseg.plans import IntensityProperties, Plans

# --- target_spacing ---------------------------------------------------------------------------------


def test_target_spacing_is_the_median_for_isotropic_data() -> None:
    spacings = np.array([[1.0, 0.7, 0.7], [1.2, 0.8, 0.8], [1.5, 0.9, 0.9], [1.1, 0.75, 0.75]])
    shapes = np.array([[100, 200, 200]] * 4)
    assert target_spacing(spacings, shapes) == pytest.approx((1.15, 0.775, 0.775))


# z spacings 1..5 then 5s: median 5 mm, 10th percentile (linear interpolation over 10 values) 1.9 mm
_ANISO_Z = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]


def _aniso_spacings(inplane_mm: float) -> np.ndarray:
    return np.array([[z, inplane_mm, inplane_mm] for z in _ANISO_Z])


def test_target_spacing_uses_10th_percentile_on_thick_slice_axis() -> None:
    shapes = np.array([[20, 256, 256]] * 10)  # 20 * 3 < 256: few slices, anisotropic in voxels too
    z, y, x = target_spacing(_aniso_spacings(0.5), shapes)
    assert z == pytest.approx(1.9, abs=1e-4)
    assert (y, x) == pytest.approx((0.5, 0.5))


def test_target_spacing_10th_percentile_is_not_finer_than_other_axes() -> None:
    shapes = np.array([[20, 256, 256]] * 10)
    # in-plane 1.6 mm: z median 5 > 3 x 1.6 is still anisotropic, and p10 = 1.9 mm is coarser than 1.6
    assert target_spacing(_aniso_spacings(1.6), shapes)[0] == pytest.approx(1.9, abs=1e-4)
    spacings = _aniso_spacings(1.6)
    spacings[:, 0] = [0.2, 0.2, 5, 5, 5, 5, 5, 5, 5, 5]  # p10 = 0.2 mm, finer than the 1.6 mm in-plane
    assert target_spacing(spacings, shapes)[0] == pytest.approx(1.6, abs=1e-4)


def test_target_spacing_keeps_median_when_voxels_are_not_anisotropic() -> None:
    shapes = np.array([[200, 256, 256]] * 10)  # 200 * 3 > 256: plenty of slices
    assert target_spacing(_aniso_spacings(0.5), shapes) == pytest.approx((5.0, 0.5, 0.5))


def test_target_spacing_keeps_median_when_spacing_is_not_anisotropic() -> None:
    spacings = np.array([[1.4, 0.5, 0.5]] * 3 + [[0.5, 0.5, 0.5]])  # 1.4 < 3 x 0.5
    shapes = np.array([[20, 256, 256]] * 4)
    assert target_spacing(spacings, shapes) == pytest.approx((1.4, 0.5, 0.5))


# --- topology_for -----------------------------------------------------------------------------------


def test_thick_slice_axis_is_not_pooled_until_its_spacing_catches_up() -> None:
    # spacing (5, 1, 1): in-plane pooled twice (1 -> 2 -> 4 mm) before z (5 mm <= 2 x 4 mm) is pooled
    topo, patch = topology_for((20, 160, 160), (5.0, 1.0, 1.0), in_channels=1, num_classes=3,
                               base_features=32, max_features=320)
    assert topo.strides == ((1, 1, 1), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2))
    # kernel 1 along z while z is > 2x the finest spacing (stages 0 and 1), 3 once it is within 2x
    assert topo.kernel_sizes == ((1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    assert topo.features_per_stage == (32, 64, 128, 256, 320, 320)  # doubling, capped
    assert topo.patch_divisor() == (4, 32, 32)
    assert patch == (20, 160, 160)
    assert topo.dim == 3 and topo.in_channels == 1 and topo.num_classes == 3


def test_patch_is_rounded_up_to_a_multiple_of_the_strides() -> None:
    topo, patch = topology_for((18, 150, 150), (5.0, 1.0, 1.0), 1, 3, 32, 320)
    assert topo.patch_divisor() == (4, 32, 32)
    assert patch == (20, 160, 160)
    # isotropic: z (30 voxels) stops pooling one stage before y and x (70 voxels)
    topo, patch = topology_for((30, 70, 70), (1.0, 1.0, 1.0), 1, 2, 32, 320)
    assert topo.strides == ((1, 1, 1), (2, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2))
    assert patch == (32, 80, 80)
    assert all(p % d == 0 for p, d in zip(patch, topo.patch_divisor()))


def test_no_axis_is_pooled_below_the_minimum_feature_map() -> None:
    topo, patch = topology_for((8, 8, 12), (1.0, 1.0, 1.0), 1, 2, 16, 320)
    assert topo.strides == ((1, 1, 1), (2, 2, 2))  # 8 -> 4; a second pool would give 2
    assert patch == (8, 8, 12)
    topo, patch = topology_for((7, 7, 7), (1.0, 1.0, 1.0), 1, 2, 16, 320)
    assert topo.strides == ((1, 1, 1),) and patch == (7, 7, 7)


@pytest.mark.parametrize(("patch", "cap"), [((512, 512, 512), 320), ((2048, 2048), 512)])
def test_number_of_stages_is_capped(patch: tuple[int, ...], cap: int) -> None:
    dim = len(patch)
    topo, rounded = topology_for(patch, (1.0,) * dim, 1, 2, 32, cap)
    assert topo.num_stages == MAX_STAGES[dim]
    assert topo.features_per_stage[-1] == cap
    assert rounded == patch


# --- plan -------------------------------------------------------------------------------------------


def _fingerprint_3d(channel: str = "CT") -> Fingerprint:
    """20 thick-slice CT-like cases, about 100 x 400 x 400 voxels of 3 x 0.8 x 0.8 mm."""
    rng = np.random.default_rng(0)
    cases = []
    for i in range(20):
        shape = (int(rng.integers(80, 120)), int(rng.integers(380, 420)), int(rng.integers(380, 420)))
        cases.append(CaseFingerprint(
            case_id=f"case_{i:03d}", spacing_mm=(float(rng.uniform(2.5, 3.5)), 0.8, 0.8), shape_zyx=shape,
            cropped_shape_zyx=(shape[0] - 10, shape[1] - 60, shape[2] - 60), class_voxels=(1000, 100, 10)))
    return Fingerprint(
        dataset_name="Dataset009_Synthetic", channel_names=(channel,),
        labels={"background": 0, "liver": 1, "tumour": 2}, file_ending=".nii.gz", image_dim=3,
        cases=tuple(cases),
        foreground_intensity=(IntensityProperties(mean=60.0, std=40.0, percentile_00_5=-100.0,
                                                  percentile_99_5=250.0),),
        median_relative_crop_volume=0.7)


def _fingerprint_2d() -> Fingerprint:
    """10 single-slice two-channel images (z lifted to 1 with spacing 999)."""
    cases = tuple(CaseFingerprint(f"img_{i}", (999.0, 0.5, 0.5), (1, 256, 256), (1, 200 + i, 210), (900, 100))
                  for i in range(10))
    props = IntensityProperties(0.0, 1.0, -1.0, 1.0)
    return Fingerprint("Dataset010_Flat", ("MRI", "CT"), {"background": 0, "cell": 1}, ".png", 2, cases,
                       (props, props), 0.9)


@pytest.fixture(scope="module")
def plans_by_budget() -> dict[int, Plans]:
    fp = _fingerprint_3d()
    return {gib: plan(fp, Budget(gpu_memory_bytes=gib * GiB, device="cuda")) for gib in (2, 8, 24)}


def test_3d_dataset_gets_3d_fullres_and_2d(plans_by_budget: dict[int, Plans]) -> None:
    for plans in plans_by_budget.values():
        assert set(plans.configurations) == {"3d_fullres", "2d"}
        full, flat = plans.configuration("3d_fullres"), plans.configuration("2d")
        assert full.dim == 3 and len(full.patch_size) == 3
        assert flat.dim == 2 and len(flat.patch_size) == 2
        assert full.spacing_mm[1:] == flat.spacing_mm[1:] == pytest.approx((0.8, 0.8))
        assert full.network.in_channels == 1 and full.network.num_classes == 3
        assert full.device == "cuda"


def test_plan_patches_fit_network_and_budget(plans_by_budget: dict[int, Plans]) -> None:
    for gib, plans in plans_by_budget.items():
        limit = gib * GiB * (1 - Budget().safety_margin)
        for cfg in plans.configurations.values():
            div = cfg.network.patch_divisor()
            assert all(p % d == 0 for p, d in zip(cfg.patch_size, div)), (gib, cfg.name, cfg.patch_size, div)
            peak = cfg.memory["predicted_peak_bytes"]
            assert 0 < peak <= limit, (gib, cfg.name, peak / GiB)
            # the recorded peak is the one of the planned topology, batch and patch
            assert peak == rough_training_peak_bytes(cfg.network, cfg.batch_size, cfg.patch_size)
            assert cfg.batch_size >= 2 or cfg.batch_size * cfg.accumulation_steps >= 2


def test_larger_budget_never_gives_less_voxels_per_step(plans_by_budget: dict[int, Plans]) -> None:
    for name in ("3d_fullres", "2d"):
        voxels = [math.prod(p.configuration(name).patch_size) * p.configuration(name).batch_size
                  for _, p in sorted(plans_by_budget.items())]
        assert voxels == sorted(voxels), (name, voxels)
        assert voxels[0] < voxels[-1]  # 2 GiB really constrains this dataset
    small = plans_by_budget[2].configuration("3d_fullres").patch_size
    median = plans_by_budget[2].configuration("3d_fullres").median_shape_zyx
    assert math.prod(small) < math.prod(median)


def test_plan_normalization_and_json_round_trip(plans_by_budget: dict[int, Plans], tmp_path: Path) -> None:
    plans = plans_by_budget[8]
    assert plans.normalization == ("ct",)
    assert plans.use_nonzero_mask == (False,)  # only z-score channels use the mask
    assert plans.intensity_properties[0].percentile_99_5 == 250.0
    assert plans.gpu_memory_bytes == 8 * GiB and plans.num_classes == 3
    plans.to_json(tmp_path / "plans.json")
    assert Plans.from_json(tmp_path / "plans.json") == plans


def test_zscore_channel_uses_nonzero_mask_when_cropping_removes_much() -> None:
    fp = _fingerprint_3d(channel="T2")
    plans = plan(fp, Budget())
    assert plans.normalization == ("zscore",) and plans.use_nonzero_mask == (True,)  # median crop 0.7 < 0.75


def test_2d_data_gets_only_a_2d_configuration() -> None:
    plans = plan(_fingerprint_2d(), Budget(gpu_memory_bytes=8 * GiB))
    assert list(plans.configurations) == ["2d"]
    cfg = plans.configuration("2d")
    assert cfg.dim == 2 and len(cfg.patch_size) == 2
    assert cfg.spacing_mm == pytest.approx((999.0, 0.5, 0.5))
    assert cfg.median_shape_zyx[0] == 1
    assert all(p % d == 0 for p, d in zip(cfg.patch_size, cfg.network.patch_divisor()))
    assert plans.normalization == ("zscore", "ct")
    assert cfg.network.in_channels == 2 and cfg.network.num_classes == 2
    with pytest.raises(KeyError, match="3d_fullres"):
        plans.configuration("3d_fullres")
