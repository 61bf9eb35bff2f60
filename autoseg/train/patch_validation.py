"""The per-epoch check on un-augmented validation patches: loss and pseudo-Dice per foreground class or region."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from autoseg.dataset.labels import LabelScheme
from autoseg.model.loss import compute_loss


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


@torch.no_grad()
def validate_patches(
    network: torch.nn.Module,
    loader: Iterator[dict[str, torch.Tensor]],
    loss_fn: torch.nn.Module,
    iterations: int,
    device: torch.device,
    scheme: LabelScheme,
) -> tuple[float, np.ndarray]:
    """Mean loss and pseudo-Dice per foreground class (or region) over ``iterations`` un-augmented patches."""
    network.eval()
    counts = np.zeros((3, len(scheme.names)))
    losses = []
    for _ in range(iterations):
        batch = next(loader)
        x, y = batch["data"].to(device), batch["target"].to(device)
        out = network(x)
        losses.append(compute_loss(out, y, loss_fn).item())
        counts += pseudo_dice_counts(out[0] if isinstance(out, list) else out, y, scheme)
    tp, fp, fn = counts
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = 2 * tp / (2 * tp + fp + fn)
    return float(np.mean(losses)), dice
