from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from autoseg.cli.main import main
from autoseg.core.errors import InputError
from autoseg.core.units import GiB
from autoseg.explain.explanation import Explanation, explain, next_patch_up
from autoseg.explain.format import format_bytes, format_explanation
from autoseg.memory.device import predict_device_peak
from autoseg.memory.inference import InferenceSetting, inference_memory
from autoseg.memory.step_record import StepConfig
from autoseg.memory.training import simulate_training_step
from autoseg.model.topology import NetworkTopology
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.iteration_target import IterationTarget
from autoseg.plan.plans import ConfigurationPlan, IntensityProperties, Plans

TOPOLOGY = NetworkTopology(
    dim=3,
    in_channels=1,
    num_outputs=3,
    features_per_stage=(8, 16, 32),
    kernel_sizes=((3, 3, 3),) * 3,
    strides=((1, 1, 1), (2, 2, 2), (2, 2, 2)),
)


def tiny_plans(device: str = "cuda", gpu_memory_bytes: int = 8 * GiB) -> Plans:
    """One 3d_fullres configuration: 3 stages (8-16-32 features), patch 16^3, batch 2, median 20x24x40."""
    config = ConfigurationPlan(
        name="3d_fullres",
        spacing_mm=(1.0, 1.0, 1.0),
        median_shape_zyx=(20, 24, 40),
        patch_size=(16, 16, 16),
        batch_size=2,
        accumulation_steps=1,
        network=TOPOLOGY,
        device=device,
        loader_workers=2,
    )
    return Plans(
        dataset_name="Dataset001_Tiny",
        channel_names=("CT",),
        labels={"background": 0, "a": 1, "b": 2},
        file_ending=".nii.gz",
        normalization=("ct",),
        use_nonzero_mask=(False,),
        intensity_properties=(IntensityProperties(0.0, 1.0, -1.0, 1.0),),
        configurations={"3d_fullres": config},
        gpu_memory_bytes=gpu_memory_bytes,
        host_ram_bytes=16 * GiB,
    )


@pytest.fixture(scope="module")
def explanation() -> Explanation:
    return explain(tiny_plans(), "3d_fullres")


def what_if(e: Explanation, change_prefix: str):
    return next(w for w in e.what_ifs if w.change.startswith(change_prefix))


def test_training_terms_sum_to_the_simulated_device_peak(explanation: Explanation) -> None:
    e = explanation
    assert sum(e.training_terms.values()) == e.training_total_bytes
    step = simulate_training_step(StepConfig(TOPOLOGY, 2, (16, 16, 16), device="cuda"))
    assert e.training_total_bytes == predict_device_peak(step, "cuda")["total"]
    assert e.training_terms["parameters"] == step.parameter_bytes
    assert e.training_terms["saved_activations"] + e.training_terms["transient_activations"] == step.activation_bytes
    assert e.training_terms["cuda_context"] == 512 * 2**20
    assert e.headroom_bytes == 8 * GiB - e.training_total_bytes
    assert e.what_ifs[0].change == "as planned" and e.what_ifs[0].total_bytes == e.training_total_bytes


def test_stage_rows_cover_every_stage_with_its_feature_map(explanation: Explanation) -> None:
    stages = {s.name: s for s in explanation.stages}
    expected = {"encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"}
    assert expected <= set(stages)
    assert (stages["encoder.0"].features, stages["encoder.0"].shape) == (8, (16, 16, 16))
    assert (stages["encoder.2"].features, stages["encoder.2"].shape) == (32, (4, 4, 4))
    assert (stages["decoder.1"].features, stages["decoder.1"].shape) == (16, (8, 8, 8))
    enc0 = stages["encoder.0"]
    assert enc0.map_copies == pytest.approx(enc0.activation_bytes / (2 * 8 * 16**3 * 4))
    assert enc0.map_copies >= 2  # two conv blocks: at least one saved map each
    assert [s.name for s in explanation.stages][:5] == ["encoder.0", "encoder.1", "encoder.2", "decoder.1", "decoder.0"]


def test_what_ifs_move_the_peak_the_expected_way(explanation: Explanation) -> None:
    e = explanation
    planned = e.training_total_bytes
    assert what_if(e, "batch 3").total_bytes > planned
    assert what_if(e, "batch 1").batch_size == 1 and what_if(e, "batch 1").total_bytes < planned
    assert what_if(e, "checkpointing on").total_bytes < planned
    assert what_if(e, "fp16").total_bytes < planned
    bigger = what_if(e, "patch")
    assert math.prod(bigger.patch_size) > 16**3 and bigger.total_bytes > planned
    least = what_if(e, "batch 1 + AMP + checkpointing")
    assert least.total_bytes == min(w.total_bytes for w in e.what_ifs)
    assert all(w.fits for w in e.what_ifs)


def test_next_patch_grows_the_axis_with_most_room() -> None:
    config = tiny_plans().configuration("3d_fullres")
    assert next_patch_up(config) == ((16, 16, 20), 2)  # x: 40 / 16 is the most room; divisor 4
    config = config.with_(median_shape_zyx=(200, 24, 40))
    assert next_patch_up(config) == ((20, 16, 16), 0)


def test_fits_and_headroom_follow_the_budget() -> None:
    e = explain(tiny_plans(gpu_memory_bytes=515 * 2**20), "3d_fullres")
    assert e.headroom_bytes < 0 and not e.to_dict()["fits"]
    assert not what_if(e, "batch 3").fits
    assert what_if(e, "batch 1 + AMP").fits
    assert "OVER BUDGET by" in format_explanation(e)


def test_inference_terms_sum_to_the_device_peak(explanation: Explanation) -> None:
    e = explanation
    setting = InferenceSetting(
        TOPOLOGY,
        (16, 16, 16),
        (20, 24, 40),
        3,
        "cuda",
        "fp32",
        mirror_axes=(0, 1, 2),
        output_dtype=None,
        accumulator_dtype="float16",
    )
    mem = inference_memory(setting, 1)
    assert sum(e.inference_terms.values()) == e.inference_total_bytes
    assert e.inference_total_bytes == predict_device_peak(mem, "cuda")["total"]
    assert e.inference_terms["accumulator"] == 3 * 16 * 24 * 40 * 2  # K x a patch-deep z-window x float16
    assert e.inference_terms["output"] == 0  # on CUDA the probabilities are on the host


def test_host_rows_use_the_median_shape_without_a_fingerprint(explanation: Explanation) -> None:
    (case,) = explanation.host_cases
    assert case.shape_zyx_before == case.shape_zyx_after == (20, 24, 40)
    # the export runs slab by slab: the label map whole, a slab of one class at a time (a float16 accumulator of
    # 16 slices, the tile's depth, is finished 16 // (K + 1) = 4 slices at a time)
    assert "probabilities" not in case.export and case.export["labels"] == 20 * 24 * 40
    assert case.export["best_score"] == 4 * 24 * 40 * 4
    assert explanation.loader_worker["slots"] == 3 * 2 * 16**3 * (4 + 1)  # queue depth 2 + 1 slots: float32 + int8


def test_host_rows_of_the_median_and_largest_case_from_the_fingerprint(tmp_path: Path, capsys) -> None:
    shapes = [((10, 30, 30), (10, 24, 24)), ((12, 40, 40), (12, 40, 40)), ((8, 20, 20), (8, 20, 20))]
    cases = tuple(
        CaseFingerprint(f"case_{i}", (2.0, 1.0, 1.0), shape, cropped, (1, 1, 1))
        for i, (shape, cropped) in enumerate(shapes)
    )
    fp = Fingerprint(
        dataset_name="Dataset001_Tiny",
        channel_names=("CT",),
        labels={"background": 0, "a": 1, "b": 2},
        file_ending=".nii.gz",
        image_dim=3,
        cases=cases,
        foreground_intensity=(IntensityProperties(0.0, 1.0, -1.0, 1.0),),
        median_relative_crop_volume=1.0,
    )
    e = explain(tiny_plans(), "3d_fullres", fingerprint=fp)
    median, largest = e.host_cases
    # resampled to 1 mm: z doubles; the median by resampled volume is case_0, the largest case_1
    assert median.label == "median case (case_0)" and median.shape_zyx_after == (20, 24, 24)
    assert median.shape_zyx_before == (10, 30, 30)  # as read (the crop is taken as the whole image)
    assert largest.label == "largest case (case_1)" and largest.shape_zyx_after == (24, 40, 40)
    assert largest.preprocess_worker["total"] > median.preprocess_worker["total"]
    plans_path = tmp_path / "plans.json"  # a workspace: the CLI finds fingerprint.json beside plans.json
    tiny_plans().to_json(plans_path)
    fp.to_json(tmp_path / "fingerprint.json")
    assert main(["explain", "-w", str(tmp_path)]) == 0
    assert "largest case (case_1)" in capsys.readouterr().out


def test_text_shows_the_json_figures(explanation: Explanation) -> None:
    text = format_explanation(explanation)
    data = json.loads(json.dumps(explanation.to_dict()))
    assert data["training_total_bytes"] == explanation.training_total_bytes
    assert f"predicted peak {format_bytes(data['training_total_bytes'])}" in text
    for w in data["what_ifs"]:
        assert w["change"] in text and format_bytes(w["total_bytes"]) in text
    for s in data["stages"]:
        assert f"{s['name']}" in text and format_bytes(s["activation_bytes"]) in text
    assert format_bytes(data["inference_total_bytes"]) in text
    t = data["training_terms"]
    activations = t["saved_activations"] + t["transient_activations"] + t["batch"]
    share = 100 * activations / data["training_total_bytes"]
    assert f"activations and the input batch are {share:.1f}% of the peak" in text
    batch_one = format_bytes(what_if(explanation, "batch 1").total_bytes)
    assert f"at batch 1 the step would still need {batch_one}" in text


def test_batch_one_sentence_names_only_the_levers_left(explanation: Explanation) -> None:
    text = format_explanation(replace(explanation, batch_size=1, checkpointing=True))
    assert "already at batch 1" in text and "only a smaller patch or AMP lowers it" in text
    text = format_explanation(replace(explanation, batch_size=1, device="cpu"))
    assert "only a smaller patch or checkpointing lowers it" in text


def test_cpu_device_uses_host_ram_and_fp32(explanation: Explanation) -> None:
    plans = tiny_plans()
    bf16 = plans.configuration("3d_fullres").with_(precision="bf16")
    plans = replace(plans, configurations={"3d_fullres": bf16})
    e = explain(plans, "3d_fullres", device="cpu")
    assert (e.budget_name, e.budget_bytes) == ("host RAM", 16 * GiB)
    assert (e.precision, e.planned_precision) == ("fp32", "bf16")  # AMP runs on CUDA only
    assert set(e.training_terms) >= {"runtime"} and "cuda_context" not in e.training_terms
    assert not any(w.precision != "fp32" for w in e.what_ifs)
    text = format_explanation(e)  # the fragmentation term on CPU is glibc's heap, in training and inference alike
    assert text.count("glibc's heap (freed blocks it keeps)") == 2 and "allocator fragmentation" not in text


def test_the_time_line_says_where_a_cpu_plan_s_rates_came_from(explanation: Explanation) -> None:
    source = "cached in /cache/cpu_throughput.json, measured 2026-11-27 09:30 UTC"
    e = replace(explanation, predicted_seconds_per_iteration=0.9, cpu_flops_per_second=500e9, cpu_rates_source=source)
    assert f"the CPU throughput the plan was made for, 500.0 GFLOP/s ({source})" in format_explanation(e)
    assert "(" not in format_explanation(replace(e, cpu_rates_source="")).split("500.0 GFLOP/s")[1].split("\n")[0]
    assert "time target" not in format_explanation(e)  # a plan of schema 9 and earlier records none
    reason = "3000 iterations in 85% of the 30m time budget: 0.51 s each"
    targeted = format_explanation(replace(e, iteration=IterationTarget(0.51, reason, 1800.0)))
    assert f"time target: 0.51 s per iteration ({reason})" in targeted


def test_unknown_configuration_and_device_say_what_exists() -> None:
    with pytest.raises(InputError, match="3d_fullres"):
        explain(tiny_plans(), "2d")
    with pytest.raises(ValueError, match="cuda"):
        explain(tiny_plans(), "3d_fullres", device="tpu")


def test_cli_json_matches_explain(tmp_path: Path, capsys, explanation: Explanation) -> None:
    path = tmp_path / "plans.json"
    tiny_plans().to_json(path)
    assert main(["explain", "--plans", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config_name"] == "3d_fullres"  # the default configuration
    assert data["training_total_bytes"] == explanation.training_total_bytes
    assert [w["total_bytes"] for w in data["what_ifs"]] == [w.total_bytes for w in explanation.what_ifs]


def test_cli_unknown_config_names_the_available_ones(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plans.json"
    tiny_plans().to_json(path)
    assert main(["explain", "--plans", str(path), "--config", "2d"]) == 2
    err = capsys.readouterr().err
    assert "autoseg explain: error" in err and "'2d'" in err and "3d_fullres" in err


def test_cli_workspace_without_plans_says_what_to_run(tmp_path: Path, capsys) -> None:
    assert main(["explain", "-w", str(tmp_path)]) == 2
    assert "autoseg plan" in capsys.readouterr().err


def test_the_network_line_names_the_architecture_and_its_blocks(explanation: Explanation) -> None:
    """The plain U-Net's conv blocks, or the residual encoder's stem and residual blocks per stage (nnU-Net's
    1-3-4 for three stages), with the parameter count the memory model simulated."""
    from autoseg.model.topology import RESIDUAL_ENCODER_UNET, resenc_blocks_per_stage

    text = format_explanation(explanation)
    params = explanation.training_terms["parameters"] // 4
    assert (
        f"network: plain_unet, 3 stages of 8-16-32 features; encoder: 2-2-2 conv blocks per stage; decoder: 2 "
        f"conv block(s) per stage; {params / 1e6:.2f} M parameters"
    ) in text
    plans = tiny_plans()
    network = replace(
        TOPOLOGY, architecture=RESIDUAL_ENCODER_UNET, conv_per_stage=1, blocks_per_stage=resenc_blocks_per_stage(3)
    )
    plans = replace(plans, configurations={"3d_fullres": plans.configurations["3d_fullres"].with_(network=network)})
    resenc = explain(plans, "3d_fullres")
    step = simulate_training_step(StepConfig(network, 2, (16, 16, 16)))
    assert resenc.training_terms["parameters"] == step.parameter_bytes > explanation.training_terms["parameters"]
    assert (
        "network: residual_encoder_unet, 3 stages of 8-16-32 features; encoder: stem + 1-3-4 residual blocks per "
        "stage; decoder: 1 conv block(s) per stage"
    ) in format_explanation(resenc)
    summary = json.loads(json.dumps(resenc.to_dict()))["network"]
    assert summary["architecture"] == RESIDUAL_ENCODER_UNET and summary["encoder_blocks_per_stage"] == [1, 3, 4]
    assert {s.name for s in resenc.stages} >= {"encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"}
