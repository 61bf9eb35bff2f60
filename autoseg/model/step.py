"""One optimizer step of the trainer (``TrainStep``), built from the plan, and the per-epoch pseudo-Dice.

``TrainStep`` runs ``accumulation_steps`` micro-batches (autocast on CUDA), then, across ranks in a
distributed run (``autoseg.model.distributed.Ranks``), averages the gradients, clips them and steps SGD.
``validate_patches`` measures the loss and pseudo-Dice on un-augmented validation patches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from autoseg.data.loader import BatchLoader
from autoseg.dataset.labels import LabelScheme
from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext, PeerOutOfMemoryError, Ranks
from autoseg.model.loss import compute_loss, training_loss
from autoseg.model.network import build_network
from autoseg.plan.plans import ConfigurationPlan

if TYPE_CHECKING:
    from autoseg.train.trainer import RunConfig

__all__ = ["TrainStep", "distribute", "make_step", "pseudo_dice_counts", "validate_patches"]


def pseudo_dice_counts(logits: torch.Tensor, target: torch.Tensor, scheme: LabelScheme) -> np.ndarray:
    """(3, F) true positive, false positive, false negative voxel counts per foreground class (argmax of
    ``logits`` (B, C, *spatial)) or region (logit > 0, i.e. sigmoid > 0.5); ignore voxels are not counted."""
    tgt = scheme.target_to_regions(target)  # B x F x spatial bool
    if scheme.has_regions:
        pred = logits > 0
    else:
        channels = torch.tensor(scheme.foreground_channels, device=logits.device)
        pred = logits.argmax(1, keepdim=True) == channels.view(1, -1, *[1] * (logits.ndim - 2))
    valid = scheme.valid_mask(target)
    if valid is not None:
        pred &= valid
    axes = [0, *range(2, logits.ndim)]
    counts = torch.stack([(pred & tgt).sum(axes), (pred & ~tgt).sum(axes), (~pred & tgt).sum(axes)])
    return counts.cpu().numpy().astype(np.float64)  # syncs


@dataclass
class TrainStep:
    """What one optimizer step needs (built once per run)."""

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: torch.nn.Module
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype on CUDA, None for fp32
    accumulation_steps: int
    grad_clip: float
    inject_oom: bool = False  # testing aid: the next micro-batch raises torch.OutOfMemoryError
    ranks: Ranks | None = None  # the collectives of a distributed run (None: a single process)

    def __post_init__(self) -> None:
        if self.ranks is None:
            self.ranks = Ranks(SINGLE_PROCESS, self.device)

    def __call__(self, loader: BatchLoader) -> tuple[float, float]:
        """One optimizer step over ``accumulation_steps`` micro-batches; returns (loss, seconds waiting for data).
        Distributed: gradients are averaged over ranks once every rank got through its micro-batches; an
        out-of-memory error here is signalled to the other ranks, which then raise ``PeerOutOfMemoryError``."""
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with self.ranks.step_collectives():
                step_loss, wait = self._micro_batches(loader)
                self.ranks.check()  # every rank's micro-batches fit
        except torch.OutOfMemoryError as e:
            if not isinstance(e, PeerOutOfMemoryError):
                self.ranks.signal_failure()
            raise
        self.ranks.average_gradients(self.network.parameters())  # parameter bytes, once per step
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return step_loss, wait

    def _micro_batches(self, loader: BatchLoader) -> tuple[float, float]:
        """Forward and backward of ``accumulation_steps`` micro-batches (gradients accumulate)."""
        step_loss, wait = 0.0, 0.0
        for _ in range(self.accumulation_steps):
            tw = time.perf_counter()
            batch = next(loader)
            wait += time.perf_counter() - tw
            x = batch["data"].to(self.device, non_blocking=True)
            y = batch["target"].to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                enabled=self.amp_dtype is not None):
                loss = compute_loss(self.network(x), y, self.loss_fn) / self.accumulation_steps
            if self.inject_oom:
                self.inject_oom = False
                raise torch.OutOfMemoryError("CUDA out of memory (injected by RunConfig.inject_oom_at_step)")
            self.scaler.scale(loss).backward()
            step_loss += loss.item()  # syncs with the device
        return step_loss, wait


def make_step(config: ConfigurationPlan, run: RunConfig, scheme: LabelScheme) -> TrainStep:
    device = torch.device(run.device)
    network = build_network(config.network, checkpointing=config.checkpointing).to(device)
    amp = device.type == "cuda" and config.precision in ("fp16", "bf16")
    amp_dtype = (torch.float16 if config.precision == "fp16" else torch.bfloat16) if amp else None
    return TrainStep(
        network=network,
        optimizer=torch.optim.SGD(network.parameters(), lr=run.initial_lr, momentum=run.momentum, nesterov=True,
                                  weight_decay=run.weight_decay),
        scaler=torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16),
        loss_fn=training_loss(scheme, config.network.num_stages - 1),
        device=device, amp_dtype=amp_dtype, accumulation_steps=config.accumulation_steps, grad_clip=run.grad_clip,
    )


def distribute(step: TrainStep, distributed: DistributedContext) -> None:
    """Give the step its rank's collectives: the loss's batch-Dice sums are summed over ranks before the Dice
    ratio (the single-process loss of the global micro-batch; the trainer's loss is a ``DeepSupervisionLoss``
    around a Dice loss), and every rank starts from rank 0's weights."""
    step.ranks = Ranks(distributed, step.device)
    if distributed.is_distributed:
        step.loss_fn.base_loss.reduce_sums = step.ranks.reduce_sums
    step.ranks.broadcast_module(step.network)


@torch.no_grad()
def validate_patches(network, loader: BatchLoader, loss_fn, run: RunConfig, device,
              scheme: LabelScheme) -> tuple[float, np.ndarray]:
    """Mean loss and pseudo-Dice per foreground class (or region) over ``val_iterations`` un-augmented patches."""
    network.eval()
    counts = np.zeros((3, len(scheme.names)))
    losses = []
    for _ in range(run.val_iterations):
        batch = next(loader)
        x, y = batch["data"].to(device), batch["target"].to(device)
        out = network(x)
        losses.append(compute_loss(out, y, loss_fn).item())
        counts += pseudo_dice_counts(out[0] if isinstance(out, list) else out, y, scheme)
    tp, fp, fn = counts
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = 2 * tp / (2 * tp + fp + fn)
    return float(np.mean(losses)), dice
