from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoseg.plan.compute
from autoseg.plan.throughput import GPUS, cached_cpu_throughput, cuda_flops_per_second, gpu_spec

GiB = 1024**3


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
    monkeypatch.setattr(autoseg.plan.compute, "calibrate_cpu_throughput",
                        lambda repeats=3: calls.append(repeats) or 5e9)
    monkeypatch.setattr(autoseg.plan.throughput.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cached_cpu_throughput(tmp_path) == (5e9, "measured now")
    assert cached_cpu_throughput(tmp_path) == (5e9, f"cached in {tmp_path / 'cpu_throughput.json'}")
    assert calls == [1]
    stored = json.loads((tmp_path / "cpu_throughput.json").read_text())
    (tmp_path / "cpu_throughput.json").write_text(json.dumps({**stored, "key": "another machine"}))
    assert cached_cpu_throughput(tmp_path) == (5e9, "measured now") and calls == [1, 1]


def test_cpu_throughput_measured_under_load_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autoseg.plan.compute, "calibrate_cpu_throughput", lambda repeats=3: 3e9)
    monkeypatch.setattr(autoseg.plan.throughput.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    flops, source = cached_cpu_throughput(tmp_path)
    assert flops == 3e9 and source.startswith("measured now under load 64.0, not cached")
    assert not (tmp_path / "cpu_throughput.json").exists()


def test_calibration_uses_the_faster_thread_count() -> None:
    flops = autoseg.plan.compute.calibrate_cpu_throughput(repeats=1, max_threads=1)
    assert 1e8 < flops < 1e13
