"""Training on several processes (GPUs, nodes) with ``torch.distributed``: one process per device.

``autoseg train fold 0 --gpus N`` re-launches itself through torchrun (``torchrun_command``); torchrun
(also for multi-node runs, started by hand) gives each process its RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE, which ``context_from_environment`` turns into a ``DistributedContext``. ``process_group``
opens the group: NCCL with device ``cuda:LOCAL_RANK`` for CUDA, gloo for CPU.

How a step is shared (``Ranks``; the trainer's ``TrainStep`` calls it):

- Every rank runs its micro-batches with no communication but the loss's batch-Dice sums
  (``Ranks.reduce_sums``: one all-reduce per deep-supervision output, so the Dice of a global micro-batch
  is computed from all ranks' voxels). The gradients are averaged *after* every rank's backward
  (``average_gradients``), not inside backward as DistributedDataParallel does it.
- Why not inside backward: an out-of-memory error on one rank must make every rank degrade the same way.
  Before each collective of a step every rank all-reduces a failure flag (``check``); a rank that ran out
  of memory sends a raised flag instead (``signal_failure``) and every other rank raises
  ``PeerOutOfMemoryError`` at that same collective. With DDP's all-reduces inside backward, the other ranks
  would wait forever in a gradient bucket the failed rank never sends. The price: the gradient all-reduce
  (the parameter bytes once per step) no longer overlaps backward.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from autoseg.core.errors import InputError
from autoseg.core.workers import die_with_parent

__all__ = [
    "DistributedContext",
    "PeerOutOfMemoryError",
    "Ranks",
    "SINGLE_PROCESS",
    "all_reduce_sum",
    "backend_for",
    "process_group",
    "rank_batch",
    "torchrun_command",
]

log = logging.getLogger("autoseg.train.trainer")


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in a distributed run (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).

    ``backend``: "nccl" (CUDA) or "gloo" (CPU); ``init_method``: "env://" under torchrun (its rendezvous
    store), or e.g. "tcp://127.0.0.1:29500" when the processes are started otherwise (tests).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "gloo"
    init_method: str = "env://"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise InputError(
                f"rank {self.rank} / local rank {self.local_rank} outside world size {self.world_size}"
                f" / local world size {self.local_world_size}; launch through torchrun"
            )
        if self.backend not in ("nccl", "gloo"):
            raise InputError(f"backend {self.backend!r}: expected 'nccl' (CUDA) or 'gloo' (CPU)")

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that writes logs, metrics, checkpoints and runs the final validation."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def device(self, device: str) -> str:
        """This process's device: ``cuda:LOCAL_RANK`` for "cuda" in a distributed run, else ``device``."""
        return f"cuda:{self.local_rank}" if self.is_distributed and device == "cuda" else device


SINGLE_PROCESS = DistributedContext()


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_batch(batch_size: int, accumulation_steps: int, world_size: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) of each of ``world_size`` ranks for a plan of ``batch_size`` x
    ``accumulation_steps`` samples per optimizer step (the global batch G the planner chose for one device).

    Each rank takes ``ceil(G / world_size)`` samples per step (exactly G / N when it divides: the planned
    global batch is kept), as the largest micro-batch <= the planned one that divides that share (so no
    rank needs more memory than planned), accumulating the rest. The global batch is
    ``world_size * micro-batch * accumulation``: G when N divides G, else the next multiple of N.
    """
    if min(batch_size, accumulation_steps, world_size) < 1:
        raise InputError(
            f"batch {batch_size} x {accumulation_steps} accumulation on {world_size} ranks: all must be >= 1"
        )
    share = -(-batch_size * accumulation_steps // world_size)
    micro = max(b for b in range(1, min(batch_size, share) + 1) if share % b == 0)
    return micro, share // micro


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node N -m autoseg ARGV``: N processes on
    this node (``--standalone``: a local rendezvous on a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "autoseg",
        *argv,
    ]


def context_from_environment(environ: Mapping[str, str], device: str) -> DistributedContext:
    """This process's place in a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); a single
    process when WORLD_SIZE is not set."""
    if "WORLD_SIZE" not in environ:
        return SINGLE_PROCESS
    try:
        context = DistributedContext(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            local_world_size=int(environ["LOCAL_WORLD_SIZE"]),
            backend=backend_for(device),
        )
    except (KeyError, ValueError) as e:
        raise InputError(
            f"cannot read the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): "
            f"{e}; launch with torchrun or `autoseg train ... --gpus N`"
        ) from e
    if context.is_distributed and context.backend == "nccl":
        if context.local_rank >= torch.cuda.device_count():
            raise InputError(
                f"local rank {context.local_rank} has no CUDA device ({torch.cuda.device_count()} "
                "visible); start at most one process per GPU (--nproc_per_node)"
            )
    return context


def run_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Run ``autoseg ARGV`` in ``nproc`` processes under torchrun (``torchrun_command``); its exit status.
    torchrun gets SIGTERM if this process dies (it then stops its ranks), so a killed autoseg leaves none."""
    command = torchrun_command(nproc, argv)
    print(f"launching {nproc} processes: {shlex.join(command)}", flush=True)
    stop_with_us = functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
    return subprocess.run(command, preexec_fn=stop_with_us).returncode


@contextmanager
def process_group(context: DistributedContext) -> Iterator[None]:
    """Open the default process group for the run's duration (nothing for a single process)."""
    if not context.is_distributed:
        yield
        return
    if context.backend == "nccl":
        torch.cuda.set_device(context.local_rank)
    dist.init_process_group(
        context.backend, init_method=context.init_method, rank=context.rank, world_size=context.world_size
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def end_rank_process(code: int) -> NoReturn:
    """A torchrun rank's end once its work is written (files closed, loaders shut, the process group destroyed):
    exit without the interpreter's teardown. There, gloo's threads and the Python objects their finished work holds
    abort the process now and then (SIGABRT, "terminate called without an active exception", seen in runs of
    tests/model/test_distributed.py; pytorch/pytorch#179291 describes the same teardown), and torchrun reports a
    finished run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory in this step: this rank drops the step and degrades with it."""


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward multiplies by the world size instead of all-reducing (see ``all_reduce_sum``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.world_size, None


def all_reduce_sum(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Differentiable sum of ``tensor`` over all ranks (any shape; the same on every rank).

    Backward: the gradient of the sum over ranks of what each rank computes from the total S, with respect to
    this rank's ``tensor`` s_r, is ``sum_q dL_q/dS``. Every rank applies the same function to the same S (the
    loss's Dice ratio), so that is ``world_size * dL_r/dS``, computed here without a collective: backward
    needs no communication (see the module docstring). After gradients are averaged over ranks this gives
    exactly the gradient of the single-process loss on the global batch.
    """
    return _AllReduceSum.apply(tensor, world_size)


class Ranks:
    """The collectives of a training run; for a single process every method is the identity or a no-op."""

    def __init__(self, context: DistributedContext, device: torch.device) -> None:
        self.context, self.device = context, device
        self._flag = torch.zeros(1, device=device)  # allocated up front: a rank out of memory can still signal
        self.reducing = False  # ``reduce_sums`` sums over ranks only inside a training step (``step_collectives``)

    @property
    def is_main(self) -> bool:
        return self.context.is_main

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def _all_reduce_flag(self, failed: bool) -> bool:
        self._flag.fill_(float(failed))
        dist.all_reduce(self._flag)
        return bool(self._flag.item() > 0)  # syncs with the device

    def check(self) -> None:
        """Raise ``PeerOutOfMemoryError`` if another rank signalled a failure at this collective."""
        if self.context.is_distributed and self._all_reduce_flag(False):
            raise PeerOutOfMemoryError("another rank ran out of memory in this step; degrading with it")

    def signal_failure(self) -> None:
        """Tell the other ranks (waiting in their next ``check``) that this rank ran out of memory."""
        if self.context.is_distributed:
            self._all_reduce_flag(True)

    @contextmanager
    def step_collectives(self) -> Iterator[None]:
        """Inside: ``reduce_sums`` sums over ranks (the training step); outside (validation on rank 0) it is local."""
        self.reducing = True
        try:
            yield
        finally:
            self.reducing = False

    def reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """The loss's Dice sums of the global micro-batch: ``check`` then a differentiable all-reduce."""
        if not (self.context.is_distributed and self.reducing):
            return sums
        self.check()
        return all_reduce_sum(sums, self.world_size)

    def average_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Mean of every gradient over ranks, in place (no extra buffer). Parameters without a gradient (a
        deep-supervision head of weight 0) are skipped; they are the same on every rank."""
        if not self.context.is_distributed:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        for work in [dist.all_reduce(g, async_op=True) for g in grads]:
            work.wait()
        for g in grads:
            g.div_(self.world_size)

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers to every rank (once, at the start)."""
        if self.context.is_distributed:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (decisions such as the number of epochs are rank 0's)."""
        if not self.context.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def mean(self, value: float) -> float:
        """The mean of ``value`` over ranks (e.g. the epoch's training loss)."""
        if not self.context.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size
