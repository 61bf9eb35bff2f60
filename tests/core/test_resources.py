from __future__ import annotations

import pytest

from autoseg.core.resources import processes_for
from autoseg.core.units import GiB


def test_processes_for_divides_the_budget_by_the_bytes_of_one_process() -> None:
    assert processes_for(16 * GiB, 3 * GiB, 8) == 5
    assert processes_for(16 * GiB, 3 * GiB, 2) == 2  # capped by the CPUs
    assert processes_for(1 * GiB, 3 * GiB, 8) == 1  # never below the minimum, even if one process does not fit
    assert processes_for(1 * GiB, 3 * GiB, 8, minimum=0) == 0  # loader workers: none is an answer
    assert processes_for(-1 * GiB, 3 * GiB, 8, minimum=0) == 0  # the trainer alone exceeds the budget
    with pytest.raises(ValueError, match="positive bytes per process"):
        processes_for(16 * GiB, 0, 8)
