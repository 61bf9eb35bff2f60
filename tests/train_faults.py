"""Faults injected into a training run from outside: a kill after an epoch's checkpoint, an out-of-memory error in
a step. A module of its own, light to import: distributed tests use it inside their spawned ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from autoseg.model.step import TrainStep
from autoseg.train.run_state import TrainingRun


class Killed(BaseException):
    """A simulated kill: a ``BaseException``, as ``KeyboardInterrupt``, so nothing in the trainer handles it."""


@contextmanager
def killed_after_epochs(epochs: int) -> Iterator[None]:
    """The block's training run dies right after its ``epochs``-th checkpoint_latest.pt (counted from the epoch it
    starts at), on every rank: as a process killed then, it writes nothing more. The block must raise ``Killed``."""
    real_save, saved = TrainingRun.save, itertools.count(1)

    def save_then_die(self: TrainingRun, which: str) -> None:
        real_save(self, which)
        if which == "latest" and next(saved) == epochs:
            raise Killed(f"after epoch {self.progress.epoch}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainingRun, "save", save_then_die)
        with pytest.raises(Killed):
            yield


@contextmanager
def out_of_memory_at_step(index: int) -> Iterator[None]:
    """The block's ``index``-th (0-based) real optimizer step of this process raises ``torch.OutOfMemoryError``
    once, after drawing its first micro-batch, inside the step's collectives (so that in a distributed run the other
    ranks learn of it, as of a real one). The memory model's simulated steps (fake tensors) are not counted."""
    real_micro_batches, steps = TrainStep._micro_batches, itertools.count()

    def micro_batches(self: TrainStep, batches: Iterator) -> tuple[torch.Tensor, float]:
        if not is_fake(next(self.network.parameters())) and next(steps) == index:
            next(batches)
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real_micro_batches(self, batches)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainStep, "_micro_batches", micro_batches)
        yield
