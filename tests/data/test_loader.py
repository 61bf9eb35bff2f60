"""BatchLoader: in-process and worker batches, the shared-memory hand-off, its host bytes, worker failures."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import make_cases

import autoseg.data.loader as batch_loader_module
import autoseg.data.sampler as loader_module
from autoseg.core.errors import InputError
from autoseg.data.loader import BatchLoader, _Slots, workers_for_shared_memory
from autoseg.memory.loader_worker import LOADER_WORKER_RUNTIME_BYTES, batch_bytes, output_batch_bytes, worker_bytes
from autoseg.plan.training_data import LoaderConfig
from autoseg.preprocess.store import case_files


def test_one_worker_yields_the_in_process_batches_and_closes(tmp_path: Path) -> None:
    ids = make_cases(tmp_path)
    config = LoaderConfig((8, 16, 16), batch_size=2)
    with BatchLoader(tmp_path, ids, config, seed=3, num_workers=0) as loader:
        expected = [next(loader) for _ in range(2)]
    loader = BatchLoader(tmp_path, ids, config, seed=3, num_workers=1, queue_depth=1)
    got = [next(loader) for _ in range(2)]
    assert multiprocessing.active_children(), "expected a worker process"
    loader.close()
    assert multiprocessing.active_children() == []
    loader.close()  # idempotent
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a["data"], b["data"]) and torch.equal(a["target"], b["target"])
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_dead_worker_raises_instead_of_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = make_cases(tmp_path, num_cases=1)
    monkeypatch.setattr(loader_module.PatchSampler, "sample_patches", lambda self, out=None: os._exit(3))
    with BatchLoader(tmp_path, ids, LoaderConfig((8, 16, 16), batch_size=1), seed=0, num_workers=1) as loader:
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            next(loader)


def test_worker_error_is_reraised(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_cases=1)
    with BatchLoader(tmp_path, ids, LoaderConfig((8, 16, 16), batch_size=1), seed=0, num_workers=1) as loader:
        case_files(tmp_path, "case_0").seg.unlink()  # vanishes after the loader checked it
        with pytest.raises(InputError, match="case_0_seg.npy"):
            next(loader)


def test_held_batches_survive_slot_reuse(tmp_path: Path) -> None:
    """Batches kept across many next() calls stay intact while the worker cycles through its 2 slots."""
    ids = make_cases(tmp_path)
    config = LoaderConfig((8, 16, 16), batch_size=2, p_noise=1.0)
    with BatchLoader(tmp_path, ids, config, seed=5, num_workers=0) as loader:
        expected = [next(loader) for _ in range(7)]
    with BatchLoader(tmp_path, ids, config, seed=5, num_workers=1, queue_depth=1) as loader:
        assert loader._slots is not None and tuple(loader._slots.data.shape[:2]) == (1, 2)
        got = [next(loader) for _ in range(7)]
        slot_pointers = {loader._slots.data[0, k].data_ptr() for k in range(2)}
    assert all(b["data"].data_ptr() not in slot_pointers for b in got)  # the trainer's own copies
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a["data"], b["data"]) and torch.equal(a["target"], b["target"])


def test_waiting_worker_stops_when_the_trainer_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_loader_module, "_PARENT_CHECK_S", 0.01)
    slots = _Slots(1, 1, (1, 1, 2, 2), (1, 1, 2, 2), torch.int8)
    views = slots.acquire(0, 0, parent_pid=os.getppid())  # free: handed out
    assert views is not None and views["data"].shape == (1, 1, 2, 2) and views["target"].dtype == np.int8
    views["data"][:] = 1
    assert torch.equal(slots.take(0, 0, pin_memory=False)["data"], torch.ones(1, 1, 2, 2))
    assert slots.acquire(0, 0, parent_pid=os.getppid()) is not None
    assert slots.acquire(0, 0, parent_pid=-1) is None  # still held: waits, sees another parent, gives up


def test_worker_bytes_terms_match_the_buffers(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_channels=2)
    config = LoaderConfig((8, 16, 16), batch_size=2)
    terms = worker_bytes((8, 16, 16), config.enlarged_patch_size, 2, 2, queue_depth=3)
    assert terms["runtime"] == LOADER_WORKER_RUNTIME_BYTES
    assert terms["in_flight"] == batch_bytes((8, 16, 16), config.enlarged_patch_size, 2, 2)
    assert terms["total"] == sum(v for k, v in terms.items() if k != "total")
    with BatchLoader(tmp_path, ids, config, seed=0, num_workers=2, queue_depth=3) as loader:
        slots = loader._slots
        allocated = (slots.data.untyped_storage().nbytes() + slots.target.untyped_storage().nbytes()) // 2
        assert allocated == terms["slots"] == 4 * output_batch_bytes((8, 16, 16), 2, 2)  # per worker
        assert loader.host_bytes() == 2 * terms["total"] + output_batch_bytes((8, 16, 16), 2, 2)
    with pytest.raises(ValueError, match="queue_depth"):
        worker_bytes((8, 8), (8, 8), 1, 1, queue_depth=0)


def test_too_little_shared_memory_fails_with_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = make_cases(tmp_path)
    config = LoaderConfig((8, 16, 16), batch_size=2)
    slots_bytes = 2 * 3 * output_batch_bytes((8, 16, 16), 2, 1)  # 2 workers x (queue depth 2 + 1)

    def usage(free: int):
        return lambda folder: shutil._ntuple_diskusage(10 * slots_bytes, 10 * slots_bytes - free, free)

    monkeypatch.setattr(batch_loader_module.shutil, "disk_usage", usage(slots_bytes - 1))
    with pytest.raises(RuntimeError, match=r"--shm-size=1g.*--loader-workers"):
        BatchLoader(tmp_path, ids, config, seed=0, num_workers=2)
    monkeypatch.setattr(batch_loader_module.shutil, "disk_usage", usage(slots_bytes))
    with BatchLoader(tmp_path, ids, config, seed=0, num_workers=2) as loader:
        assert next(loader)["data"].shape == (2, 1, 8, 16, 16)
    monkeypatch.setattr(batch_loader_module.shutil, "disk_usage", usage(0))
    BatchLoader(tmp_path, ids, config, seed=0, num_workers=0).close()  # no workers: no shared memory needed


def test_workers_for_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def free(nbytes: int) -> None:
        monkeypatch.setattr(
            batch_loader_module.shutil,
            "disk_usage",
            lambda folder: shutil._ntuple_diskusage(2**40, 2**40 - nbytes, nbytes),
        )

    free(10 * 3 * 1000)  # the slots of 10 workers at queue depth 2 (3 slots of 1000 bytes)
    assert workers_for_shared_memory(4, 2, 1000) == 4
    assert workers_for_shared_memory(16, 2, 1000) == 10
    assert workers_for_shared_memory(16, 2, 1000, share=2) == 5  # two ranks on the node
    assert workers_for_shared_memory(16, 1, 1000) == 15
    free(100)
    assert workers_for_shared_memory(4, 2, 1000) == 0

    def missing(folder):
        raise FileNotFoundError(folder)

    monkeypatch.setattr(batch_loader_module.shutil, "disk_usage", missing)
    assert workers_for_shared_memory(4, 2, 1000) == 4  # no /dev/shm (macOS): not the limit
