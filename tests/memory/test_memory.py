"""The memory model: simulated (FakeTensorMode) training and inference bytes against the same code run for
real on CPU, the linear timeline model against direct simulation, the device and host terms."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from autoseg.core.units import MiB
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.device import CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, predict_device_peak
from autoseg.memory.fit import TrainingMemoryModel, predicted_training_bytes
from autoseg.memory.host import export_bytes, preprocess_worker_bytes
from autoseg.memory.inference import InferenceSetting, inference_memory
from autoseg.memory.inference_simulation import measure_inference_bytes
from autoseg.memory.step_record import StepConfig
from autoseg.memory.training import measure_training_step, simulate_training_step
from autoseg.memory.training_simulation import training_step_flops
from autoseg.model.network import build_network
from autoseg.model.topology import RESIDUAL_ENCODER_UNET, NetworkTopology, preset_fields


def topo(
    dim: int,
    features: tuple[int, ...],
    strides: list[tuple[int, ...]],
    in_channels: int = 1,
    num_outputs: int = 3,
    kernels: list[tuple[int, ...]] | None = None,
    deep_supervision: bool = True,
) -> NetworkTopology:
    kernels = kernels or [(3,) * dim] * len(features)
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=features,
        kernel_sizes=tuple(kernels),
        strides=tuple(strides),
        deep_supervision=deep_supervision,
    )


def resenc(topology: NetworkTopology) -> NetworkTopology:
    """The same shape as a residual encoder U-Net, as the planner builds one (nnU-Net's block counts)."""
    return replace(topology, **preset_fields(RESIDUAL_ENCODER_UNET, topology.num_stages))


ISO3D = topo(3, (4, 8, 16, 32), [(1, 1, 1)] + [(2, 2, 2)] * 3)
ANISO3D = topo(
    3,
    (4, 8, 16, 16),
    [(1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)],
    in_channels=2,
    num_outputs=4,
    kernels=[(1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3)],
)
FIVE3D = topo(
    3, (4, 8, 8, 16, 16), [(1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2)], in_channels=4, num_outputs=5
)
FIVE2D = topo(2, (4, 8, 16, 16, 16), [(1, 1)] + [(2, 2)] * 4, num_outputs=2)
SIX2D = topo(2, (4, 4, 8, 8, 16, 16), [(1, 1), (2, 2), (2, 2), (2, 1), (2, 2), (2, 1)], in_channels=2)
SEVEN2D = topo(
    2, (4, 4, 8, 8, 8, 16, 16), [(1, 1), (2, 2), (2, 2), (1, 2), (2, 1), (1, 2), (2, 1)], in_channels=3, num_outputs=14
)
FOUR2D_NO_DS = topo(2, (4, 8, 8, 16), [(1, 1)] + [(2, 2)] * 3, num_outputs=2, deep_supervision=False)

# Three sigmoid region outputs + an ignore label, and three softmax classes + an ignore label (ISO3D's 3 outputs).
REGIONS_IGNORE = LabelScheme.from_labels(
    {"background": 0, "wt": [1, 2, 3], "tc": [2, 3], "et": 3, "ignore": 4}, [1, 2, 3]
)
CLASSES_IGNORE = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2, "ignore": 3})

# (name, topology, batch, patch, keyword arguments)
CONFIGS = [
    ("3d-iso-4st-b2-fp32", ISO3D, 2, (16, 16, 16), {}),
    ("3d-aniso-4st-b1-ckpt-2ch", ANISO3D, 1, (8, 16, 16), {"checkpointing": True}),
    ("3d-5st-b2-bf16-ckpt-4ch", FIVE3D, 2, (8, 32, 32), {"precision": "bf16", "checkpointing": True}),
    ("2d-5st-b4-bf16", FIVE2D, 4, (32, 32), {"precision": "bf16"}),
    ("2d-6st-aniso-b2-fp16", SIX2D, 2, (64, 16), {"precision": "fp16"}),
    ("2d-7st-aniso-b3-ckpt-14cls", SEVEN2D, 3, (32, 32), {"checkpointing": True}),
    ("2d-4st-b1-no-deep-supervision", FOUR2D_NO_DS, 1, (32, 32), {}),
    ("3d-iso-4st-b2-accumulation-adam", ISO3D, 2, (16, 16, 16), {"accumulation_steps": 2, "optimizer": "adam"}),
    ("3d-iso-4st-b1-bf16", ISO3D, 1, (16, 16, 32), {"precision": "bf16"}),
    ("3d-iso-4st-b2-regions-ignore", ISO3D, 2, (16, 16, 16), {"labels": REGIONS_IGNORE}),
    ("3d-iso-4st-b2-classes-ignore-bf16", ISO3D, 2, (16, 16, 16), {"labels": CLASSES_IGNORE, "precision": "bf16"}),
    ("2d-4st-b2-one-output", topo(2, (4, 8, 8, 16), [(1, 1)] + [(2, 2)] * 3, num_outputs=1), 2, (32, 32), {}),
]


@pytest.mark.parametrize("name, topology, batch, patch, kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_simulated_peak_matches_real_cpu_step(name, topology, batch, patch, kwargs):
    predicted = simulate_training_step(StepConfig(topology, batch, patch, **kwargs))
    measured = measure_training_step(StepConfig(topology, batch, patch, **kwargs))
    # The acceptance bound is 5%; on torch 2.13 the two agree to the byte, so hold them to 1%.
    assert abs(predicted.peak_bytes - measured) / measured < 0.01, (predicted.peak_bytes, measured)


# The residual encoder U-Net (ResEnc: stem, 1-3-4-6-6 residual blocks, one conv per decoder stage), as planned.
RESENC_CONFIGS = [
    ("resenc-3d-aniso-4st-b2-fp32", resenc(ANISO3D), 2, (8, 16, 16), {}),
    ("resenc-3d-aniso-4st-b2-bf16", resenc(ANISO3D), 2, (8, 16, 16), {"precision": "bf16"}),
    ("resenc-3d-5st-b1-bf16-ckpt-4ch", resenc(FIVE3D), 1, (8, 32, 32), {"precision": "bf16", "checkpointing": True}),
    ("resenc-2d-5st-b3-fp32", resenc(FIVE2D), 3, (32, 32), {}),
    ("resenc-2d-6st-aniso-b2-fp16", resenc(SIX2D), 2, (64, 16), {"precision": "fp16"}),
    (
        "resenc-3d-iso-4st-b2-regions-ignore-accumulation",
        resenc(ISO3D),
        2,
        (16, 16, 16),
        {"labels": REGIONS_IGNORE, "accumulation_steps": 2},
    ),
]


@pytest.mark.parametrize("name, topology, batch, patch, kwargs", RESENC_CONFIGS, ids=[c[0] for c in RESENC_CONFIGS])
def test_residual_encoder_simulated_peak_is_the_measured_one_to_the_byte(name, topology, batch, patch, kwargs):
    """The planner sizes a ResEnc plan by simulating its real step: the simulation equals the same step run on CPU
    tensors to the byte (2D and 3D, fp32, bf16 and fp16 autocast, checkpointing, regions, accumulation)."""
    predicted = simulate_training_step(StepConfig(topology, batch, patch, **kwargs))
    measured = measure_training_step(StepConfig(topology, batch, patch, **kwargs))
    assert predicted.peak_bytes == measured
    assert predicted.parameter_bytes == 4 * sum(p.numel() for p in build_network(topology).parameters())


def test_residual_encoder_fitted_model_is_the_direct_simulation():
    """The planner queries the timeline model fitted from simulations at two patch sizes: for a ResEnc U-Net it
    gives the direct simulation of a third patch to the byte, breakdown and stages included."""
    t = resenc(topo(2, (4, 8, 16), [(1, 1), (2, 2), (2, 2)]))
    model = TrainingMemoryModel(t)
    direct = simulate_training_step(StepConfig(t, 2, (40, 56)))
    assert model.predict(2, (40, 56)) == direct
    assert model.simulations == 3


def test_breakdown_sums_to_total_and_counts_parameters():
    m = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    parts = m.breakdown()
    assert sum(v for k, v in parts.items() if k != "total") == parts["total"] == m.peak_bytes
    assert m.parameter_bytes == 4 * sum(p.numel() for p in build_network(ISO3D).parameters())
    assert m.optimizer_state_bytes == m.parameter_bytes  # SGD momentum: one fp32 buffer per parameter
    assert m.batch_bytes == 2 * 16**3 * (1 * 4 + 1)  # float32 input + int8 target
    assert m.peak_phase == "backward"
    assert 0 < m.gradient_bytes <= m.parameter_bytes


def test_stage_bytes_are_what_backward_keeps():
    feature_map = 2 * 4 * 16**3 * 4  # B x F0 x V x fp32
    plain = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16))).stage_activation_bytes
    # conv output + normalized output (LeakyReLU in place) per block, 2 blocks, plus per-channel statistics
    assert 4 * feature_map <= plain["encoder.0"] < 4.01 * feature_map
    assert plain["seg_heads.0"] == 2 * 3 * 16**3 * 4  # the full-resolution logits
    assert set(plain) >= {"encoder.3", "decoder.0", "decoder.2", "seg_heads.2"}
    checkpointed = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16), checkpointing=True)).stage_activation_bytes
    assert checkpointed["encoder.0"] == feature_map  # only the stage's output is kept


def test_checkpointing_and_bf16_lower_the_activation_peak():
    t = topo(3, (8, 16, 32, 64), [(1, 1, 1)] + [(2, 2, 2)] * 3)  # tensors only: no CPU convolution scratch
    fp32 = simulate_training_step(StepConfig(t, 2, (32, 32, 32), device="cuda"))
    checkpointed = simulate_training_step(StepConfig(t, 2, (32, 32, 32), checkpointing=True, device="cuda"))
    bf16 = simulate_training_step(StepConfig(t, 2, (32, 32, 32), precision="bf16", device="cuda"))
    assert checkpointed.activation_bytes < 0.85 * fp32.activation_bytes
    assert bf16.activation_bytes < 0.7 * fp32.activation_bytes
    assert checkpointed.parameter_bytes == bf16.parameter_bytes == fp32.parameter_bytes  # fp32 master weights
    assert bf16.largest_conv_output_bytes * 2 == fp32.largest_conv_output_bytes == 2 * 8 * 32**3 * 4


def test_linear_model_matches_direct_simulation_batch_one():
    two_stages = topo(2, (4, 8), [(1, 1), (2, 2)])
    model = TrainingMemoryModel(two_stages)
    direct = simulate_training_step(StepConfig(two_stages, 1, (40, 72)))
    assert model.predict(1, (40, 72)) == direct  # every field, breakdown and stages included
    assert model.peak_bytes(1, (40, 72)) == direct.peak_bytes
    assert model.simulations == 2 and model.fallback == {True: False}


@pytest.mark.slow
@pytest.mark.parametrize("topology, kwargs", [(ANISO3D, {}), (SIX2D, {"precision": "bf16", "checkpointing": True})])
def test_linear_model_matches_direct_simulation(topology, kwargs):
    model = TrainingMemoryModel(topology, **kwargs)
    div = topology.patch_divisor()
    for batch, scale in [(2, (5, 3, 2)), (4, (2, 2, 7)), (3, (6, 6, 6)), (1, (3, 4, 5))]:
        patch = tuple(d * s for d, s in zip(div, scale))
        direct = simulate_training_step(StepConfig(topology, batch, patch, **kwargs))
        predicted = model.predict(batch, patch)
        assert abs(predicted.peak_bytes - direct.peak_bytes) <= 1e-3 * direct.peak_bytes
        assert predicted.breakdown() == direct.breakdown()
        assert predicted.stage_activation_bytes == direct.stage_activation_bytes
        assert model.peak_bytes(batch, patch) == direct.peak_bytes
    assert model.simulations == 5  # 2 for batch 1, 3 for batch >= 2; the queries cost none
    expected = predict_device_peak(simulate_training_step(StepConfig(topology, 2, patch, **kwargs, device="cuda")))[
        "total"
    ]
    if not kwargs:  # predicted_training_bytes: a CUDA device by default
        assert predicted_training_bytes(topology, 2, patch) == expected


def test_device_terms():
    m = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    cuda = predict_device_peak(m, "cuda")
    assert cuda["tensors"] == m.peak_bytes
    assert cuda["allocator_rounding"] == m.live_allocations_at_peak * 256 > 0
    assert cuda["fragmentation"] == int(0.15 * (m.peak_bytes + cuda["allocator_rounding"]))
    assert cuda["conv_workspace"] == m.largest_conv_output_bytes == 2 * 4 * 16**3 * 4
    assert cuda["cuda_context"] == CUDA_CONTEXT_BYTES
    assert cuda["total"] == sum(v for k, v in cuda.items() if k != "total")
    assert m.heap_retained_bytes > 0  # a CPU step: glibc's heap keeps some of its freed tensors
    assert predict_device_peak(m, "cpu") == {
        "tensors": m.peak_bytes,
        "fragmentation": m.heap_retained_bytes,
        "runtime": CPU_RUNTIME_BYTES,
        "total": m.peak_bytes + m.heap_retained_bytes + CPU_RUNTIME_BYTES,
    }
    with pytest.raises(ValueError, match="device 'tpu' is not modelled"):
        predict_device_peak(m, "tpu")


@pytest.mark.parametrize(
    "args, message",
    [
        ((ISO3D, 2, (16, 16, 16), {"precision": "int8"}), "precision 'int8' is not known"),
        ((ISO3D, 2, (16, 16, 12), {}), r"multiple of \(8, 8, 8\)"),
        ((ISO3D, 2, (16, 16), {}), "expected 3 sizes"),
        ((ISO3D, 1, (8, 8, 8), {}), "one voxel at the lowest resolution"),
        ((ISO3D, 0, (16, 16, 16), {}), "must be >= 1"),
        ((ISO3D, 2, (16, 16, 16), {"optimizer": "lion"}), "optimizer 'lion' is not known"),
        ((ISO3D, 2, (16, 16, 16), {"labels": LabelScheme.plain(2)}), "the labels have 2 network outputs"),
    ],
)
def test_bad_arguments_say_what_to_change(args, message):
    topology, batch, patch, kwargs = args
    with pytest.raises(ValueError, match=message):
        simulate_training_step(StepConfig(topology, batch, patch, **kwargs))


def test_measurement_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    measure_training_step(StepConfig(FOUR2D_NO_DS, 1, (32, 32)))
    assert torch.equal(state, torch.get_rng_state())


def test_flops_match_the_convolutions():
    t = topo(2, (4, 8), [(1, 1), (2, 2)], in_channels=2, num_outputs=3)
    b, v = 2, 16 * 16

    def conv(c_in, c_out, k, voxels_out):
        return 2 * b * c_in * c_out * k * voxels_out

    first = conv(2, 4, 9, v)
    forward = (
        first
        + conv(4, 4, 9, v)  # encoder 0
        + conv(4, 8, 9, v // 4)
        + conv(8, 8, 9, v // 4)  # encoder 1 (stride 2)
        + conv(8, 4, 4, v // 4)  # transposed conv, kernel = stride = 2x2, counted over its input
        + conv(8, 4, 9, v)
        + conv(4, 4, 9, v)  # decoder 0
        + conv(4, 3, 1, v)
    )  # segmentation head
    # backward: a weight gradient for every convolution, an input gradient for all but the first
    assert training_step_flops(t, b, (16, 16)) == 3 * forward - first


@pytest.mark.parametrize(
    "topology, patch, tile_batch, shape, mirror, depth",
    [
        (ISO3D, (16, 16, 16), 2, (20, 24, 18), (0,), 16),  # z rows at 0 and 4: a batch stays in one row
        (FIVE2D, (32, 32), 3, (2, 40, 36), (0, 1), 2),  # 16 (tile, variant) pairs a slice: a batch spans 2 slices
        (ISO3D, (16, 16, 16), 4, (16, 16, 16), (), 16),  # one tile: the batch shrinks to it
        (resenc(ISO3D), (16, 16, 16), 2, (20, 24, 18), (0,), 16),  # the residual encoder U-Net
        (resenc(FIVE2D), (32, 32), 3, (2, 40, 36), (0, 1), 2),
    ],
)
def test_inference_memory_matches_real_sliding_window(topology, patch, tile_batch, shape, mirror, depth):
    setting = InferenceSetting(topology, patch, shape, topology.num_outputs, precision="fp32", mirror_axes=mirror)
    predicted = inference_memory(setting, tile_batch)
    data = np.random.default_rng(0).standard_normal((topology.in_channels, *shape)).astype(np.float32)
    measured = measure_inference_bytes(topology, data, setting.window(tile_batch))
    assert abs(predicted.peak_bytes - measured) / measured < 0.01, (predicted.breakdown(), measured)
    padded = [max(s, p) for s, p in zip(shape, (1, *patch)[-3:])]
    # the accumulator: the z-slices one tile batch writes
    assert predicted.accumulator_bytes == topology.num_outputs * depth * padded[1] * padded[2] * 4


def test_inference_memory_checks_num_classes():
    with pytest.raises(ValueError, match="num_outputs 5 differs from the network's 3"):
        inference_memory(InferenceSetting(ISO3D, (16, 16, 16), (16, 16, 16), 5), 1)


def test_export_streams_classes():
    small = export_bytes((40, 50, 60), (30, 40, 50), LabelScheme.plain(2))
    large = export_bytes((40, 50, 60), (30, 40, 50), LabelScheme.plain(12))
    # only the network's probabilities (and the 3 slices kept across a slab border) grow with the classes; the
    # original-shape buffers do not
    assert large["total"] - small["total"] == 10 * 30 * 40 * 50 * 4 + 10 * 3 * 40 * 50 * 4
    assert large["best_score"] == small["best_score"] == 40 * 50 * 60 * 4
    # the label map's dtype is the scheme's export dtype: uint8 up to 256 label values, int16 beyond; it is
    # written into the uncropped volume, no copy
    assert export_bytes((4, 5, 6), (4, 5, 6), LabelScheme.plain(200))["labels"] == 120 * 1
    assert export_bytes((4, 5, 6), (4, 5, 6), LabelScheme.plain(300))["labels"] == 120 * 2


def test_preprocess_worker_bytes_phases():
    same = preprocess_worker_bytes((20, 30, 40), (20, 30, 40), 2)
    upsampled = preprocess_worker_bytes((20, 30, 40), (40, 60, 80), 2)
    assert same["total"] == same["runtime"] + max(v for k, v in same.items() if k not in ("runtime", "total"))
    assert same["load"] == 2 * 2 * 24000 * 4 + 24000 * 4
    assert upsampled["resample_image"] > same["resample_image"] + 2 * 8 * 24000 * 4  # the larger output
    with pytest.raises(ValueError, match="positive sizes"):
        preprocess_worker_bytes((0, 3, 4), (1, 3, 4), 1)


@pytest.mark.slow
def test_simulation_of_a_realistic_network_is_fast_and_large():
    """A 6-stage 3D U-Net at 128^3, batch 2 (nnU-Net's shape): simulated in seconds, ~9 GiB of tensors."""
    import time

    t = topo(3, (32, 64, 128, 256, 320, 320), [(1, 1, 1)] + [(2, 2, 2)] * 5, num_outputs=3)
    start = time.perf_counter()
    m = simulate_training_step(StepConfig(t, 2, (128, 128, 128)))
    assert time.perf_counter() - start < 30
    assert 8000 * MiB < m.peak_bytes < 10000 * MiB


def test_a_change_to_the_trainers_step_shows_up_in_simulation_and_measurement(monkeypatch: pytest.MonkeyPatch):
    """The memory model runs autoseg.model.step.TrainStep itself, not a copy: a step that keeps a copy of the
    full-resolution logits until it ends (B x C x 16^3 float32 = 98,304 bytes) predicts exactly that much more,
    and the simulation still equals the measurement of the changed step."""
    import autoseg.model.step as step_module

    before = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    kept: list[torch.Tensor] = []
    compute_loss = step_module.compute_loss

    def loss_keeping_the_logits(output, target, loss_fn):
        kept.append(output[0].detach().clone())  # alive until the test clears it: through backward
        return compute_loss(output, target, loss_fn)

    monkeypatch.setattr(step_module, "compute_loss", loss_keeping_the_logits)
    after = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    kept.clear()
    measured = measure_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    kept.clear()
    assert after.peak_bytes - before.peak_bytes == 2 * 3 * 16**3 * 4
    assert after.peak_bytes == measured


def test_the_plans_optimizer_is_the_one_simulated() -> None:
    """SGD momentum: one buffer per parameter; AdamW: two moments and a step counter per parameter tensor."""
    sgd = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16)))
    adam = simulate_training_step(StepConfig(ISO3D, 2, (16, 16, 16), optimizer="adam"))
    tensors = len(list(build_network(ISO3D).parameters()))
    assert sgd.optimizer_state_bytes == sgd.parameter_bytes
    assert adam.optimizer_state_bytes == 2 * adam.parameter_bytes + 4 * tensors


@pytest.mark.parametrize(("regions", "dtype"), [(False, torch.float32), (True, torch.float32), (False, torch.float16)])
@pytest.mark.parametrize(
    "shape_original, shape_resampled, outputs",
    [
        ((60, 120, 100), (30, 100, 90), 3),  # resampled up in every axis
        ((40, 80, 80), (40, 160, 160), 5),  # down in-plane
        ((50, 64, 64), (50, 64, 64), 2),  # unchanged
    ],
)
def test_export_bytes_bounds_the_measured_export(shape_original, shape_resampled, outputs, regions, dtype):
    """export_bytes against tracemalloc's peak of the real export_segmentation (the probabilities, held by the
    caller, left out): an upper bound, and within 25%."""
    import tracemalloc

    from autoseg.dataset.imageio import Geometry
    from autoseg.predict.export import export_segmentation
    from autoseg.preprocess.store import CaseProperties

    spacing = (2.0, 1.0, 1.0)
    target = tuple(s * o / r for s, o, r in zip(spacing, shape_original, shape_resampled))
    geometry = Geometry(
        ndim=3,
        size_xyz=tuple(reversed(shape_original)),
        spacing_xyz=tuple(reversed(spacing)),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )
    props = CaseProperties(
        case_id="x",
        geometry=geometry,
        spacing_mm=spacing,
        target_spacing_mm=target,
        shape_before_crop=shape_original,
        crop_bbox=tuple((0, s) for s in shape_original),
        shape_after_crop=shape_original,
        shape_after_resample=shape_resampled,
    )
    labels = (
        {"background": 0, **{f"r{k}": list(range(k + 1, outputs + 1)) for k in range(outputs)}}
        if regions
        else {"background": 0, **{f"c{k}": k for k in range(1, outputs)}}
    )
    scheme = LabelScheme.from_labels(labels, tuple(range(1, outputs + 1)) if regions else ())
    probabilities = torch.rand((scheme.num_outputs, *shape_resampled), generator=torch.Generator().manual_seed(0)).to(
        dtype
    )
    tracemalloc.start()
    export_segmentation(probabilities, props, scheme)
    measured = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    terms = export_bytes(shape_original, shape_resampled, scheme, probabilities.element_size())
    estimate = terms["total"] - terms["probabilities"]
    assert 0.75 * estimate <= measured <= estimate, (measured, estimate)
