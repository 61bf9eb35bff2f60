from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autoseg.plan.throughput
from autoseg.core.units import GiB
from autoseg.model.topology import NetworkTopology
from autoseg.plan.throughput import (
    CALIBRATION_STEPS,
    GPUS,
    StepRates,
    StepTimes,
    TimedStep,
    conv_flops,
    cpu_rates_from_times,
    cuda_flops_per_second,
    gpu_spec,
    mapped_bytes,
    step_elements,
)


def test_gpu_names_match_the_table() -> None:
    assert gpu_spec("NVIDIA A100-SXM4-80GB", 80 * GiB) == (gpu_spec("A100", 0)[0], True)
    assert gpu_spec("NVIDIA A100-PCIE-40GB", 40 * GiB)[0].memory_gib == 40
    assert gpu_spec("Tesla T4", 15 * GiB)[0].tensor_tflops == 65.0
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * GiB)[0].fp32_tflops == 82.6
    assert gpu_spec("NVIDIA H100 80GB HBM3", 80 * GiB)[0].name == "NVIDIA H100"


def test_unknown_gpu_is_the_smallest_listed_one_with_that_memory() -> None:
    spec, matched = gpu_spec(None, 24 * GiB)
    assert not matched and spec.memory_gib == 24
    assert gpu_spec("Some Future GPU", 8 * 10**9)[0].name == "NVIDIA GeForce RTX 3070"  # "8 GB" is 7.45 GiB
    assert gpu_spec(None, 1024 * GiB)[0] == GPUS[-1]
    amp, fp32 = cuda_flops_per_second(spec, "fp16"), cuda_flops_per_second(spec, "fp32")
    assert amp == pytest.approx(spec.tensor_tflops * 1e12 * 0.15) and fp32 == pytest.approx(spec.fp32_tflops * 0.5e12)


class _FakeSteps:
    """Replaces ``training_step_closure`` for ``calibrate_cpu_throughput``: the timed runs of the i-th closure made
    (the i-th calibration step) with n torch threads take ``seconds[i][n]`` in turn (the warm-up 0 s) on a fake
    ``time.perf_counter`` and ``process_time`` (an idle machine: one thread's CPU seconds are its wall seconds).
    Records the closures' arguments and the step calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: list[dict[int, list[float]]]) -> None:
        self.seconds = [{n: [0.0, *s] for n, s in by_threads.items()} for by_threads in seconds]
        self.now, self.step_calls = 1000.0, 0
        self.closure_args: list[tuple[tuple, dict]] = []
        monkeypatch.setattr(autoseg.plan.throughput, "training_step_closure", self.closure)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(time, "process_time", lambda: self.now)

    def closure(self, *args, **kwargs):
        seconds = self.seconds[len(self.closure_args)]
        self.closure_args.append((args, kwargs))

        def step() -> None:
            self.step_calls += 1
            self.now += seconds[torch.get_num_threads()].pop(0)

        return step


@pytest.mark.parametrize("index", range(len(CALIBRATION_STEPS)))
def test_calibration_flops_are_those_its_timed_steps_run(index: int) -> None:
    """The FLOPs the calibration divides by are the convolutions its timed training step executes (counted by
    torch), within 2% (the first convolution computes no input gradient)."""
    topology, patch, batch = CALIBRATION_STEPS[index]
    step = autoseg.plan.throughput.training_step_closure(topology, patch, batch)
    with FlopCounterMode(display=False) as counter:
        step()
    assert counter.get_total_flops() == pytest.approx(conv_flops(topology, patch, batch), rel=0.02)


def _times(threads: int, wall: float, cpu: float) -> StepTimes:
    return StepTimes(threads=threads, wall_seconds=wall, cpu_seconds=cpu)


def _timed(index: int, one: StepTimes, every: StepTimes | None) -> TimedStep:
    topology, patch, batch = CALIBRATION_STEPS[index]
    return TimedStep(conv_flops(topology, patch, batch), step_elements(topology, patch, batch), one, every)


def _seconds(index: int, rates: StepRates) -> float:
    topology, patch, batch = CALIBRATION_STEPS[index]
    return rates.seconds(conv_flops(topology, patch, batch), step_elements(topology, patch, batch))


def test_two_calibration_steps_give_both_rates() -> None:
    """Steps timed as a machine of 300 GFLOP/s and 200 M elements/s would run them (idle cores): both rates come
    back, and they predict each step's seconds."""
    machine = StepRates(300e9, 200e6)
    steps = [
        _timed(
            i,
            _times(1, 1.8 * _seconds(i, machine), 1.8 * _seconds(i, machine)),
            _times(2, _seconds(i, machine), 1.9 * _seconds(i, machine)),
        )
        for i in (0, 1)
    ]
    measured = cpu_rates_from_times(steps, (2.8e9, True))
    assert (
        measured.value == {"flops_per_second": 300e9, "elements_per_second": 200e6, "mapped_bytes_per_second": 2.8e9}
        and measured.keep
    )
    assert measured.details["2d_all_threads_wall_seconds"] == pytest.approx(_seconds(1, machine))


def test_a_2d_plan_is_not_predicted_at_the_3d_step_s_flop_rate() -> None:
    """The reason for two rates: the 2D step does fewer FLOPs per element, so on such a machine the FLOPs alone at
    the 3D step's rate predict it 20%+ too fast, and the two rates predict it exactly."""
    machine = StepRates(300e9, 200e6)
    topology, patch, batch = CALIBRATION_STEPS[0]
    flops_only = StepRates(conv_flops(topology, patch, batch) / _seconds(0, machine))
    topology, patch, batch = CALIBRATION_STEPS[1]
    assert flops_only.seconds(conv_flops(topology, patch, batch), 0.0) < 0.8 * _seconds(1, machine)


def test_an_unsteady_mapping_rate_drops_its_term() -> None:
    """A fresh block filled no slower than a kept one (noise): no mapping rate, rather than an absurd one."""
    steps = [
        _timed(i, _times(1, _seconds(i, StepRates(300e9, 200e6)), _seconds(i, StepRates(300e9, 200e6))), None)
        for i in (0, 1)
    ]
    assert cpu_rates_from_times(steps, (6.7e13, False)).value["mapped_bytes_per_second"] is None


def test_timings_that_leave_no_positive_element_rate_fall_back_to_the_flops_alone() -> None:
    """The 2D step as fast per FLOP as the 3D one, or faster (noise): no element rate; the 3D step's FLOP rate."""
    topology, patch, batch = CALIBRATION_STEPS[0]
    flops_3d = conv_flops(topology, patch, batch)
    topology, patch, batch = CALIBRATION_STEPS[1]
    seconds_2d = 0.9 * conv_flops(topology, patch, batch) / 1e11
    measured = cpu_rates_from_times(
        [
            _timed(0, _times(1, flops_3d / 1e11, flops_3d / 1e11), None),
            _timed(1, _times(1, seconds_2d, seconds_2d), None),
        ]
    )
    assert (
        measured.value == {"flops_per_second": 1e11, "elements_per_second": None, "mapped_bytes_per_second": None}
        and measured.keep
    )  # no mapping rate given


@pytest.mark.parametrize(
    "one, every, why",
    [
        (_times(1, 1.5, 0.5), _times(2, 1.2, 0.7), "one thread got 33% of a CPU"),
        (_times(1, 0.5, 0.5), _times(2, 0.6, 0.7), "2 threads ran no faster than one (0.600 vs 0.500 s)"),
    ],
    ids=["core_shared", "threads_no_faster"],
)
def test_busy_cores_give_one_thread_s_cpu_seconds_not_cached(one: StepTimes, every: StepTimes, why: str) -> None:
    """Another process on the cores while the 2D step ran: its seconds fall back to one thread's CPU seconds (which
    the load does not change) and the rates are not cached, so that an idle run measures the faster figures later."""
    idle = _timed(0, _times(1, 0.5, 0.5), _times(2, 0.3, 0.6))
    busy = _timed(1, one, every)
    assert busy.seconds() == 0.5
    measured = cpu_rates_from_times([idle, busy])
    assert not measured.keep
    assert why in measured.why_not_kept and "--cpu-flops" in measured.why_not_kept


def test_small_noise_gives_the_same_figures() -> None:
    """Rounded to 2 significant digits: timings 0.4% apart (measured idle and beside 2 busy processes) agree."""
    machine = StepRates(300e9, 200e6)
    figures = set()
    for noise in (1.0, 1.004):
        steps = [_timed(i, _times(1, noise * _seconds(i, machine), noise * _seconds(i, machine)), None) for i in (0, 1)]
        figures.add(tuple(cpu_rates_from_times(steps).value.values()))
    assert len(figures) == 1


def test_calibration_times_each_step_with_one_thread_and_every_cpu_best_of_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each calibration step runs once to warm up and ``repeats`` times timed, with 1 thread and with every CPU;
    the best run counts (a slow run does not lower the figures); the caller's threads are restored."""
    machine = StepRates(300e9, 200e6)
    best = [_seconds(i, machine) for i in (0, 1)]
    fake = _FakeSteps(monkeypatch, [{4: [3 * b, b, 2 * b], 1: [9 * b, 5 * b, 4 * b]} for b in best])
    monkeypatch.setattr(autoseg.plan.throughput, "mapping_rate", lambda: (2.83e9, True))
    before = torch.get_num_threads()
    measured = autoseg.plan.throughput.calibrate_cpu_throughput(repeats=3, max_threads=4)
    assert torch.get_num_threads() == before
    assert [args for args, _ in fake.closure_args] == [tuple(step) for step in CALIBRATION_STEPS]
    assert fake.step_calls == 16  # per step and thread count: one warm-up, then 3 timed
    assert (
        measured.value == {"flops_per_second": 300e9, "elements_per_second": 200e6, "mapped_bytes_per_second": 2.8e9}
        and measured.keep
    )
    assert measured.details["3d_one_thread_wall_seconds"] == pytest.approx(4 * best[0])


def _topologies() -> dict[str, tuple[NetworkTopology, tuple[int, ...], int]]:
    return {
        "3d": (
            NetworkTopology(
                dim=3,
                in_channels=1,
                num_outputs=3,
                features_per_stage=(4, 8),
                kernel_sizes=((3, 3, 3), (3, 3, 3)),
                strides=((1, 1, 1), (2, 2, 2)),
            ),
            (8, 16, 16),
            2,
        ),
        "3d_anisotropic": (
            NetworkTopology(
                dim=3,
                in_channels=2,
                num_outputs=4,
                features_per_stage=(4, 8, 16),
                kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)),
                strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)),
            ),
            (8, 16, 16),
            1,
        ),
        "2d": (
            NetworkTopology(
                dim=2,
                in_channels=1,
                num_outputs=2,
                features_per_stage=(4, 8, 16),
                kernel_sizes=((3, 3), (3, 3), (3, 3)),
                strides=((1, 1), (2, 2), (2, 2)),
            ),
            (32, 32),
            2,
        ),
    }


@pytest.mark.parametrize("name", list(_topologies()))
def test_conv_flops_counts_the_convolutions_torch_runs(name: str) -> None:
    """Forward: exactly torch's count of the convolution FLOPs (deep-supervision heads included); the whole
    step (x3 for backward) within 2% of it."""
    topology, patch_size, batch_size = _topologies()[name]
    step = autoseg.plan.throughput.training_step_closure(topology, patch_size, batch_size)
    with FlopCounterMode(display=False) as counter:
        step()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    predicted = conv_flops(topology, patch_size, batch_size)
    assert counts["aten.convolution"] == pytest.approx(predicted / 3, rel=1e-9)
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize("name", list(_topologies()))
def test_feature_map_elements_are_the_outputs_of_the_convolutions_torch_runs(name: str) -> None:
    """The elements of ``StepRates``' second term: the outputs of every convolution of the forward pass (transposed
    ones included), the 1x1 segmentation heads not counted."""
    from autoseg.model.network import build_network

    topology, patch_size, batch_size = _topologies()[name]
    network = build_network(topology)
    outputs = []
    for module in network.modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd) and set(module.kernel_size) != {1}:
            module.register_forward_hook(lambda _m, _i, out: outputs.append(out.numel()))
    network(torch.zeros(batch_size, topology.in_channels, *patch_size))
    assert step_elements(topology, patch_size, batch_size) == sum(outputs)


@pytest.mark.parametrize(
    "dim, threshold_of_stage_0",
    [(3, 0.75), (3, 1.5), (2, 0.75), (2, 1.5), (3, 2.5)],
    ids=["3d_stage_0_mapped", "3d_concat_only", "2d_stage_0_mapped", "2d_concat_only", "3d_none"],
)
def test_mapped_bytes_are_the_step_s_blocks_over_the_mmap_threshold(dim: int, threshold_of_stage_0: float) -> None:
    """The bytes a real training step allocates in blocks of at least the mmap threshold (counted by StorageTracker;
    glibc maps those afresh on every step), within 5%: the threshold set relative to stage 0's feature map (here
    tiny, so the step is small) to cover the three cases: stage 0's maps over it, only its concatenation with the
    skip, nothing."""
    from autoseg.memory.tracker import StorageTracker

    kernel, stride = (3,) * dim, (2,) * dim
    topology = NetworkTopology(
        dim=dim,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(16, 32, 64),
        kernel_sizes=(kernel,) * 3,
        strides=((1,) * dim, stride, stride),
    )
    patch, batch = ((8, 32, 32) if dim == 3 else (64, 64)), 2
    threshold = int(threshold_of_stage_0 * 16 * math.prod(patch) * batch * 4)
    step = autoseg.plan.throughput.training_step_closure(topology, patch, batch)
    step()  # the first step creates the optimizer state
    tracker = StorageTracker()
    with tracker:
        step()
    tracked = sum(d for d, kind in zip(tracker.event_delta, tracker.event_kind) if kind == 1 and d >= threshold)
    predicted = mapped_bytes(topology, patch, batch, threshold=threshold)
    assert predicted == pytest.approx(tracked, rel=0.05)
    assert (predicted > 0) == (threshold_of_stage_0 < 2)
