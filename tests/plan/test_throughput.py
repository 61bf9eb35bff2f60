from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autoseg.plan.throughput
from autoseg.core.units import GiB
from autoseg.model.topology import NetworkTopology
from autoseg.plan.throughput import GPUS, cached_cpu_throughput, conv_flops, cuda_flops_per_second, gpu_spec


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


def test_cpu_throughput_is_measured_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(autoseg.plan.throughput, "calibrate_cpu_throughput",
                        lambda repeats=3: calls.append(repeats) or 5e9)
    monkeypatch.setattr(autoseg.plan.throughput.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cached_cpu_throughput(tmp_path) == (5e9, "measured now")
    assert cached_cpu_throughput(tmp_path) == (5e9, f"cached in {tmp_path / 'cpu_throughput.json'}")
    assert calls == [1]
    stored = json.loads((tmp_path / "cpu_throughput.json").read_text())
    (tmp_path / "cpu_throughput.json").write_text(json.dumps({**stored, "key": "another machine"}))
    assert cached_cpu_throughput(tmp_path) == (5e9, "measured now") and calls == [1, 1]


def test_cpu_throughput_measured_under_load_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autoseg.plan.throughput, "calibrate_cpu_throughput", lambda repeats=3: 3e9)
    monkeypatch.setattr(autoseg.plan.throughput.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    flops, source = cached_cpu_throughput(tmp_path)
    assert flops == 3e9 and source.startswith("measured now under load 64.0, not cached")
    assert not (tmp_path / "cpu_throughput.json").exists()


class _FakeClock:
    """``time.perf_counter`` for tests: it moves only when a fake step says how long it took."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _FakeSteps:
    """Replaces ``training_step_closure`` for ``calibrate_cpu_throughput``: each step it hands out takes
    ``seconds_by_threads[torch threads]`` on a fake ``time.perf_counter`` and, with ``run_real_step``, also
    runs the real step (so torch can count its FLOPs). Records the closure's arguments and the step calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds_by_threads: dict[int, float],
                 run_real_step: bool) -> None:
        self.seconds_by_threads, self.run_real_step = seconds_by_threads, run_real_step
        self.now, self.step_calls = 1000.0, 0
        self.closure_args: list[tuple[tuple, dict]] = []
        self._real_closure = autoseg.plan.throughput.training_step_closure
        monkeypatch.setattr(autoseg.plan.throughput, "training_step_closure", self.closure)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)

    def closure(self, *args, **kwargs):
        self.closure_args.append((args, kwargs))
        real_step = self._real_closure(*args, **kwargs) if self.run_real_step else None

        def step() -> None:
            self.step_calls += 1
            if real_step is not None:
                real_step()
            self.now += self.seconds_by_threads[torch.get_num_threads()]

        return step


@pytest.mark.parametrize("seconds_by_threads", [{4: 0.5, 1: 2.0}, {4: 3.0, 1: 1.5}], ids=["idle", "busy"])
def test_calibration_divides_the_step_flops_by_the_faster_thread_count(
        monkeypatch: pytest.MonkeyPatch, seconds_by_threads: dict[int, float]) -> None:
    """All threads faster (idle machine) or one thread faster (cores shared with another process): the
    throughput is the FLOPs of the timed step over the faster time; the caller's threads are restored."""
    fake = _FakeSteps(monkeypatch, seconds_by_threads, run_real_step=False)
    before = torch.get_num_threads()
    flops = autoseg.plan.throughput.calibrate_cpu_throughput(repeats=3, max_threads=4)
    assert torch.get_num_threads() == before
    (args, kwargs), = fake.closure_args
    assert fake.step_calls == 8  # per thread count: one warm-up, then 3 timed
    assert flops == pytest.approx(conv_flops(*args, **kwargs) / min(seconds_by_threads.values()), rel=1e-12)


def test_calibration_flops_are_those_its_timed_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FLOPs in the numerator are the convolutions the timed training step executes (counted by torch),
    within 2% (the first convolution computes no input gradient): the throughput then turns ``conv_flops``
    of a planned step into its seconds."""
    fake = _FakeSteps(monkeypatch, {1: 0.25}, run_real_step=True)
    with FlopCounterMode(display=False) as counter:
        flops_per_second = autoseg.plan.throughput.calibrate_cpu_throughput(repeats=1, max_threads=1)
    assert fake.step_calls == 2  # one warm-up and one timed step, with one thread
    assert flops_per_second == pytest.approx(counter.get_total_flops() / 2 / 0.25, rel=0.02)


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


def test_a_cache_that_cannot_be_written_does_not_stop_planning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoseg.core.artifacts import WriteError

    def refuse(path, text):
        raise WriteError(path, "Read-only file system")

    monkeypatch.setattr(autoseg.plan.throughput, "calibrate_cpu_throughput", lambda repeats=3: 5e9)
    monkeypatch.setattr(autoseg.plan.throughput.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(autoseg.plan.throughput, "atomic_write_text", refuse)
    assert cached_cpu_throughput(tmp_path) == (5e9, "measured now (could not cache it)")
