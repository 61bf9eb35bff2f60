"""What the memory check measures with: ``CudaProbe`` (the CUDA caching allocator's peak statistics and the
device's used memory) and ``CpuProbe`` (one step's tensors tracked as they are allocated, and the process's peak
RSS over the others). A ``memory_check.MemoryObserver`` calls a probe's ``start`` before the first watched step,
``run`` for each of them and ``finish`` after the last; ``finish`` returns the measured figures, by name, that
``memory_check.compare`` holds against the prediction.

On CPU, step ``TRACKED_STEP`` (the second: the first that starts with optimizer state, as the simulated step does)
runs under ``StorageTracker``, with the parameters, gradients, optimizer state and the batches it draws counted
as they enter. The peak RSS is read over the other steps (VmHWM after ``reset_peak_rss``, reset again after the
tracked step): the tracked step's own Python records are no training step's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.memory.tracker import StorageTracker
from autoseg.model.step import TrainStep

__all__ = ["TRACKED_STEP", "CpuProbe", "CudaProbe", "Probe"]

TRACKED_STEP = 1  # on CPU, this step (0-based) runs under StorageTracker


class Probe(Protocol):
    """What a ``MemoryObserver`` measures with: ``start`` before the first step, ``run`` each step, ``finish``."""

    def start(self, step: TrainStep) -> None: ...
    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any: ...
    def finish(self) -> dict[str, int]: ...


class CudaProbe:
    """Peak statistics of the CUDA caching allocator and the device's used memory. ``cuda``: ``torch.cuda`` or a
    stand-in with the same five functions (tests inject one; there is no GPU to test on)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device, self.cuda = device, torch.cuda if cuda is None else cuda

    def start(self, step: TrainStep) -> None:
        self.cuda.synchronize(self.device)
        self.cuda.reset_peak_memory_stats(self.device)

    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any:
        return step(batches)

    def finish(self) -> dict[str, int]:
        self.cuda.synchronize(self.device)  # the steps' kernels have run
        free, total = self.cuda.mem_get_info(self.device)
        return {
            "max_memory_allocated": int(self.cuda.max_memory_allocated(self.device)),
            "max_memory_reserved": int(self.cuda.max_memory_reserved(self.device)),
            "device_used": int(total - free),
            "device_total": int(total),
        }


class _Counted:
    """The step's batches, each counted by ``tracker`` as it is handed over (the loader's own work runs untracked)."""

    def __init__(self, batches: Iterator, tracker: StorageTracker) -> None:
        self.batches, self.tracker = batches, tracker

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self.tracker.paused = True
        try:
            batch = next(self.batches)
        finally:
            self.tracker.paused = False
        self.tracker.count(batch.values())
        return batch


class CpuProbe:
    """Peak RSS over the steps and the tracked tensor peak of step ``TRACKED_STEP`` (see the module docstring).
    ``peak_rss``: where the peak RSS is read (None: ``peak_rss_bytes``; tests inject a stand-in)."""

    def __init__(self, peak_rss: Callable[[], int | None] | None = None) -> None:
        self.peak_rss = peak_rss
        self.measured: dict[str, int] = {}

    def start(self, step: TrainStep) -> None:
        self.measured["baseline_tensor_bytes"] = _storage_bytes(_state_tensors(step))
        self.measured["baseline_rss"] = process_rss_bytes()
        reset_peak_rss()

    def run(self, step: TrainStep, batches: Iterator, index: int) -> Any:
        if index != TRACKED_STEP:
            return step(batches)
        self.measured["peak_rss"] = self._read_peak()  # so far: the tracked step's Python records are no training's
        tracker = StorageTracker(cpu_conv_scratch=True)  # as the CPU simulation; costs one step's Python dispatch
        tracker.count(_state_tensors(step))
        with tracker:
            out = step(_Counted(batches, tracker))
        self.measured["tracked_peak"] = tracker.peak_bytes
        del tracker
        reset_peak_rss()
        return out

    def finish(self) -> dict[str, int]:
        self.measured["peak_rss"] = max(self.measured.get("peak_rss", 0), self._read_peak())
        return dict(self.measured)

    def _read_peak(self) -> int:
        return int((self.peak_rss or peak_rss_bytes)() or process_rss_bytes())


def _state_tensors(step: TrainStep) -> list[torch.Tensor]:
    """What a step starts with: parameters, their gradients (from the previous step) and the optimizer state."""
    params = list(step.network.parameters())
    state = [v for s in step.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + [p.grad for p in params if p.grad is not None] + state


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
