"""THE training step: one optimizer step of the plan's network, and nothing else runs a backward pass.

``autoseg train`` runs it on loader batches; the memory model (``autoseg.memory.training``) runs the same
``TrainStep`` on synthetic batches under ``FakeTensorMode`` (prediction) or on real CPU tensors
(measurement); the CPU throughput calibration (``autoseg.plan.throughput``) times it. A change here shows up
in all three.

One step: ``zero_grad(set_to_none=True)``; ``accumulation_steps`` micro-batches, each ``(B, C, *patch)``
float32 with an integer target ``(B, 1, *patch)``, ``compute_loss(network(x), y) / accumulation_steps``
under autocast of the precision, ``backward()`` (scaled by a ``GradScaler`` for fp16 on CUDA); then, across
ranks in a distributed run (``autoseg.model.distributed.Ranks``), the gradients averaged; unscale, clip the
gradient norm, the optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from autoseg.core.precision import autocast_dtype
from autoseg.dataset.labels import LabelScheme
from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext, PeerOutOfMemoryError, Ranks
from autoseg.model.loss import compute_loss, training_loss
from autoseg.model.network import build_network
from autoseg.model.optimizer import OPTIMIZERS, OptimizerSettings
from autoseg.model.topology import NetworkTopology

__all__ = ["TrainStep", "build_step", "distribute", "synthetic_batches"]

Batch = dict[str, torch.Tensor]  # "data" (B, C, *patch) float32, "target" (B, 1, *patch) int8/int16/int64


@dataclass
class TrainStep:
    """What one optimizer step needs (built once per run by ``build_step``).

    ``trace``: called with the phase about to start (``step``, then per micro-batch ``batch``, ``forward``,
    ``loss``, ``backward``; then ``optimizer`` and ``end``); the memory model records a timeline by it."""

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: torch.nn.Module
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype, None for fp32
    accumulation_steps: int
    grad_clip: float
    ranks: Ranks | None = None  # the collectives of a distributed run (None: a single process)
    trace: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.ranks is None:
            self.ranks = Ranks(SINGLE_PROCESS, self.device)

    def _phase(self, name: str) -> None:
        if self.trace is not None:
            self.trace(name)

    def __call__(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, float]:
        """One optimizer step over ``accumulation_steps`` micro-batches drawn from ``batches``; returns (the step's
        loss as a 0-d tensor on the device: ``.item()`` syncs, seconds waiting for data).
        Distributed: gradients are averaged over ranks once every rank got through its micro-batches; an
        out-of-memory error here is signalled to the other ranks, which then raise ``PeerOutOfMemoryError``."""
        self._phase("step")
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with self.ranks.step_collectives():
                step_loss, wait = self._micro_batches(batches)
                self.ranks.check()  # every rank's micro-batches fit
        except torch.OutOfMemoryError as e:
            if not isinstance(e, PeerOutOfMemoryError):
                self.ranks.signal_failure()
            raise
        self._phase("optimizer")
        self.ranks.average_gradients(self.network.parameters())  # parameter bytes, once per step
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._phase("end")
        return step_loss, wait

    def _micro_batches(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, float]:
        """Forward and backward of ``accumulation_steps`` micro-batches (gradients accumulate)."""
        step_loss, wait = None, 0.0
        for _ in range(self.accumulation_steps):
            self._phase("batch")
            tw = time.perf_counter()
            batch = next(batches)
            wait += time.perf_counter() - tw
            x = batch["data"].to(self.device, non_blocking=True)
            y = batch["target"].to(self.device, non_blocking=True)
            del batch
            self._phase("forward")
            with torch.autocast(
                self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
            ):
                output = self.network(x)
                self._phase("loss")
                loss = compute_loss(output, y, self.loss_fn) / self.accumulation_steps
                del output  # the logits live on only through the loss's graph
            self._phase("backward")
            self.scaler.scale(loss).backward()
            loss = loss.detach()
            step_loss = loss if step_loss is None else step_loss + loss
        return step_loss, wait


def build_step(
    topology: NetworkTopology,
    scheme: LabelScheme,
    *,
    precision: str = "fp32",
    checkpointing: bool = False,
    accumulation_steps: int = 1,
    device: str | torch.device = "cpu",
    optimizer: OptimizerSettings = OPTIMIZERS["sgd"],
) -> TrainStep:
    """The training step of a configuration: its network (the ``architecture`` the topology names), Dice + CE (or
    Dice + BCE for regions) with deep supervision, ``precision``'s autocast (fp16 with a GradScaler on CUDA),
    ``optimizer``. A fresh network: build it inside ``FakeTensorMode`` to simulate without memory."""
    device = torch.device(device)
    amp_dtype = autocast_dtype(precision)
    network = build_network(topology, checkpointing=checkpointing)
    if device.type != "cpu":  # (a module cannot be moved inside FakeTensorMode, where the memory model builds it)
        network = network.to(device)
    return TrainStep(
        network=network,
        optimizer=optimizer.build(list(network.parameters())),
        scaler=torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16 and device.type == "cuda"),
        loss_fn=training_loss(scheme, topology.num_stages - 1),
        device=device,
        amp_dtype=amp_dtype,
        accumulation_steps=accumulation_steps,
        grad_clip=optimizer.grad_clip,
    )


def synthetic_batches(
    topology: NetworkTopology,
    scheme: LabelScheme,
    batch_size: int,
    patch_size: tuple[int, ...],
    generator: torch.Generator | None = None,
    target_dtype: torch.dtype = torch.int8,
) -> Iterator[Batch]:
    """Endless fresh batches as the loader hands them over: ``data`` (B, C, *patch) float32 normal noise, ``target``
    (B, 1, *patch) label values (the ignore label included) in the loader's int8 (``generator`` None under
    ``FakeTensorMode``)."""
    while True:
        yield {
            "data": torch.randn((batch_size, topology.in_channels, *patch_size), generator=generator),
            "target": torch.randint(
                0, scheme.num_label_values, (batch_size, 1, *patch_size), generator=generator, dtype=target_dtype
            ),
        }


def distribute(step: TrainStep, distributed: DistributedContext) -> None:
    """Give the step its rank's collectives: the loss's batch-Dice sums are summed over ranks before the Dice
    ratio (the single-process loss of the global micro-batch; the trainer's loss is a ``DeepSupervisionLoss``
    around a Dice loss), and every rank starts from rank 0's weights."""
    step.ranks = Ranks(distributed, step.device)
    if distributed.is_distributed:
        step.loss_fn.base_loss.reduce_sums = step.ranks.reduce_sums
    step.ranks.broadcast_module(step.network)
