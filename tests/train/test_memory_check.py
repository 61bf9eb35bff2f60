"""The memory model checked against real steps: on CPU measured here, on CUDA through an injected ``torch.cuda``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factories import tiny_plans
from train_faults import killed_after_epochs, out_of_memory_at_step

from autoseg.cli.main import main
from autoseg.core.units import GiB, MiB
from autoseg.core.workspace import Workspace
from autoseg.model.optimizer import OPTIMIZERS
from autoseg.model.topology import NetworkTopology
from autoseg.plan.plans import Plans
from autoseg.train import memory_check, memory_probes
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.memory_check import (
    CHECK_STEPS,
    EXIT_MEMORY_MISMATCH,
    MemoryObserver,
    check_plan,
    configured_step,
    predict_step,
)
from autoseg.train.memory_probes import CudaProbe
from autoseg.train.memory_report import RSS_SLACK_BYTES, TOLERANCE, MemoryCheck, MemoryRow
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

CONFIG = "3d_fullres"
TINY = dict(epochs=2, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1)
# the real step's tracked peak is a few bytes below the simulated one (small tensors a first step keeps, not yet
# traced; docs/memory.md has the figures); 64 B is 0.003% of these 1.6-2.2 MiB peaks
TENSOR_SLACK_BYTES = 64


def _plans(**changes) -> Plans:
    plans = tiny_plans()
    config = plans.configuration(CONFIG).with_(**changes)
    return dataclasses.replace(plans, configurations={CONFIG: config})


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"checkpointing": True},
        {"accumulation_steps": 2},
        {"batch_size": 1, "checkpointing": True, "accumulation_steps": 2},
    ],
)
def test_cpu_check_tracks_the_simulated_tensor_peak_of_a_real_step(changes: dict) -> None:
    check = check_plan(_plans(**changes), CONFIG, torch.device("cpu"), steps=CHECK_STEPS)
    tensors, rss, model = check.rows
    assert tensors.name == "tensors" and tensors.checked
    assert abs(tensors.measured_bytes - tensors.predicted_bytes) <= TENSOR_SLACK_BYTES, tensors
    assert rss.checked and not model.checked  # the whole-process model row is shown, not held to 10%
    assert rss.predicted_bytes > tensors.predicted_bytes  # a measured baseline plus the simulated increase
    assert check.configuration["accumulation_steps"] == changes.get("accumulation_steps", 1)
    assert check.steps == 3 and "memory check on cpu (3 steps" in check.describe()


FRESH_TOLERANCE = 0.15  # without the heap term the row is +20..+38% off: the test still fails without it
_CHECK_IN_A_FRESH_PROCESS = r"""
import json, sys
import torch
from autoseg.plan.plans import Plans
from autoseg.train.memory_check import CHECK_STEPS, check_plan
check = check_plan(Plans.from_json(sys.argv[1]), "3d_fullres", torch.device("cpu"), steps=CHECK_STEPS)
print(json.dumps(check.to_dict()))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_cpu_peak_rss_of_a_fresh_process_counts_what_glibcs_heap_keeps(tmp_path: Path) -> None:
    """The first-steps check of a fresh process (glibc's thresholds at their defaults, as in ``autoseg train`` and
    ``autoseg check-memory``) on a step whose 12 MiB feature maps glibc keeps in its heap when freed: the peak RSS
    row holds within the tolerance only with the heap term (``fragmentation``, a fifth of the prediction here).
    glibc's heap layout differs from one fresh process to the next (the same steps, seeds and thread count), so
    the peak RSS does too, and more with two threads, whose interleaving moves it (27 runs: -14.8%..+2.1% of the
    prediction, so a median of three fell outside the tolerance in about 1 suite of 4) than with one (10 runs:
    -7.4%..+1.4%); +20..+38% without the term. One thread; the median of three runs is held to ``FRESH_TOLERANCE``,
    wider than the check's own 10%: on 2026-11-27 six runs each gave -11.8%..-2.1% (main) and -8.8%..-1.5% (the
    commit before issue 26's work), so the median of three fell outside 10% in one CI run of five. Left open: the heap
    term over-predicts this step by about 6% on average here."""
    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(16, 32),
        kernel_sizes=((3, 3, 3), (3, 3, 3)),
        strides=((1, 1, 1), (1, 2, 2)),
    )
    plans = _plans(network=topology, patch_size=(24, 64, 64), inference_patch_size=(24, 64, 64))
    plans.to_json(tmp_path / "plans.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
    rows = []
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _CHECK_IN_A_FRESH_PROCESS, str(tmp_path / "plans.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=True,
        )
        check = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(next(row for row in check["rows"] if row["name"] == "peak RSS"))
    median = sorted(rows, key=lambda row: row["error"])[1]
    assert abs(median["error"]) <= FRESH_TOLERANCE, rows
    heap = predict_step(plans.configuration(CONFIG), "cpu", OPTIMIZERS["sgd"], plans.label_scheme).device_terms
    assert heap["fragmentation"] > 1.5 * TOLERANCE * median["predicted_bytes"]  # without it the row would be off


class FakeCuda:
    """``torch.cuda``'s five functions the probe calls, answering fixed figures; records the order of calls."""

    def __init__(self, allocated: int, reserved: int, used: int, total: int = 24 * GiB) -> None:
        self.allocated, self.reserved, self.used, self.total = allocated, reserved, used, total
        self.calls: list[str] = []

    def synchronize(self, device) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset")

    def max_memory_allocated(self, device) -> int:
        self.calls.append("allocated")
        return self.allocated

    def max_memory_reserved(self, device) -> int:
        return self.reserved

    def mem_get_info(self, device) -> tuple[int, int]:
        return self.total - self.used, self.total


def _cuda_check(scale: dict[str, float]) -> tuple[MemoryCheck, FakeCuda]:
    """The CUDA branch on a CPU step: the prediction for cuda, the measurement from a ``FakeCuda`` that answers the
    predicted figures times ``scale`` (per row name)."""
    plans = _plans()
    config, scheme = plans.configuration(CONFIG), plans.label_scheme
    terms = predict_step(config, "cuda", OPTIMIZERS["sgd"], scheme).device_terms
    reserved = terms["tensors"] + terms["allocator_rounding"] + terms["fragmentation"] + terms["conv_workspace"]
    cuda = FakeCuda(
        int(terms["tensors"] * scale.get("allocated", 1.0)),
        int(reserved * scale.get("reserved", 1.0)),
        int(terms["total"] * scale.get("device used", 1.0)),
    )
    step = configured_step(config, torch.device("cpu"), OPTIMIZERS["sgd"], scheme)
    batches = iter(
        [{"data": torch.randn(2, 1, 8, 16, 16), "target": torch.zeros(2, 1, 8, 16, 16, dtype=torch.int8)}] * 3
    )
    results: list = []
    observer = MemoryObserver(
        config,
        torch.device("cuda"),
        OPTIMIZERS["sgd"],
        scheme,
        results.append,
        probe=CudaProbe(torch.device("cuda"), cuda),
    )
    for _ in range(3):
        observer.step(step, batches)
    (check,) = results  # once, after the first CHECK_STEPS steps
    return check, cuda


def test_cuda_check_compares_allocator_statistics_with_the_predicted_terms() -> None:
    check, cuda = _cuda_check({"allocated": 1.05, "device used": 0.95})
    assert [r.name for r in check.rows] == ["allocated", "reserved", "device used"]
    assert check.ok and check.warning() is None
    assert [round(r.error, 3) for r in check.rows] == [0.05, 0.0, -0.05]
    assert cuda.calls.index("reset") < cuda.calls.index("allocated")  # peaks reset before the steps, read after
    assert cuda.calls.count("reset") == 1


def test_a_cpu_peak_rss_gap_within_the_heap_s_spread_between_processes_is_not_off() -> None:
    """A tiny step on a large process: 13% over the prediction but 59 MiB, under the 64 MiB the same steps' peak RSS
    spreads between fresh processes, is no mismatch; 100 MiB over is, as is any row without the slack."""

    def row(measured_mib: int, slack: int) -> MemoryRow:
        return MemoryRow("peak RSS", measured_mib * MiB, 460 * MiB, "VmHWM", "model", slack_bytes=slack)

    assert RSS_SLACK_BYTES == 64 * MiB
    assert not row(519, RSS_SLACK_BYTES).off() and row(519, 0).off()
    assert row(560, RSS_SLACK_BYTES).off() and row(360, RSS_SLACK_BYTES).off()
    assert not row(500, 0).off()  # 8.7%: within the tolerance either way
    configuration = {
        "batch_size": 1,
        "accumulation_steps": 1,
        "patch_size": (8, 8, 8),
        "precision": "fp32",
        "checkpointing": False,
    }
    rows = (row(519, RSS_SLACK_BYTES), row(500, RSS_SLACK_BYTES), row(560, RSS_SLACK_BYTES))
    table = MemoryCheck("cpu", configuration, 3, rows).table()
    assert [line.split()[7] for line in table.splitlines()[3:6]] == ["yes", "yes", "NO"]
    assert table.count("yes (by < 64.0 MiB)") == 1 and rows[0].to_dict()["slack_bytes"] == RSS_SLACK_BYTES


def test_a_cuda_mismatch_names_the_terms_off_by_more_than_ten_percent() -> None:
    check, _ = _cuda_check({"reserved": 1.3, "device used": 0.85})
    assert not check.ok
    assert [r.name for r in check.off_rows] == ["reserved", "device used"]
    warning = check.warning()
    assert "off by more than 10% on this cuda" in warning and "reserved" in warning and "+30.0%" in warning
    assert "allocated:" not in warning
    assert "OFF by more than 10%: reserved, device used" in check.describe()


def _workspace(tmp_path: Path) -> Path:
    ws = Workspace.at(tmp_path / "ws")
    ws.root.mkdir(parents=True)
    tiny_plans().to_json(ws.plans_path)
    return ws.root


def test_check_memory_prints_the_table_and_exits_zero_within_ten_percent(tmp_path: Path, capsys) -> None:
    code = main(["-q", "check-memory", "-w", str(_workspace(tmp_path)), "--device", "cpu", "--steps", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tensors" in out and "peak RSS" in out and "within 10%" in out


def test_check_memory_exits_non_zero_and_says_what_is_off(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(memory_probes, "peak_rss_bytes", lambda: 64 * GiB)  # an injected mismatch
    code = main(["-q", "check-memory", "-w", str(_workspace(tmp_path)), "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert code == EXIT_MEMORY_MISMATCH == 3
    assert "off by more than 10% on this cpu: peak RSS: measured 64.00 GiB" in captured.err
    record = json.loads(captured.out[captured.out.index("{") :])
    assert record["ok"] is False and record["steps"] == 3


def test_check_memory_refuses_a_plan_too_large_for_the_host(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(memory_check, "available_ram_bytes", lambda: 1024)
    code = main(["-q", "check-memory", "-w", str(_workspace(tmp_path)), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "is predicted to need" in err and "it would swap, not measure" in err


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:
    shutil.copytree(prepared, tmp_path / "ws")
    return Workspace.at(tmp_path / "ws")


def test_training_records_the_check_in_run_json_the_checkpoint_and_the_log(workspace: Workspace, caplog) -> None:
    caplog.set_level(logging.INFO, logger="autoseg.train.trainer")
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    (check,) = json.loads((fold / "run.json").read_text())["memory_checks"]  # once: the first steps
    assert check["ok"] and check["device"] == "cpu" and check["steps"] == CHECK_STEPS == 3
    assert check["configuration"] == {
        "batch_size": 2,
        "accumulation_steps": 1,
        "patch_size": [8, 16, 16],
        "checkpointing": True,
        "precision": "fp32",
        "optimizer": "sgd",
    }
    tensors = check["rows"][0]
    assert abs(tensors["measured_bytes"] - tensors["predicted_bytes"]) <= TENSOR_SLACK_BYTES
    assert load_checkpoint(fold / "checkpoint_final.pt").progress.memory_checks == (check,)
    assert (
        "memory check on cpu (3 steps, batch 2 x 1, patch 8x16x16, fp32, checkpointing)"
        in (fold / "train.log").read_text()
    )


def test_training_warns_when_the_model_is_off_and_goes_on(workspace: Workspace, monkeypatch) -> None:
    monkeypatch.setattr(memory_probes, "peak_rss_bytes", lambda: 64 * GiB)
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    (check,) = json.loads((fold / "run.json").read_text())["memory_checks"]
    assert check["ok"] is False
    log = (fold / "train.log").read_text()
    assert "the memory model is off by more than 10% on this cpu: peak RSS" in log
    assert (fold / "checkpoint_final.pt").is_file()  # a warning, not an error


def test_a_degradation_in_the_first_steps_checks_the_degraded_configuration(workspace: Workspace) -> None:
    with out_of_memory_at_step(1):
        fold = train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    (check,) = json.loads((fold / "run.json").read_text())["memory_checks"]
    assert (check["configuration"]["batch_size"], check["configuration"]["accumulation_steps"]) == (1, 2)
    tensors = check["rows"][0]
    assert abs(tensors["measured_bytes"] - tensors["predicted_bytes"]) <= TENSOR_SLACK_BYTES


def test_a_resumed_run_checks_again_and_keeps_the_earlier_check(workspace: Workspace) -> None:
    run = {**TINY, "epochs": 2, "iterations_per_epoch": CHECK_STEPS}  # each process runs its CHECK_STEPS
    with killed_after_epochs(1):
        train(workspace, CONFIG, 0, RunConfig(**run), progress=False)
    fold = train(workspace, CONFIG, 0, RunConfig(**run, resume=True), progress=False)
    checks = json.loads((fold / "run.json").read_text())["memory_checks"]
    assert len(checks) == 2 and all(c["ok"] for c in checks)
