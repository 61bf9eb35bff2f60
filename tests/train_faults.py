"""Faults injected into a training run from outside: a kill after an epoch's checkpoint, an out-of-memory error in
a step; and a simulated clock that only the training steps and the network's tile batches advance. A module of its
own, light to import: distributed tests use it inside their spawned ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from autoseg.model.step import TrainStep
from autoseg.model.torch_runner import TorchTileRunner
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


def simulated_steps(monkeypatch: pytest.MonkeyPatch, seconds: list[float]) -> SimpleNamespace:
    """A clock that only the training steps advance: ``seconds`` for the first steps, then the last one each."""
    clock = SimpleNamespace(now=50.0)
    real_step = TrainStep.__call__
    steps = iter(seconds)

    def timed_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if not is_fake(next(self.network.parameters())):  # the memory check's simulation runs TrainStep too
            clock.now += next(steps, seconds[-1])
        return result

    monkeypatch.setattr(TrainStep, "__call__", timed_step)
    return clock


def simulated_passes(monkeypatch: pytest.MonkeyPatch, clock: SimpleNamespace, seconds: float) -> list[tuple]:
    """Each forward pass of a tile batch through the torch runner advances ``clock`` by ``seconds``; returns the
    shapes of the batches and whether the network was in training mode when called, in order."""
    real_call, seen = TorchTileRunner.__call__, []

    def timed_call(self, tile_batch):
        if is_fake(tile_batch):  # the memory model's simulation of the tile batch
            return real_call(self, tile_batch)
        seen.append((tuple(tile_batch.shape), self.module.training))
        out = real_call(self, tile_batch)
        clock.now += seconds
        return out

    monkeypatch.setattr(TorchTileRunner, "__call__", timed_call)
    return seen
