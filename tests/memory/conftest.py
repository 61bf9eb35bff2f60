from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Each memory test runs on one torch thread, whatever an earlier test left: tiny real steps are 20x slower
    with 2 threads on a shared 2-core machine (thread contention), and measurements compare like with like."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
