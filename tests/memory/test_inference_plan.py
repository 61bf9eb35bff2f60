"""plan_inference: the tile batch and the accumulator's device chosen up front from the memory model, held
against the real sliding window measured on CPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from autoseg.core.resources import peak_rss_bytes
from autoseg.core.units import GiB, MiB
from autoseg.memory.device import CPU_RUNTIME_BYTES, predict_device_peak
from autoseg.memory.inference import InferenceSetting, TileSimulation, inference_memory
from autoseg.memory.inference_plan import CPU_MAX_TILE_BATCH, cpu_tile_batch_cap, plan_inference
from autoseg.memory.inference_simulation import measure_inference_bytes
from autoseg.model.agreement import Agreement, agreement_bytes
from autoseg.model.tile_runner import TileBatchBytes
from autoseg.model.tiles import overlap_step_fractions
from autoseg.model.topology import NetworkTopology

TOPO3D = NetworkTopology(
    dim=3,
    in_channels=2,
    num_outputs=3,
    features_per_stage=(4, 8, 16),
    kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)),
    strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)),
)
TOPO2D = NetworkTopology(
    dim=2,
    in_channels=1,
    num_outputs=4,
    features_per_stage=(4, 8),
    kernel_sizes=((3, 3), (3, 3)),
    strides=((1, 1), (2, 2)),
)


@pytest.mark.parametrize(
    ("topology", "patch", "shape", "axes", "tta", "max_batch", "output", "accumulator"),
    [
        (TOPO3D, (8, 16, 16), (10, 20, 30), (0, 1, 2), None, None, "float32", "float32"),  # batch 4: half of 8 variants
        (TOPO3D, (8, 16, 16), (10, 20, 30), (0, 1, 2), None, None, "float32", "float16"),
        (TOPO3D, (8, 16, 16), (10, 20, 30), (1, 2), 3, 5, "float16", "float16"),  # 5 pairs of 3 variants: tiles split
        (TOPO3D, (8, 16, 16), (40, 20, 30), (), None, 2, "float16", "float32"),  # long in z: the accumulator's window
        (
            TOPO3D,
            (8, 16, 16),
            (40, 20, 30),
            (),
            None,
            2,
            None,
            "float16",
        ),  # slabs to a sink, finished 1 slice at a time
        (TOPO2D, (16, 16), (3, 20, 24), (0, 1), 1, 6, "float32", "float16"),  # no TTA, 2D: slices share a pass
    ],
)
def test_planned_peak_matches_the_real_sliding_window(
    topology, patch, shape, axes, tta, max_batch, output, accumulator
):
    setting = InferenceSetting(
        topology,
        patch,
        shape,
        topology.num_outputs,
        "cpu",
        mirror_axes=axes,
        tta=tta,
        output_dtype=output,
        accumulator_dtype=accumulator,
    )
    plan = plan_inference(setting, 4 * GiB, max_tile_batch=max_batch)
    assert plan.fits and plan.accumulator_device == "cpu" and plan.accumulator_dtype == accumulator
    assert plan.tile_batch_size == (max_batch or CPU_MAX_TILE_BATCH)
    data = np.random.default_rng(0).standard_normal((topology.in_channels, *shape)).astype(np.float32)
    measured = measure_inference_bytes(topology, data, setting.window(plan.tile_batch_size))
    predicted = plan.peak_bytes - CPU_RUNTIME_BYTES - plan.heap_retained_bytes  # the tensors
    assert abs(predicted - measured) / measured < 0.01, (plan, measured)


_TILE_IN_A_FRESH_PROCESS = """
import sys
import numpy as np
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss, use_one_malloc_arena
if not use_one_malloc_arena():  # as predict does, before anything allocates
    sys.exit(print(-1))  # not glibc: its heap is not what the model replays
import torch
from autoseg.model.network import build_network
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.topology import NetworkTopology
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow
topology, tile = eval(sys.argv[1]), eval(sys.argv[2])
network = build_network(topology).eval()
data = np.random.default_rng(0).standard_normal((topology.in_channels, *tile)).astype(np.float32)
window = SlidingWindow(tile, topology.num_outputs, accumulator_dtype="float16", output_dtype="float16")
reset_peak_rss()
start = process_rss_bytes()
for _ in range(2):  # as predict, tile after tile: the peak of the process, not of one call
    sliding_window_predict([TorchTileRunner(network, torch.device("cpu"))], data, window, on_slab=lambda *slab: None)
print(peak_rss_bytes() - start)
"""


@pytest.mark.slow  # ~25 s: three fresh processes, each predicting a 96x192x192 tile twice
def test_a_cpu_tile_s_peak_rss_counts_what_glibcs_heap_keeps() -> None:
    """A fresh process (glibc's thresholds at their defaults, one arena, as ``autoseg predict``) predicting one
    image of one tile with the real sliding window: its peak RSS above its start is the predicted tensors plus
    glibc's heap (``heap_retained_bytes``, a replay of the tile's allocations) within 15%, the median of three runs
    (the figures: docs/memory.md). Without the heap term it falls short of that; with training's held fragments
    (one in 5 instead of 20) it overshoots."""
    if peak_rss_bytes() is None:
        pytest.skip("no peak RSS on this system")
    topology = NetworkTopology(
        dim=3,
        in_channels=2,
        num_outputs=3,
        features_per_stage=(16, 32, 64, 128),
        kernel_sizes=((3, 3, 3),) * 4,
        strides=((1, 1, 1),) + ((2, 2, 2),) * 3,
    )
    tile = (96, 192, 192)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "2"}
    runs = sorted(
        int(
            subprocess.run(
                [sys.executable, "-c", _TILE_IN_A_FRESH_PROCESS, repr(topology), repr(tile)],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
                check=True,
            ).stdout.split()[-1]
        )
        for _ in range(3)
    )
    if runs[0] < 0:
        pytest.skip("not glibc's malloc")
    memory = inference_memory(
        InferenceSetting(
            topology, tile, tile, topology.num_outputs, "cpu", output_dtype=None, accumulator_dtype="float16"
        ),
        1,
    )
    tensors = memory.peak_bytes - memory.parameter_bytes  # the parameters were alive at the start
    predicted = tensors + memory.heap_retained_bytes
    assert abs(predicted / runs[1] - 1) <= 0.15, ([r / MiB for r in runs], predicted / MiB, tensors / MiB)
    assert tensors < 0.85 * runs[1]  # without the heap term the prediction would be off


def test_largest_batch_within_the_budget():
    setting = InferenceSetting(TOPO3D, (8, 16, 16), (10, 20, 30), 3, precision="fp32", mirror_axes=(0, 1, 2))
    peaks = {b: predict_device_peak(inference_memory(setting, b), "cpu")["total"] for b in (3, 4)}
    assert peaks[4] > peaks[3]
    plan = plan_inference(setting, peaks[3], max_tile_batch=16)
    assert plan.tile_batch_size == 3 and plan.peak_bytes == peaks[3] and plan.fits
    assert plan.choices[0] == (3, "cpu", peaks[3])
    assert all(total > peaks[3] for batch, _, total in plan.choices if batch > 3)
    # the cap: never more pairs than the image has (one tile, no TTA -> 1)
    one = plan_inference(
        InferenceSetting(TOPO3D, (8, 16, 16), (8, 16, 16), 3, "cpu", accumulator_dtype="float16"),
        4 * GiB,
        max_tile_batch=16,
    )
    assert one.tile_batch_size == 1


def test_accumulator_moves_to_the_host_when_it_does_not_fit_beside_a_tile():
    shape, patch = (40, 96, 96), (8, 16, 16)
    on_cuda = InferenceSetting(TOPO3D, patch, shape, 3, "cuda", mirror_axes=(0, 1, 2))
    on_device = inference_memory(on_cuda, 1)
    on_host = inference_memory(on_cuda, 1, accumulator_on_device=False)
    window = 8 * 96 * 96 * 4  # one batch's z-slices (a patch deep), not the 40 of the image
    held = 3 * window + window + math.prod(patch) * 4  # accumulator, weight map, Gaussian
    output = 3 * math.prod(shape) * 4  # the image's probabilities: on the host
    finishing = window  # the last z-slices' softmax temporary (a window deep), beyond a tile batch here
    assert on_device.softmax_temp_bytes == finishing > on_device.tile_bytes
    assert on_device.peak_bytes - on_host.peak_bytes == held + finishing - on_device.tile_bytes
    assert on_device.host_accumulator_bytes == output
    # + the logits, one tile's flipped back and its share g / W
    assert on_host.host_accumulator_bytes == output + held + (2 * 3 + 1) * math.prod(patch) * 4
    on_cpu = inference_memory(InferenceSetting(TOPO3D, patch, shape, 3, mirror_axes=(0, 1, 2)), 1)
    # on CUDA a copy of the image; on CPU the image itself is read (no padding), and the output is beside it
    assert on_device.padded_input_bytes == TOPO3D.in_channels * math.prod(shape) * 4 and on_cpu.padded_input_bytes == 0
    assert on_cpu.output_bytes == output and on_cpu.host_accumulator_bytes == 0
    # on CPU a tile also holds each convolution's hidden buffers (cpu_conv_scratch_bytes); the peak is a tile batch
    # or finishing, whichever holds more
    assert on_cpu.tile_bytes > on_device.tile_bytes
    largest = max(on_cpu.tile_bytes, on_cpu.softmax_temp_bytes)
    assert on_cpu.peak_bytes == on_cpu.parameter_bytes + on_cpu.output_bytes + held + largest
    streamed = inference_memory(InferenceSetting(TOPO3D, patch, shape, 3, mirror_axes=(0, 1, 2), output_dtype=None), 1)
    assert on_cpu.peak_bytes - streamed.peak_bytes == output and streamed.accumulator_depth == 8
    budget = predict_device_peak(on_device, "cuda")["total"] - 1  # the accumulator no longer fits beside a tile
    plan = plan_inference(on_cuda, budget)
    assert plan.accumulator_device == "cpu" and plan.fits and plan.tile_batch_size >= 1
    assert plan.peak_bytes <= budget and plan.host_accumulator_bytes > 0
    assert "accumulator float32 on cpu" in plan.describe()
    roomy = plan_inference(replace(on_cuda, accumulator_dtype="float16"), 8 * GiB)
    assert roomy.accumulator_device == "cuda" and roomy.tile_batch_size == 16  # 2 tiles x 8 variants


def test_nothing_fits_says_so():
    setting = InferenceSetting(
        TOPO3D, (8, 16, 16), (10, 20, 30), 3, "cuda", mirror_axes=(0, 1, 2), accumulator_dtype="float16"
    )
    plan = plan_inference(setting, 1000)
    assert not plan.fits and plan.tile_batch_size == 1 and plan.accumulator_device == "cpu"
    assert "does not fit" in plan.describe()


@pytest.mark.parametrize(
    ("topology", "patch", "tile", "shape", "axes", "tta"),
    [
        (TOPO3D, (8, 16, 16), (16, 32, 32), (20, 40, 50), (0, 1, 2), 2),  # 2 patches per axis: 8 tiles (the patch: 96)
        (TOPO3D, (8, 16, 16), (8, 32, 24), (10, 36, 30), (1, 2), None),  # grown in (y, x) only
        (TOPO2D, (16, 16), (32, 24), (3, 40, 30), (0, 1), 1),  # 2D
    ],
)
def test_planned_peak_matches_the_real_sliding_window_for_a_tile_larger_than_the_patch(
    topology, patch, tile, shape, axes, tta
):
    """The planned inference tile (``autoseg.plan.inference_tile``) at its half-patch overlap steps, as predict runs
    it: the memory model holds within 1% there too."""
    steps = overlap_step_fractions(tile, patch)
    setting = InferenceSetting(
        topology,
        tile,
        shape,
        topology.num_outputs,
        "cpu",
        mirror_axes=axes,
        tta=tta,
        step_fraction=steps,
        accumulator_dtype="float16",
    )
    plan = plan_inference(setting, 4 * GiB)
    data = np.random.default_rng(1).standard_normal((topology.in_channels, *shape)).astype(np.float32)
    measured = measure_inference_bytes(topology, data, setting.window(plan.tile_batch_size))
    predicted = plan.peak_bytes - CPU_RUNTIME_BYTES - plan.heap_retained_bytes  # the tensors
    assert abs(predicted - measured) / measured < 0.01, (plan, measured)
    patch_plan = plan_inference(replace(setting, tile=patch, step_fraction=0.5), 4 * GiB)
    assert plan.peak_bytes > patch_plan.peak_bytes  # the larger tile's activations are counted, not the patch's


def test_cpu_batches_a_large_tile_less():
    """On CPU a batch stops paying beyond 4 tiles of 16x40x40 (docs/memory.md): a tile of that size batches 4, a
    GPU-sized one 1 (batched 4, it would hold 4x the activations for no speed)."""
    assert cpu_tile_batch_cap((16, 40, 40)) == CPU_MAX_TILE_BATCH
    assert cpu_tile_batch_cap((16, 80, 40)) == 2
    assert cpu_tile_batch_cap((48, 192, 160)) == 1
    big = plan_inference(InferenceSetting(TOPO3D, (32, 64, 64), (40, 80, 80), 3, accumulator_dtype="float16"), 4 * GiB)
    assert big.tile_batch_size == 1


def test_tile_simulations_are_kept_between_runs(tmp_path, monkeypatch):
    """With a MachineCache the simulation's answer is written once and read back by a later run (here: with the
    in-process cache cleared and the simulation made to fail), and not reused once the simulated code changes."""
    from autoseg.core.machine import MachineCache
    from autoseg.memory import inference

    kept = inference.TileSimulation(TOPO3D, mirror_axes=(0, 1, 2), cache=MachineCache(tmp_path))
    first = inference.simulate_tile_prediction(kept, (8, 16, 16), 2)
    assert first == inference.simulate_tile_prediction(replace(kept, cache=None), (8, 16, 16), 2)
    assert (tmp_path / "inference_simulation.json").is_file()

    def no_simulation(*args):
        raise AssertionError("simulated again")

    monkeypatch.setattr(inference, "_simulate_cached", no_simulation)
    assert inference.simulate_tile_prediction(kept, (8, 16, 16), 2) == first
    monkeypatch.setattr(inference, "_SIMULATED_MODULES", inference._SIMULATED_MODULES[:-1])  # other code
    with pytest.raises(AssertionError, match="simulated again"):
        inference.simulate_tile_prediction(kept, (8, 16, 16), 2)


class _Reported:
    """A runner's working bytes as it reports them (another runtime's measured figures), and what it was asked."""

    def __init__(self, figures: TileBatchBytes) -> None:
        self.figures, self.asked = figures, []

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        self.asked.append((tile_batch_size, tile))
        return self.figures


def test_the_plan_asks_each_runner_for_its_working_bytes() -> None:
    """The memory model takes a tile batch's bytes from the runners: every fold's weights are held, one forward pass
    runs at a time; a runner that reports the simulation gives the simulated plan exactly."""
    setting = InferenceSetting(TOPO3D, (8, 16, 16), (10, 20, 30), 3, mirror_axes=(0, 1, 2))
    first, second = _Reported(TileBatchBytes(1000, 5000, 64, 10, 300)), _Reported(TileBatchBytes(2000, 7000, 32, 20, 0))
    memory = inference_memory(setting, 2, runners=[first, second])
    assert first.asked == second.asked == [(2, (8, 16, 16))]
    assert (memory.parameter_bytes, memory.tile_bytes, memory.heap_retained_bytes) == (3000, 7000, 300)
    assert (memory.largest_conv_output_bytes, memory.live_allocations_at_peak) == (64, 20)
    simulated = TileSimulation.of(setting)
    assert inference_memory(setting, 2, runners=[simulated]) == inference_memory(setting, 2)
    one, two = (plan_inference(setting, 4 * GiB, runners=[simulated] * n) for n in (1, 2))
    assert two.parameter_bytes == 2 * one.parameter_bytes and two.peak_bytes == one.peak_bytes + one.parameter_bytes


def test_each_fold_s_held_bytes_stay_beside_the_others_forward_pass() -> None:
    """A graph runtime keeps its arena after its call (``held_bytes``): during one fold's forward pass the other folds
    hold theirs, so an ensemble's tile peak is every fold's held bytes plus the largest pass beyond its own."""
    setting = InferenceSetting(TOPO3D, (8, 16, 16), (10, 20, 30), 3)
    first = _Reported(TileBatchBytes(1000, 5000, 0, 0, 0, held_bytes=4000))
    second = _Reported(TileBatchBytes(1000, 6000, 0, 0, 0, held_bytes=3000))
    memory = inference_memory(setting, 1, runners=[first, second])
    assert (memory.tile_bytes, memory.parameter_bytes) == (4000 + 3000 + 3000, 2000)
    alone = inference_memory(setting, 1, runners=[first])
    assert alone.tile_bytes == 5000


def test_the_members_agreement_is_counted_beside_a_tile_where_the_accumulator_lives():
    """``agreement_bytes`` (held against a measurement in tests/model/test_agreement.py) joins a tile batch's peak
    on the accumulator's device: on CUDA, or on the host when the accumulator moves there."""
    shape, patch = (40, 96, 96), (8, 16, 16)
    plain = InferenceSetting(TOPO3D, patch, shape, 3, "cuda", mirror_axes=(0, 1, 2))
    compared = replace(plain, agreement=Agreement("folds", 3))
    extra = agreement_bytes(Agreement("folds", 3), 2, patch, 3)
    assert extra > 0
    on_device, agreed = inference_memory(plain, 2), inference_memory(compared, 2)
    m = on_device
    held = m.parameter_bytes + m.padded_input_bytes + m.accumulator_bytes + m.weight_map_bytes + m.gaussian_bytes
    assert agreed.agreement_bytes == extra
    assert agreed.peak_bytes == max(held + m.tile_bytes + extra, held + m.softmax_temp_bytes) > m.peak_bytes
    on_host = inference_memory(compared, 2, accumulator_on_device=False)
    plain_host = inference_memory(plain, 2, accumulator_on_device=False)
    assert on_host.host_accumulator_bytes - plain_host.host_accumulator_bytes == extra
    assert on_host.peak_bytes == plain_host.peak_bytes and on_host.agreement_bytes == 0
