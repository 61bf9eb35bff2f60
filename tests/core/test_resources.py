from __future__ import annotations

import sys

import pytest
import torch

from autoseg.core.resources import cuda_available, processes_for
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
