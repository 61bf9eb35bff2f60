from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import autoseg.core.resources as resources
from autoseg.core.resources import cpu_busy_seconds, cuda_available, processes_for
from autoseg.core.units import GiB


def test_processes_for_divides_the_budget_by_the_bytes_of_one_process() -> None:
    assert processes_for(16 * GiB, 3 * GiB, 8) == 5
    assert processes_for(16 * GiB, 3 * GiB, 2) == 2  # capped by the CPUs
    assert processes_for(1 * GiB, 3 * GiB, 8) == 1  # never below the minimum, even if one process does not fit
    assert processes_for(1 * GiB, 3 * GiB, 8, minimum=0) == 0  # loader workers: none is an answer
    assert processes_for(-1 * GiB, 3 * GiB, 8, minimum=0) == 0  # the trainer alone exceeds the budget
    with pytest.raises(ValueError, match="positive bytes per process"):
        processes_for(16 * GiB, 0, 8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the GPU drivers' device files are Linux's")
def test_cuda_is_not_available_without_a_gpu_drivers_device_file_else_torch_says(tmp_path) -> None:
    """No device file of a GPU driver: no CUDA, said without asking torch; with one, torch's answer."""
    assert cuda_available(device_files=(str(tmp_path / "nvidiactl"),)) is False
    (tmp_path / "nvidiactl").touch()
    assert cuda_available(device_files=(str(tmp_path / "nvidiactl"),)) == torch.cuda.is_available()


_ARENAS_AFTER_A_THREAD = r"""
import ctypes, sys, threading
import numpy as np
from autoseg.core.resources import use_one_malloc_arena
if sys.argv[1] == "one":
    assert use_one_malloc_arena()
def work():
    blocks = [np.ones(100_000 // 8) for _ in range(50)]  # 100 kB each: below glibc's mmap threshold, from an arena
    del blocks
thread = threading.Thread(target=work)
thread.start()
thread.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_stats")
def test_one_malloc_arena_keeps_a_threads_allocations_in_the_main_arena() -> None:
    """A fresh process whose thread allocates: glibc gives the thread an arena of its own (2 arenas), unless
    ``use_one_malloc_arena`` ran first (1): what that thread frees is then the main thread's to reuse."""

    def arenas(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _ARENAS_AFTER_A_THREAD, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return sum(line.startswith("Arena ") for line in done.stderr.splitlines())

    assert arenas("default") == 2
    assert arenas("one") == 1


def test_cpu_busy_seconds_sum_the_working_columns_of_the_chosen_cpus(tmp_path: Path) -> None:
    """/proc/stat's per-CPU lines: user, nice, system, irq, softirq and steal count, idle and iowait do not; only
    the CPUs asked for (this process's may be a few of the machine's); an unreadable file gives None."""
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  999 999 999 999 999 999 999 999 0 0\n"
        "cpu0 100 10 20 5000 70 1 2 3 0 0\n"
        "cpu1 200 20 40 9000 80 4 5 6 0 0\n"
        "cpu2 400 40 80 1000 90 7 8 9 0 0\n"
        "intr 12345 1 2 3\n"
    )
    ticks = os.sysconf("SC_CLK_TCK")
    assert cpu_busy_seconds([0, 2], str(stat)) == pytest.approx((136 + 544) / ticks)
    assert cpu_busy_seconds([1], str(stat)) == pytest.approx(275 / ticks)
    assert cpu_busy_seconds([0], str(tmp_path / "missing")) is None


def test_others_busy_is_the_busy_cpu_time_less_this_processs_over_the_wall_time(monkeypatch) -> None:
    clock = {"busy": 100.0, "own": 10.0, "wall": 1000.0}
    monkeypatch.setattr(resources, "cpu_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(time, "perf_counter", lambda: clock["wall"])
    with resources.OthersBusy() as others:  # 4 s: this process 3 CPU seconds, the CPUs 5 busy seconds in all
        clock.update(busy=105.0, own=13.0, wall=1004.0)
    assert others.cpus == pytest.approx(0.5)
    monkeypatch.setattr(resources, "cpu_busy_seconds", lambda: None)  # /proc/stat unreadable: unknown
    with resources.OthersBusy() as unknown:
        pass
    assert unknown.cpus is None
