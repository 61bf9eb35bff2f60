from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from factories import thick_slice_fingerprint

from autoseg.core.errors import InputError
from autoseg.core.units import GiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.fit import predicted_training_bytes, training_memory_model
from autoseg.memory.loader_worker import worker_bytes
from autoseg.plan.budget import Budget
from autoseg.plan.configuration import FILL_TARGET, MIN_PATCH_VOXELS
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.iteration_target import iteration_target
from autoseg.plan.planner import lowres_spacing, plan, target_spacing
from autoseg.plan.plans import ConfigurationPlan, IntensityProperties, Plans
from autoseg.plan.sizing import loader_workers
from autoseg.plan.step_cost import rough_training_peak_bytes
from autoseg.plan.throughput import mapped_bytes, step_elements
from autoseg.plan.topology_rules import MAX_STAGES, topology_for
from autoseg.plan.training_data import loader_config

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
    topo, patch = topology_for(
        (20, 160, 160), (5.0, 1.0, 1.0), in_channels=1, num_outputs=3, base_features=32, max_features=320
    )
    assert topo.strides == ((1, 1, 1), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2))
    # kernel 1 along z while z is > 2x the finest spacing (stages 0 and 1), 3 once it is within 2x
    assert topo.kernel_sizes == ((1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    assert topo.features_per_stage == (32, 64, 128, 256, 320, 320)  # doubling, capped
    assert topo.patch_divisor() == (4, 32, 32)
    assert patch == (20, 160, 160)
    assert topo.dim == 3 and topo.in_channels == 1 and topo.num_outputs == 3


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


def _fingerprint_2d() -> Fingerprint:
    """10 single-slice two-channel images (z lifted to 1 with spacing 999)."""
    cases = tuple(
        CaseFingerprint(f"img_{i}", (999.0, 0.5, 0.5), (1, 256, 256), (1, 200 + i, 210), (900, 100)) for i in range(10)
    )
    props = IntensityProperties(0.0, 1.0, -1.0, 1.0)
    return Fingerprint(
        "Dataset010_Flat", ("MRI", "CT"), {"background": 0, "cell": 1}, ".png", 2, cases, (props, props), 0.9
    )


def _rough_plan(gib: float, fp: Fingerprint | None = None, **budget) -> Plans:
    """A plan with the first-order memory estimate instead of simulations (milliseconds, same search)."""
    budget.setdefault("cpu_count", 8)
    return plan(
        fp or thick_slice_fingerprint(),
        Budget(gpu_memory_bytes=int(gib * GiB), **budget),
        peak_fn=rough_training_peak_bytes,
    )


def _fill_exempt(cfg: ConfigurationPlan) -> bool:
    """The 85% rule does not apply: the patch covers the median image (then the batch is what is left)."""
    return cfg.limited_by in ("median_shape", "batch_cap")


def _check_fill(cfg: ConfigurationPlan, budget_bytes: float) -> None:
    peak = cfg.memory["predicted_peak_bytes"]
    assert peak <= budget_bytes * (1 - Budget().safety_margin), (cfg.name, peak / GiB)
    if _fill_exempt(cfg):
        median = cfg.median_shape_zyx[-cfg.dim :]
        assert all(p >= m for p, m in zip(cfg.patch_size, median)), (cfg.name, cfg.patch_size, median)
        assert any("exempt" in n for n in cfg.notes)
    else:
        assert cfg.limited_by == "memory"
        assert peak >= FILL_TARGET * budget_bytes, (cfg.name, cfg.patch_size, cfg.batch_size, peak / budget_bytes)


@pytest.fixture(scope="module")
def rough_plans() -> dict[int, Plans]:
    fp = thick_slice_fingerprint()
    return {gib: _rough_plan(gib, fp) for gib in (2, 4, 8, 16, 24, 40, 80)}


def test_3d_dataset_gets_3d_fullres_and_2d(rough_plans: dict[int, Plans]) -> None:
    for plans in rough_plans.values():
        assert (
            {"3d_fullres", "2d"} <= set(plans.configurations) <= {"3d_fullres", "3d_lowres", "3d_cascade_fullres", "2d"}
        )
        full, flat = plans.configuration("3d_fullres"), plans.configuration("2d")
        assert full.dim == 3 and len(full.patch_size) == 3
        assert flat.dim == 2 and len(flat.patch_size) == 2
        assert full.spacing_mm[1:] == flat.spacing_mm[1:] == pytest.approx((0.8, 0.8))
        assert full.network.in_channels == 1 and full.network.num_outputs == 3
        assert full.device == "cuda" and full.precision == "fp16"  # AMP, as nnU-Net


def test_every_budget_is_filled_or_exempt(rough_plans: dict[int, Plans]) -> None:
    for gib, plans in rough_plans.items():
        for cfg in plans.configurations.values():
            div = cfg.network.patch_divisor()
            assert all(p % d == 0 for p, d in zip(cfg.patch_size, div)), (gib, cfg.name, cfg.patch_size, div)
            _check_fill(cfg, gib * GiB)
            # the recorded peak is the one of the planned topology, batch, patch and settings
            assert cfg.memory["predicted_peak_bytes"] == rough_training_peak_bytes(
                cfg.network, cfg.batch_size, cfg.patch_size, cfg.precision, cfg.checkpointing, cfg.accumulation_steps
            )


def test_effective_batch_is_at_least_two(rough_plans: dict[int, Plans]) -> None:
    for plans in [*rough_plans.values(), _rough_plan(1)]:
        for cfg in plans.configurations.values():
            assert cfg.batch_size * cfg.accumulation_steps >= 2
            assert cfg.accumulation_steps == (2 if cfg.batch_size == 1 else 1)


def test_small_budget_checkpoints_then_accumulates() -> None:
    # the rough estimate has no CUDA context, so 1-2 GiB here is as tight as 2-4 GiB with the model
    ckpt = _rough_plan(2).configuration("3d_fullres")
    assert ckpt.checkpointing and ckpt.batch_size == 2 and math.prod(ckpt.patch_size) >= 96**3
    assert any(n.startswith("activation checkpointing") and "fewer than the minimum 884736" in n for n in ckpt.notes)
    single = _rough_plan(1).configuration("3d_fullres")
    assert single.checkpointing and single.batch_size == 1 and single.accumulation_steps == 2
    assert any("micro-batch 1 with 2 accumulation steps" in n for n in single.notes)
    assert math.prod(single.patch_size) > 1.5 * 48 * 112 * 96  # larger than the patch batch 2 left


def test_larger_budget_never_gives_less_voxels_per_step(rough_plans: dict[int, Plans]) -> None:
    for name in ("3d_fullres", "2d"):
        voxels = [
            math.prod(p.configuration(name).patch_size) * p.configuration(name).batch_size
            for _, p in sorted(rough_plans.items())
        ]
        assert voxels == sorted(voxels), (name, voxels)
        assert voxels[0] < voxels[-1]
    full_80 = rough_plans[80].configuration("3d_fullres")
    assert full_80.limited_by == "batch_cap"  # covers the median image; 5% of 20 cases is batch 2
    assert full_80.memory["predicted_peak_bytes"] < FILL_TARGET * 80 * GiB


def test_lowres_only_when_fullres_covers_under_a_quarter(rough_plans: dict[int, Plans]) -> None:
    for gib, plans in rough_plans.items():
        full = plans.configuration("3d_fullres")
        coverage = math.prod(min(p / m, 1) for p, m in zip(full.patch_size, full.median_shape_zyx))
        assert ("3d_lowres" in plans.configurations) == (coverage < 0.25), (gib, coverage)
        if "3d_lowres" in plans.configurations:
            low = plans.configuration("3d_lowres")
            assert all(a >= b for a, b in zip(low.spacing_mm, full.spacing_mm)) and low.spacing_mm != full.spacing_mm
            low_cov = math.prod(min(p / m, 1) for p, m in zip(low.patch_size, low.median_shape_zyx))
            assert low_cov > 2 * coverage
            assert any("cascade" in n for n in low.notes)


def test_the_cascade_is_planned_with_lowres_and_takes_its_one_hot_prediction(rough_plans: dict[int, Plans]) -> None:
    """3d_cascade_fullres: planned exactly when 3d_lowres is; 3d_fullres's spacing, patch and data, its network with
    one input channel per image channel and per foreground class (K - 1), its peak the memory model's for them."""
    planned = {gib: "3d_lowres" in plans.configurations for gib, plans in rough_plans.items()}
    assert any(planned.values()) and not all(planned.values())  # both cases are tested
    for gib, plans in rough_plans.items():
        assert ("3d_cascade_fullres" in plans.configurations) == planned[gib], gib
        if not planned[gib]:
            continue
        full, cascade = plans.configuration("3d_fullres"), plans.configuration("3d_cascade_fullres")
        assert cascade.network.in_channels == 1 + (3 - 1)  # one image channel, labels background + 2 classes
        assert cascade.network.num_outputs == full.network.num_outputs
        assert (cascade.spacing_mm, cascade.patch_size, cascade.batch_size) == (
            full.spacing_mm,
            full.patch_size,
            full.batch_size,
        )
        assert (cascade.previous_stage, cascade.preprocessed_as, cascade.data_configuration) == (
            "3d_lowres",
            "3d_fullres",
            "3d_fullres",
        )
        assert (
            cascade.memory["predicted_peak_bytes"]
            == rough_training_peak_bytes(
                cascade.network,
                cascade.batch_size,
                cascade.patch_size,
                cascade.precision,
                cascade.checkpointing,
                cascade.accumulation_steps,
            )
            > full.memory["predicted_peak_bytes"]
        )
        assert plans.input_channels(cascade) == 3 and plans.input_channels(full) == 1


def test_lowres_spacing_grows_fine_axes_first() -> None:
    # thick slices: z (3 mm) stays while y and x (0.8 mm) grow by 3% steps (up to half of z's spacing)
    z, y, x = lowres_spacing((3.0, 0.8, 0.8), (100, 400, 400), patch_voxels=3e6)
    assert z == 3.0 and y == x and y < 1.5
    assert 3e6 / (100 * 400 * 400 * 0.64 / (y * x)) >= 0.5  # a 3 M voxel patch covers half
    assert 3e6 / (100 * 400 * 400 * 0.64 / (y / 1.03 * x / 1.03)) < 0.5  # one step fewer would not
    z, y, x = lowres_spacing((3.0, 0.8, 0.8), (100, 400, 400), patch_voxels=1e6)
    assert z > 3.0 and y == x >= z / 2 * 0.99  # then all axes grow
    assert lowres_spacing((1.0, 1.0, 1.0), (100, 100, 100), patch_voxels=1e6) == (1.0, 1.0, 1.0)


def test_plan_normalization_and_json_round_trip(rough_plans: dict[int, Plans], tmp_path: Path) -> None:
    plans = rough_plans[8]
    assert plans.normalization == ("ct",)
    assert plans.use_nonzero_mask == (False,)  # only z-score channels use the mask
    assert plans.intensity_properties[0].percentile_99_5 == 250.0
    assert plans.gpu_memory_bytes == 8 * GiB and plans.num_label_values == 3
    plans.to_json(tmp_path / "plans.json")
    assert Plans.from_json(tmp_path / "plans.json") == plans


def test_zscore_channel_uses_nonzero_mask_when_cropping_removes_much() -> None:
    plans = _rough_plan(8, thick_slice_fingerprint(channel="T2"))
    assert plans.normalization == ("zscore",) and plans.use_nonzero_mask == (True,)  # median crop 0.7 < 0.75


def test_2d_data_gets_only_a_2d_configuration() -> None:
    plans = _rough_plan(8, _fingerprint_2d())
    assert list(plans.configurations) == ["2d"]
    cfg = plans.configuration("2d")
    assert cfg.dim == 2 and len(cfg.patch_size) == 2
    assert cfg.spacing_mm == pytest.approx((999.0, 0.5, 0.5))
    assert cfg.median_shape_zyx[0] == 1
    assert all(p % d == 0 for p, d in zip(cfg.patch_size, cfg.network.patch_divisor()))
    assert plans.normalization == ("zscore", "ct")
    assert cfg.network.in_channels == 2 and cfg.network.num_outputs == 2
    assert cfg.limited_by == "batch_cap" and cfg.batch_size == 2  # 10 small images: 5% of them is one patch
    with pytest.raises(InputError, match="3d_fullres"):
        plans.configuration("3d_fullres")


# --- compute: FLOPs and seconds ---------------------------------------------------------------------


def test_cpu_plan_keeps_iterations_within_the_time_target() -> None:
    flops = 10e9
    for target in (0.5, 2.0):
        plans = _rough_plan(8, device="cpu", cpu_flops_per_second=flops, iteration=iteration_target(seconds=target))
        assert plans.cpu_flops_per_second == flops  # recorded: the figure the patches were sized for
        for cfg in plans.configurations.values():
            assert cfg.device == "cpu" and cfg.precision == "fp32" and not cfg.checkpointing
            assert cfg.predicted_seconds_per_iteration == pytest.approx(cfg.flops_per_iteration / flops)
            assert cfg.predicted_seconds_per_iteration <= target
            assert cfg.network.features_per_stage[0] in (16, 8)
        full = plans.configuration("3d_fullres")
        assert full.limited_by == "time" and full.predicted_seconds_per_iteration > 0.5 * target
        assert cfg.loader_workers == 0  # workers would take the cores the CPU training step uses


def test_a_cpu_plan_counts_feature_map_elements_at_their_own_rate() -> None:
    """With an element rate (measured: ``plan.calibration.calibrate_cpu_throughput``) a planned step's seconds are its
    FLOPs plus its feature maps' elements, each at its rate; the patch shrinks to keep the target, and the plan
    records both rates."""
    flops_only = _rough_plan(8, device="cpu", cpu_flops_per_second=10e9, iteration=iteration_target(seconds=1.0))
    plans = _rough_plan(
        8,
        device="cpu",
        cpu_flops_per_second=10e9,
        cpu_elements_per_second=40e6,
        iteration=iteration_target(seconds=1.0),
    )
    assert (plans.cpu_flops_per_second, plans.cpu_elements_per_second) == (10e9, 40e6)

    def elements(cfg: ConfigurationPlan) -> float:
        return step_elements(cfg.network, tuple(cfg.patch_size), cfg.batch_size) * cfg.accumulation_steps

    for cfg in plans.configurations.values():
        assert elements(cfg) / 40e6 > 0.1 * cfg.predicted_seconds_per_iteration  # the term matters at these rates
        assert cfg.predicted_seconds_per_iteration == pytest.approx(
            cfg.flops_per_iteration / 10e9 + elements(cfg) / 40e6
        )
        assert cfg.predicted_seconds_per_iteration <= 1.0
    # the plan of the FLOPs alone would be too slow at these rates
    full = flops_only.configuration("3d_fullres")
    assert full.flops_per_iteration / 10e9 + elements(full) / 40e6 > 1.0
    assert plans.configuration("3d_fullres").patch_size != full.patch_size


def test_a_cpu_plan_counts_the_pages_its_large_feature_maps_map_afresh() -> None:
    """On a fast CPU the patch grows until stage 0's feature maps reach glibc's mmap threshold: those blocks are
    mapped and faulted in again every step, and the plan's seconds count them at the measured mapping rate."""
    rates = {"cpu_flops_per_second": 1e12, "cpu_elements_per_second": 1e9, "cpu_mapped_bytes_per_second": 2e9}
    plans = _rough_plan(8, device="cpu", iteration=iteration_target(seconds=2.0), **rates)
    assert plans.cpu_mapped_bytes_per_second == 2e9
    mapped_configs = 0
    for cfg in plans.configurations.values():
        shape = (cfg.network, tuple(cfg.patch_size), cfg.batch_size)
        mapped = mapped_bytes(*shape) * cfg.accumulation_steps
        mapped_configs += mapped > 0
        assert cfg.predicted_seconds_per_iteration == pytest.approx(
            cfg.flops_per_iteration / 1e12 + step_elements(*shape) * cfg.accumulation_steps / 1e9 + mapped / 2e9
        )
        assert cfg.predicted_seconds_per_iteration <= 2.0
    assert mapped_configs > 0


def test_a_cuda_plan_records_no_cpu_throughput() -> None:
    cuda = _rough_plan(8, device="cuda", cpu_flops_per_second=10e9, cpu_rates_source="--cpu-flops")
    assert cuda.cpu_flops_per_second is None and cuda.cpu_rates_source == ""
    timed = _rough_plan(8, device="cuda", iteration=iteration_target(1800.0))  # sized by memory, not time
    assert (timed.iteration, timed.time_budget_seconds) == (None, None)


def test_a_cpu_plan_records_where_its_rates_came_from() -> None:
    source = "measured now, not cached: fallback to one thread's rates per CPU second (a floor ...)"
    plans = _rough_plan(8, device="cpu", cpu_flops_per_second=10e9, cpu_rates_source=source)
    assert plans.cpu_rates_source == source


def test_cpu_width_drops_to_8_only_when_16_leaves_too_small_a_patch() -> None:
    roomy = _rough_plan(8, device="cpu", cpu_flops_per_second=20e9, iteration=iteration_target(seconds=2.0))
    assert roomy.configuration("3d_fullres").network.features_per_stage[0] == 16
    tight = _rough_plan(8, device="cpu", cpu_flops_per_second=1e9, iteration=iteration_target(seconds=0.5))
    cfg = tight.configuration("3d_fullres")
    assert cfg.network.features_per_stage[0] == 8
    assert any("base width 8 instead of 16" in n for n in cfg.notes)


def test_cuda_seconds_come_from_the_tabulated_device() -> None:
    a100 = _rough_plan(40, gpu_name="NVIDIA A100-SXM4-40GB").configuration("3d_fullres")
    t4 = _rough_plan(40, gpu_name="Tesla T4").configuration("3d_fullres")
    assert a100.flops_per_iteration == t4.flops_per_iteration  # same plan: the name only changes the seconds
    assert a100.predicted_seconds_per_iteration * 312 == pytest.approx(t4.predicted_seconds_per_iteration * 65)
    assert any("A100" in n for n in a100.notes)


def test_checkpointing_adds_a_third_of_the_flops() -> None:
    from autoseg.plan.throughput import conv_flops

    for cfg in (_rough_plan(1).configuration("3d_fullres"), _rough_plan(8).configuration("3d_fullres")):
        step = conv_flops(cfg.network, cfg.patch_size, cfg.batch_size) * cfg.accumulation_steps
        assert cfg.flops_per_iteration == pytest.approx(step * (4 / 3 if cfg.checkpointing else 1))
    assert _rough_plan(1).configuration("3d_fullres").checkpointing


# --- host RAM: processes and workers ----------------------------------------------------------------


def test_small_ram_gives_one_process_and_no_workers() -> None:
    plans = _rough_plan(8, host_ram_bytes=1 * GiB)
    assert plans.preprocessing_processes == 1
    assert all(cfg.loader_workers == 0 for cfg in plans.configurations.values())
    assert plans.host_memory["preprocess_worker_bytes"] > 0.8 * GiB / 2


def _worker_bytes(cfg: ConfigurationPlan, depth: int) -> int:
    """One loader worker of ``cfg`` (1 channel), on-the-fly augmentation: what the planner sizes by."""
    c = loader_config(cfg, augment=True)
    return worker_bytes(c.patch_size, c.enlarged_patch_size, c.batch_size, 1, depth, dummy_2d=c.dummy_2d)["total"]


def test_processes_and_workers_follow_ram_and_cpu_count() -> None:
    plans = _rough_plan(8, host_ram_bytes=8 * GiB, cpu_count=64)
    host = plans.host_memory
    usable = 8 * GiB * 0.8
    assert host["usable_host_ram_bytes"] == usable and host["cpu_count"] == 64
    assert plans.preprocessing_processes == int(usable // host["preprocess_worker_bytes"])
    assert 1 < plans.preprocessing_processes < 64
    for cfg in plans.configurations.values():  # each configuration its own: a 2d batch may be much larger
        assert cfg.loader_worker_bytes == _worker_bytes(cfg, cfg.loader_queue_depth)
        assert cfg.loader_workers == int((usable - 2 * GiB) // cfg.loader_worker_bytes)
        assert 0 < cfg.loader_workers < 63
    capped = _rough_plan(8, host_ram_bytes=512 * GiB, cpu_count=4)
    assert capped.preprocessing_processes == 4
    assert all(
        c.loader_workers == 3 and c.loader_queue_depth == 2  # one core feeds the GPU
        for c in capped.configurations.values()
    )


def test_queue_depth_drops_to_one_where_that_fits_more_workers() -> None:
    """Each worker's bytes: its process, a batch in flight, queue depth + 1 shared slots (worker_bytes)."""
    cfg = _rough_plan(8, cpu_count=4).configuration("3d_fullres")
    ram = int((2 * GiB + 3 * _worker_bytes(cfg, 1) + 2**20) / 0.8)  # 3 workers fit at depth 1, 2 at depth 2
    assert 3 * _worker_bytes(cfg, 2) > 0.8 * ram - 2 * GiB
    tight = loader_workers(cfg, 1, Budget(host_ram_bytes=ram, cpu_count=4))
    assert tight == {"loader_workers": 3, "loader_queue_depth": 1, "loader_worker_bytes": _worker_bytes(cfg, 1)}
    roomy = loader_workers(cfg, 1, Budget(host_ram_bytes=4 * ram, cpu_count=4))
    assert roomy["loader_workers"] == 3 and roomy["loader_queue_depth"] == 2


# --- Budget -------------------------------------------------------------------------------------------


def test_budget_errors_name_what_to_change() -> None:
    with pytest.raises(ValueError, match="use 'cuda' or 'cpu'"):
        Budget(device="tpu")
    with pytest.raises(ValueError, match="leave Budget.precision unset"):
        Budget(device="cpu", precision="bf16")
    with pytest.raises(ValueError, match=r"safety_margin .* must be in \[0, 0.5\)"):
        Budget(safety_margin=0.6)
    assert Budget(device="cpu", host_ram_bytes=4 * GiB).memory_bytes == 4 * GiB


# --- with the simulated memory model ------------------------------------------------------------------


def _check_model_memory(cfg: ConfigurationPlan) -> None:
    """The recorded peak and terms are the memory model's for the planned step."""
    peak = predicted_training_bytes(
        cfg.network,
        cfg.batch_size,
        cfg.patch_size,
        cfg.precision,
        cfg.checkpointing,
        device=cfg.device,
        accumulation_steps=cfg.accumulation_steps,
    )
    mem = cfg.memory
    assert mem["predicted_peak_bytes"] == peak
    step = training_memory_model(cfg.network, cfg.precision, cfg.checkpointing, "sgd", cfg.accumulation_steps).predict(
        cfg.batch_size, cfg.patch_size
    )
    device_terms = {k: v for k, v in predict_device_peak(step, cfg.device).items() if k != "total"}
    assert sum(mem[k] for k in device_terms) == peak
    tensor_terms = ("parameters", "gradients", "optimizer_state", "batch", "activations")
    assert sum(mem[k] for k in tensor_terms) == mem["tensors"] == step.peak_bytes


def test_model_backed_configuration_records_the_models_terms() -> None:
    """A tiny 3D space (a 3-stage network: three quick simulations)."""
    from autoseg.plan.configuration import configuration
    from autoseg.plan.patch_search import SearchSpace

    space = SearchSpace((1.0, 1.0, 1.0), (16, 24, 24), 1, 2, dataset_voxels=40 * 16 * 24 * 24)
    cfg = configuration(
        "3d_fullres", (1.0, 1.0, 1.0), (16, 24, 24), space, Budget(gpu_memory_bytes=2 * GiB, cpu_count=2)
    )
    assert cfg.patch_size == (16, 24, 24) and cfg.network.num_stages == 3
    assert cfg.limited_by == "batch_cap" and cfg.batch_size == 2  # 5% of 40 cases is 2 of them
    _check_model_memory(cfg)
    assert cfg.memory["cuda_context"] == 512 * 2**20


@pytest.mark.slow
def test_model_backed_plan_of_a_small_dataset() -> None:
    """Hippocampus-sized images: the patch covers them at every budget, the batch fills the rest."""
    cases = tuple(
        CaseFingerprint(f"c{i}", (1.0, 1.0, 1.0), (36, 50, 35), (36, 50, 35), (900, 50, 50)) for i in range(40)
    )
    props = IntensityProperties(0.0, 1.0, -1.0, 1.0)
    fp = Fingerprint(
        "Dataset004_Small", ("MRI",), {"background": 0, "a": 1, "b": 2}, ".nii.gz", 3, cases, (props,), 1.0
    )
    plans = plan(fp, Budget(gpu_memory_bytes=4 * GiB, cpu_count=4))
    full = plans.configuration("3d_fullres")
    assert full.patch_size == (40, 56, 40) and full.limited_by in ("median_shape", "batch_cap")
    _check_model_memory(full)
    _check_fill(full, 4 * GiB)


@pytest.mark.slow
def test_model_backed_plans_fill_every_budget() -> None:
    """The CT-like dataset at 2-80 GiB with the simulated memory model (about a minute: ~12 networks)."""
    fp = thick_slice_fingerprint()
    voxels = []
    for gib in (2, 4, 8, 16, 24, 40, 80):
        plans = plan(fp, Budget(gpu_memory_bytes=gib * GiB, cpu_count=8))
        for cfg in plans.configurations.values():
            _check_model_memory(cfg)
            _check_fill(cfg, gib * GiB)
            assert cfg.batch_size * cfg.accumulation_steps >= 2
        full = plans.configuration("3d_fullres")
        voxels.append(math.prod(full.patch_size) * full.batch_size)
        if math.prod(full.patch_size) < min(MIN_PATCH_VOXELS["cuda"][3], math.prod(full.median_shape_zyx)):
            assert full.checkpointing and full.batch_size == 1
    assert voxels == sorted(voxels)


@pytest.mark.parametrize(("device", "flag"), [("cuda", "--gpu-memory"), ("cpu", "--ram")])
def test_a_budget_too_small_for_any_network_names_the_smallest_that_works(device: str, flag: str) -> None:
    import re

    fp = thick_slice_fingerprint()
    tiny = {"gpu_memory_bytes": 2**10} if device == "cuda" else {"host_ram_bytes": 2**10}
    with pytest.raises(InputError, match=f"no network fits.*give at least {flag}") as info:
        plan(fp, Budget(device=device, cpu_count=8, **tiny), peak_fn=rough_training_peak_bytes)
    needed = int(re.search(rf"{flag} (\d+)MiB", str(info.value)).group(1)) * 2**20
    enough = {"gpu_memory_bytes": needed} if device == "cuda" else {"host_ram_bytes": needed}
    plans = plan(fp, Budget(device=device, cpu_count=8, **enough), peak_fn=rough_training_peak_bytes)
    assert "3d_fullres" in plans.configurations  # the budget the message names is enough


# --- the residual encoder U-Net (--architecture resenc) -----------------------------------------------


def test_resenc_budget_plans_residual_encoders_with_nnunets_block_counts(tmp_path: Path) -> None:
    """Every configuration names the architecture and carries nnU-Net's ResEnc block counts for its depth and one
    conv block per decoder stage; plans.json keeps them; the plain U-Net stays the default."""
    from autoseg.model.topology import RESIDUAL_ENCODER_UNET, resenc_blocks_per_stage

    fp = thick_slice_fingerprint()
    plans = _rough_plan(8, fp, architecture=RESIDUAL_ENCODER_UNET)
    for cfg in plans.configurations.values():
        net = cfg.network
        assert net.architecture == RESIDUAL_ENCODER_UNET and net.conv_per_stage == 1
        assert net.blocks_per_stage == resenc_blocks_per_stage(net.num_stages)
        _check_fill(cfg, 8 * GiB)
    plans.to_json(tmp_path / "plans.json")
    assert Plans.from_json(tmp_path / "plans.json") == plans
    plain = _rough_plan(8, fp)
    assert all(
        c.network.architecture == "plain_unet" and c.network.blocks_per_stage == ()
        for c in plain.configurations.values()
    )
    with pytest.raises(ValueError, match=r"Budget.architecture 'resunet'.*--architecture unet\|resenc"):
        Budget(architecture="resunet")


@pytest.mark.slow
def test_model_backed_resenc_configuration_fits_the_budget_by_its_own_simulated_step() -> None:
    """The planner's peaks for a ResEnc plan are the memory model's for the ResEnc step (not the plain U-Net's):
    a deeper encoder holds more activations, so the same space and budget get a smaller step (about a minute)."""
    from dataclasses import replace

    from autoseg.plan.configuration import configuration
    from autoseg.plan.patch_search import SearchSpace

    space = SearchSpace((1.0, 1.0, 1.0), (32, 48, 48), 1, 2, dataset_voxels=1000 * 32 * 48 * 48)
    budget = Budget(gpu_memory_bytes=int(0.9 * GiB), cpu_count=2)
    cfgs = {
        arch: configuration("3d_fullres", (1.0, 1.0, 1.0), (32, 48, 48), space, replace(budget, architecture=arch))
        for arch in ("plain_unet", "residual_encoder_unet")
    }
    resenc = cfgs["residual_encoder_unet"]
    assert resenc.network.architecture == "residual_encoder_unet"
    _check_model_memory(resenc)
    assert resenc.memory["predicted_peak_bytes"] <= 0.9 * GiB * (1 - budget.safety_margin)
    plain_voxels = math.prod(cfgs["plain_unet"].patch_size) * cfgs["plain_unet"].batch_size
    assert math.prod(resenc.patch_size) * resenc.batch_size <= plain_voxels
