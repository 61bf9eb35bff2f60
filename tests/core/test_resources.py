from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoseg.core.resources import cuda_available, processes_for
from autoseg.core.units import GiB, MiB


def test_processes_for_divides_the_budget_by_the_bytes_of_one_process() -> None:
    assert processes_for(16 * GiB, 3 * GiB, 8) == 5
    assert processes_for(16 * GiB, 3 * GiB, 2) == 2  # capped by the CPUs
    assert processes_for(1 * GiB, 3 * GiB, 8) == 1  # never below the minimum, even if one process does not fit
    assert processes_for(1 * GiB, 3 * GiB, 8, minimum=0) == 0  # loader workers: none is an answer
    assert processes_for(-1 * GiB, 3 * GiB, 8, minimum=0) == 0  # the trainer alone exceeds the budget
    with pytest.raises(ValueError, match="positive bytes per process"):
        processes_for(16 * GiB, 0, 8)


_HELD_AFTER_FREE = r"""
import sys
import numpy as np
from autoseg.core.resources import process_rss_bytes, return_freed_blocks_at_once
if sys.argv[1] == "fixed":
    assert return_freed_blocks_at_once()
held, small = [], []
for _ in range(3):  # glibc raises its threshold after the first free: the second 8 MiB block comes from the heap
    before = process_rss_bytes()
    block = np.ones(8 << 20, dtype=np.uint8)
    small.append(np.ones(1000))  # allocated after it: the heap cannot shrink below it
    del block
    held.append(process_rss_bytes() - before)
print(max(held))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc RSS")
def test_freed_blocks_leave_the_rss_at_once_with_the_fixed_mmap_threshold():
    """With glibc's default the second 8 MiB block stays resident after it is freed (a small block behind it on
    the heap); with ``return_freed_blocks_at_once`` (what CPU prediction calls) it leaves at once."""
    held = {mode: int(subprocess.run([sys.executable, "-c", _HELD_AFTER_FREE, mode], capture_output=True, text=True,
                                     check=True, timeout=60).stdout.split()[-1]) for mode in ("default", "fixed")}
    assert held["default"] >= 7 * MiB, held  # the glibc behaviour this guards against is there
    assert held["fixed"] < 1 * MiB, held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the GPU drivers' device files are Linux's")
def test_cuda_is_not_available_without_a_gpu_drivers_device_file_else_torch_says(tmp_path) -> None:
    """No device file of a GPU driver: no CUDA, said without asking torch; with one, torch's answer."""
    assert cuda_available(device_files=(str(tmp_path / "nvidiactl"),)) is False
    (tmp_path / "nvidiactl").touch()
    assert cuda_available(device_files=(str(tmp_path / "nvidiactl"),)) == torch.cuda.is_available()
