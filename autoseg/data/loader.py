"""Training batches from worker processes, handed over through shared memory that is reused.

``BatchLoader`` is an endless iterator of torch batches built by ``PatchSampler`` + ``Augmenter``
(``autoseg.data.sampler``), in this process (``num_workers=0``) or in worker processes (a torch DataLoader over
an endless IterableDataset, which keeps the order of the streams, re-raises a worker's error and notices a
dead worker).

The hand-off: each worker owns ``queue_depth + 1`` batch-sized slots in shared memory, allocated once
when the loader starts. It writes a finished batch into its next slot and sends only the slot's number;
the trainer's process copies the slot into a tensor of its own (pinned on CUDA) and frees the slot. A fresh
shared-memory batch per step, as torch's DataLoader makes by default, costs the worker page faults on every
batch, a large share of its CPU time with precomputed augmentations; the trainer's copy costs far less
(docs/benchmarks.md, "Training data pipeline"). A slot is written only after the trainer released it (one
semaphore per slot), so a batch is never overwritten while it is read.

Host memory: ``worker_bytes`` per worker (its own pages beside the trainer's it shares, one batch in flight, the
freed buffers the allocator keeps, its slots, the augmentation's caches), plus the trainer's copy of the batch it
trains on (``output_batch_bytes``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from threadpoolctl import ThreadpoolController
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from autoseg.core.errors import InputError, RunError
from autoseg.core.resources import processes_for
from autoseg.core.units import GiB, MiB
from autoseg.core.workers import die_with_parent
from autoseg.data.augment import Augmenter
from autoseg.data.sampler import PatchSampler
from autoseg.memory.loader_worker import output_batch_bytes, worker_bytes
from autoseg.plan.training_data import LoaderConfig

__all__ = ["BatchLoader", "workers_for_shared_memory"]

_PARENT_CHECK_S = 1.0  # how often a worker waiting for a free slot checks that the trainer is alive
SHM_FOLDER = "/dev/shm"  # where torch's shared memory lives on Linux


def _free_shared_memory(folder: str = SHM_FOLDER) -> int | None:
    """Free bytes of the shared-memory file system, or None where there is none (macOS: torch shares
    memory another way). Its pages are taken only when written, so running out later kills a worker with
    SIGBUS (Docker's default /dev/shm is 64 MiB)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _check_shared_memory(nbytes: int, workers: int, folder: str = SHM_FOLDER) -> None:
    """Fail with advice if ``folder`` has less than ``nbytes`` free."""
    free = _free_shared_memory(folder)
    if free is not None and nbytes > free:
        raise RunError(
            f"the training loader's {workers} worker(s) need {nbytes / MiB:.0f} MiB of shared memory for their "
            f"batch slots, but {folder} has {free / MiB:.0f} MiB free; enlarge it (Docker: --shm-size="
            f"{math.ceil(2 * nbytes / GiB)}g) or train with fewer --loader-workers (0 builds the batches in "
            "the training process)"
        )


def workers_for_shared_memory(
    workers: int, queue_depth: int, batch_bytes: int, share: int = 1, folder: str = SHM_FOLDER
) -> int:
    """How many of ``workers`` have room for their ``queue_depth + 1`` slots of ``batch_bytes``
    (``output_batch_bytes``) in ``1 / share`` of ``folder``'s free space (``share``: processes on the node
    that start loaders); all of them where there is no such file system."""
    free = _free_shared_memory(folder)
    if free is None:
        return workers
    return processes_for(free / share, (queue_depth + 1) * batch_bytes, workers, minimum=0)


class _Slots:
    """``count`` reusable shared-memory batches per worker: ``data`` float32 (W, K, B, C, *P), ``target``
    (W, K, B, 1, *P) in the seg dtype, and per slot a semaphore that is 1 while the slot may be written."""

    def __init__(
        self,
        workers: int,
        count: int,
        data_shape: tuple[int, ...],
        target_shape: tuple[int, ...],
        target_dtype: torch.dtype,
    ) -> None:
        self.count = count
        itemsize = torch.empty(0, dtype=target_dtype).element_size()
        batch, channels, *patch = data_shape  # (B, C, *P); the target is (B, 1, *P)
        _check_shared_memory(workers * count * output_batch_bytes(patch, batch, channels, itemsize), workers)
        self.data = torch.empty((workers, count, *data_shape), dtype=torch.float32).share_memory_()
        self.target = torch.empty((workers, count, *target_shape), dtype=target_dtype).share_memory_()
        self.free = [[multiprocessing.Semaphore(1) for _ in range(count)] for _ in range(workers)]

    def acquire(self, worker: int, slot: int, parent_pid: int) -> dict[str, np.ndarray] | None:
        """Wait until the trainer released the slot; its (data, target) arrays to write the next batch into,
        or None if the trainer's process is gone (the worker should stop)."""
        while not self.free[worker][slot].acquire(timeout=_PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                return None
        return {"data": self.data[worker, slot].numpy(), "target": self.target[worker, slot].numpy()}

    def take(self, worker: int, slot: int, pin_memory: bool) -> dict[str, torch.Tensor]:
        """A copy of the slot in memory of this process (pinned if asked), and the slot released."""
        out = {}
        for key, shared in (("data", self.data), ("target", self.target)):
            out[key] = torch.empty(shared.shape[2:], dtype=shared.dtype, pin_memory=pin_memory)
            out[key].copy_(shared[worker, slot])
        self.free[worker][slot].release()
        return out


class _BatchStream(IterableDataset):
    """Endless batches of stream (seed, worker_id); picklable, opens files in the iterating process. With
    ``slots`` (in a worker) it yields (worker_id, slot) after writing the batch into that slot, else the
    batch itself.

    BLAS runs one thread while a batch is built: OpenBLAS threads spinning against another busy process make a
    matrix product many times slower (docs/benchmarks.md, "Training data pipeline")."""

    def __init__(
        self,
        folder: Path,
        case_ids: tuple[str, ...],
        config: LoaderConfig,
        seed: int,
        slots: _Slots | None,
        previous_folder: Path | None = None,
    ) -> None:
        self.folder, self.case_ids, self.config, self.seed, self.slots = folder, case_ids, config, seed, slots
        self.previous_folder = previous_folder
        self.parent_pid = os.getpid()
        self.forked_by_main_thread = threading.current_thread() is threading.main_thread()  # iter() follows

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker_id = 0 if info is None else info.id
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, worker_id]))
        sampler = PatchSampler(self.folder, self.case_ids, self.config, rng, self.previous_folder)
        augmenter = Augmenter(self.config)
        threads = ThreadpoolController()
        b, patch = self.config.batch_size, self.config.patch_size
        patches = {
            "data": np.empty((b, sampler.num_channels, *patch), np.float32),  # reused for every batch
            "seg": np.empty((b, 1, *patch), sampler.seg_dtype),
        }
        for index in range(2**62):
            with threads.limit(limits=1):
                batch, seed = sampler.sample_patches(patches), int(rng.integers(2**31))
                if self.slots is None:  # torch-allocated (64-byte aligned): a batch wrapping numpy's buffers
                    # (torch.from_numpy) makes a CPU training step slower: docs/benchmarks.md, training step speed
                    out: Any = {
                        "data": torch.empty(patches["data"].shape),
                        "target": torch.from_numpy(patches["seg"]).new_empty(patches["seg"].shape),
                    }
                    augmenter(batch, seed, out={k: v.numpy() for k, v in out.items()})
                else:
                    slot = index % self.slots.count
                    views = self.slots.acquire(worker_id, slot, self.parent_pid)
                    if views is None:
                        return
                    augmenter(batch, seed, out=views)
                    out = (worker_id, slot)
            yield out


def _init_worker(worker_id: int) -> None:
    """Die with the trainer's process (a SIGKILL of it runs no cleanup; torch's watchdog looks only between
    batches); one torch thread per worker: the workers already run in parallel."""
    stream = get_worker_info().dataset
    if stream.forked_by_main_thread:  # the death signal follows the forking thread, not the process
        die_with_parent(stream.parent_pid)
    torch.set_num_threads(1)


class BatchLoader:
    """Endless iterator of {"data": float32 (B, C, *patch), "target": (B, 1, *patch)} torch batches; the target
    has the preprocessed labels' dtype (int8; int16 beyond 127 classes), -1 mapped to 0; cast it to int64 on
    the device (the losses do).

    ``num_workers=0`` builds batches in this process; ``num_workers > 0`` in worker processes, each holding
    at most ``queue_depth`` finished batches ahead in its shared-memory slots (see the module's docstring).
    Every batch returned is this process's own tensor (pinned with ``pin_memory`` on CUDA). A worker that
    raises re-raises here; one that dies raises RuntimeError here instead of hanging. Use as a context
    manager or call ``close()`` to stop the workers. ``previous_folder``: a cascade stage's previous-stage label maps
    (``PatchSampler``), one-hot as the last data channels.
    """

    def __init__(
        self,
        folder: str | Path,
        case_ids: Sequence[str],
        config: LoaderConfig,
        seed: int,
        num_workers: int = 0,
        queue_depth: int = 2,
        pin_memory: bool = False,
        previous_folder: str | Path | None = None,
    ) -> None:
        if num_workers < 0 or queue_depth < 1:
            raise InputError(f"need num_workers >= 0 and queue_depth >= 1; got {num_workers}, {queue_depth}")
        folder = Path(folder)
        previous_folder = None if previous_folder is None else Path(previous_folder)
        probe = PatchSampler(folder, case_ids, config, np.random.default_rng(0), previous_folder)  # fail here
        self.config, self.num_workers, self.queue_depth = config, num_workers, queue_depth
        self.num_channels, self.enlarged_patch_size = probe.num_channels, probe.enlarged_patch_size
        self.seg_itemsize = probe.seg_dtype.itemsize
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._slots = None
        if num_workers > 0:
            b, p = config.batch_size, config.patch_size
            target_dtype = torch.from_numpy(np.zeros(0, probe.seg_dtype)).dtype
            self._slots = _Slots(num_workers, queue_depth + 1, (b, self.num_channels, *p), (b, 1, *p), target_dtype)
        self._loader = DataLoader(
            _BatchStream(folder, tuple(case_ids), config, int(seed), self._slots, previous_folder),
            batch_size=None,  # the stream yields whole batches
            num_workers=num_workers,
            prefetch_factor=queue_depth if num_workers > 0 else None,
            worker_init_fn=_init_worker if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(int(seed)),  # leave the global torch RNG alone
        )
        self._iterator: Iterator[Any] | None = iter(self._loader)

    def host_bytes(self) -> int:
        """Upper bound of the loader's host bytes: ``worker_bytes`` per worker (none without workers: the
        batch is built in this process) + this process's copy of the batch."""
        p, b, c = self.config.patch_size, self.config.batch_size, self.num_channels
        terms = worker_bytes(
            p,
            self.enlarged_patch_size,
            b,
            c,
            self.queue_depth,
            seg_itemsize=self.seg_itemsize,
            dummy_2d=self.config.dummy_2d,
        )
        workers = terms["total"] * self.num_workers if self.num_workers else terms["in_flight"]
        return workers + output_batch_bytes(p, b, c, self.seg_itemsize)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            raise RuntimeError("this BatchLoader is closed; create a new one")
        try:
            item = next(self._iterator)
        except RuntimeError as e:
            if "exited unexpectedly" not in str(e):  # torch's words for a worker that died
                raise
            raise RunError(
                f"a training loader worker died ({e}); the usual cause is the out-of-memory killer: "
                f"train with fewer --loader-workers (now {self.num_workers}; 0 builds batches in the "
                "training process)"
            ) from e
        if self._slots is None:
            return {k: v.pin_memory() for k, v in item.items()} if self.pin_memory else item
        return self._slots.take(*item, pin_memory=self.pin_memory)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        iterator, self._iterator = getattr(self, "_iterator", None), None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
