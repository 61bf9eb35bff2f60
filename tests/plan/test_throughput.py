from __future__ import annotations

import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autoseg.plan.throughput
from autoseg.core.units import GiB
from autoseg.model.topology import NetworkTopology
from autoseg.plan.throughput import (
    GPUS,
    StepTimes,
    conv_flops,
    cpu_throughput_from_times,
    cuda_flops_per_second,
    gpu_spec,
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
    """Replaces ``training_step_closure`` for ``calibrate_cpu_throughput``: the timed steps with n torch threads
    take ``seconds_by_threads[n]`` in turn (the warm-up 0 s) on a fake ``time.perf_counter`` and ``process_time``
    (an idle machine: one thread's CPU seconds are its wall seconds) and, with ``run_real_step``, also run the
    real step (so torch can count its FLOPs). Records the closure's arguments and the step calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds_by_threads: dict[int, list[float]],
                 run_real_step: bool) -> None:
        self.seconds_by_threads = {n: [0.0, *s] for n, s in seconds_by_threads.items()}
        self.run_real_step = run_real_step
        self.now, self.step_calls = 1000.0, 0
        self.closure_args: list[tuple[tuple, dict]] = []
        self._real_closure = autoseg.plan.throughput.training_step_closure
        monkeypatch.setattr(autoseg.plan.throughput, "training_step_closure", self.closure)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(time, "process_time", lambda: self.now)

    def closure(self, *args, **kwargs):
        self.closure_args.append((args, kwargs))
        real_step = self._real_closure(*args, **kwargs) if self.run_real_step else None

        def step() -> None:
            self.step_calls += 1
            if real_step is not None:
                real_step()
            self.now += self.seconds_by_threads[torch.get_num_threads()].pop(0)

        return step


def test_calibration_flops_are_those_its_timed_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FLOPs in the numerator are the convolutions the timed training step executes (counted by torch),
    within 2% (the first convolution computes no input gradient): the throughput then turns ``conv_flops``
    of a planned step into its seconds."""
    fake = _FakeSteps(monkeypatch, {1: [0.25]}, run_real_step=True)
    with FlopCounterMode(display=False) as counter:
        measured = autoseg.plan.throughput.calibrate_cpu_throughput(repeats=1, max_threads=1)
    assert fake.step_calls == 2  # one warm-up and one timed step, with one thread
    assert measured.value == pytest.approx(counter.get_total_flops() / 2 / 0.25, rel=0.05)  # 2 significant digits


def _times(threads: int, wall: float, cpu: float) -> StepTimes:
    return StepTimes(threads=threads, wall_seconds=wall, cpu_seconds=cpu)


def test_idle_cores_give_every_thread_s_speed_and_may_be_cached() -> None:
    measured = cpu_throughput_from_times(1e9, _times(1, 0.5, 0.5), _times(2, 0.3, 0.6))
    assert measured.value == 3.3e9 and measured.keep  # 1e9 / 0.3 s, to 2 significant digits
    assert measured.details["all_threads_wall_seconds"] == 0.3


@pytest.mark.parametrize("one, every, why", [
    (_times(1, 1.5, 0.5), _times(2, 1.2, 0.7), "one thread got 33% of a CPU"),
    (_times(1, 0.5, 0.5), _times(2, 0.6, 0.7), "2 threads ran no faster than one (0.600 vs 0.500 s)"),
], ids=["core_shared", "threads_no_faster"])
def test_busy_cores_give_one_thread_s_cpu_time_rate_not_cached(one: StepTimes, every: StepTimes, why: str) -> None:
    """Another process on the cores: the figure falls back to one thread's FLOPs per CPU second (which the load
    does not change) and is not cached, so that an idle run measures the faster figure later."""
    measured = cpu_throughput_from_times(1e9, one, every)
    assert measured.value == pytest.approx(1e9 / 0.5) and not measured.keep
    assert why in measured.why_not_kept and "--cpu-flops" in measured.why_not_kept


def test_small_noise_gives_the_same_figure() -> None:
    """Rounded to 2 significant digits: 48.2 and 48.0 GFLOP/s (measured idle and beside 2 busy processes) agree."""
    figures = {cpu_throughput_from_times(1e9, _times(1, 0.5, cpu), None).value for cpu in (1 / 48.2, 1 / 48.0)}
    assert figures == {48e9}


def test_one_cpu_machine_uses_the_one_thread_figure() -> None:
    measured = cpu_throughput_from_times(1e9, _times(1, 0.25, 0.25), None)
    assert measured.value == pytest.approx(4e9) and measured.keep


def test_calibration_times_one_thread_and_every_cpu_best_of_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration step runs once to warm up and ``repeats`` times timed, with 1 thread and with every CPU;
    the best run counts (a slow run does not lower the figure); the caller's threads are restored."""
    fake = _FakeSteps(monkeypatch, {4: [0.9, 0.25, 0.4], 1: [2.0, 0.8, 0.5]}, run_real_step=False)
    before = torch.get_num_threads()
    measured = autoseg.plan.throughput.calibrate_cpu_throughput(repeats=3, max_threads=4)
    assert torch.get_num_threads() == before
    (args, kwargs), = fake.closure_args
    assert fake.step_calls == 8  # per thread count: one warm-up, then 3 timed
    assert measured.value == pytest.approx(conv_flops(*args, **kwargs) / 0.25, rel=0.05)  # 2 significant digits
    assert measured.details["one_thread_wall_seconds"] == 0.5 and measured.keep


def _topologies() -> dict[str, tuple[NetworkTopology, tuple[int, ...], int]]:
    return {
        "3d": (NetworkTopology(dim=3, in_channels=1, num_outputs=3, features_per_stage=(4, 8),
                               kernel_sizes=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2))), (8, 16, 16), 2),
        "3d_anisotropic": (NetworkTopology(dim=3, in_channels=2, num_outputs=4, features_per_stage=(4, 8, 16),
                                           kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)),
                                           strides=((1, 1, 1), (1, 2, 2), (2, 2, 2))), (8, 16, 16), 1),
        "2d": (NetworkTopology(dim=2, in_channels=1, num_outputs=2, features_per_stage=(4, 8, 16),
                               kernel_sizes=((3, 3), (3, 3), (3, 3)), strides=((1, 1), (2, 2), (2, 2))), (32, 32), 2),
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
