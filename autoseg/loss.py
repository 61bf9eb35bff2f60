"""Training loss: soft Dice + cross-entropy, optionally summed over deep-supervision outputs.

Conventions:
  logits  ``(B, C, *spatial)`` float, ``C = num_classes`` (background = channel 0), ``C >= 2``.
  target  ``(B, 1, *spatial)`` any integer dtype, values ``0 .. C-1``; ``-1`` (voxels outside the
          nonzero crop mask, written by preprocessing) counts as background.

``DiceCELoss`` returns ``CE + (1 - mean foreground Dice)``: about 0 for a perfect prediction, larger for
a worse one. With deep supervision the network returns a list of logits (full resolution first);
``downsample_targets`` makes the matching targets and ``DeepSupervisionLoss`` sums the weighted losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _check_logits_target(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.ndim < 3 or logits.shape[1] < 2:
        raise ValueError(f"logits have shape {tuple(logits.shape)}; expected (B, C, *spatial) with C >= 2 "
                         "(background plus at least one foreground class)")
    expected = (logits.shape[0], 1, *logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(f"target has shape {tuple(target.shape)}; expected {expected} to match logits "
                         f"{tuple(logits.shape)} (for deep supervision use downsample_targets)")
    if target.is_floating_point() or target.is_complex():
        raise ValueError(f"target has dtype {target.dtype}; expected an integer label map")


def soft_dice_per_class(probs: torch.Tensor, target: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """Batch soft Dice of every foreground class: ``(C - 1,)`` float32.

    ``probs`` ``(B, C, *spatial)`` class probabilities; ``target`` ``(B, 1, *spatial)`` int64, values
    ``0 .. C-1``. Sums run over the batch and all voxels at once ("batch dice"), so a class missing from
    one sample does not give that sample a Dice of 0. Dice_c = (2 sum p_c g_c + smooth) / (sum p_c + sum g_c
    + smooth). Temporaries: a bool one-hot ``(B, C, *spatial)`` and the product ``p * g`` in float32.
    """
    axes = [0, *range(2, probs.ndim)]
    with torch.no_grad():
        onehot = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter_(1, target, True)
        onehot = onehot[:, 1:]
        sum_target = onehot.sum(axes).to(probs.dtype)
    probs = probs[:, 1:]
    intersection = (probs * onehot).sum(axes)
    sum_probs = probs.sum(axes)
    return (2 * intersection + smooth) / torch.clamp(sum_probs + sum_target + smooth, min=1e-8)


class DiceCELoss(nn.Module):
    """``dice_weight * (1 - mean foreground batch Dice) + ce_weight * cross-entropy``, a scalar tensor.

    ``forward(logits (B, C, *spatial), target (B, 1, *spatial) int)``; -1 in the target is background.
    Dice is computed in float32 from the softmax of the logits (also under autocast).
    """

    def __init__(self, dice_weight: float = 1.0, ce_weight: float = 1.0, smooth: float = 1e-5) -> None:
        super().__init__()
        self.dice_weight = dice_weight
        self.ce_weight = ce_weight
        self.smooth = smooth

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_logits_target(logits, target)
        target = target.long().clamp_min(0)  # -1 (outside the nonzero mask) -> background
        logits = logits.float()
        ce = F.cross_entropy(logits, target[:, 0])
        dice = soft_dice_per_class(torch.softmax(logits, dim=1), target, self.smooth)
        return self.ce_weight * ce + self.dice_weight * (1 - dice.mean())


LOSSES: dict[str, type[nn.Module]] = {"dice_ce": DiceCELoss}


def deep_supervision_weights(num_outputs: int) -> list[float]:
    """Loss weight of each network output, full resolution first: 1, 1/2, 1/4, ..., the lowest resolution
    set to 0, normalized to sum to 1. A single output gets weight 1."""
    if num_outputs < 1:
        raise ValueError(f"num_outputs is {num_outputs}; expected >= 1")
    if num_outputs == 1:
        return [1.0]
    weights = [0.5**i for i in range(num_outputs)]
    weights[-1] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


class DeepSupervisionLoss(nn.Module):
    """Weighted sum of ``base_loss`` over deep-supervision outputs.

    ``forward(outputs, targets)``: lists of equal length, full resolution first; ``targets[i]`` has the
    spatial shape of ``outputs[i]``. Outputs with weight 0 are not evaluated at all.
    """

    def __init__(self, base_loss: nn.Module, weights: Sequence[float]) -> None:
        super().__init__()
        if len(weights) == 0 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"deep supervision weights {list(weights)} must be non-negative with a positive "
                             "sum (see deep_supervision_weights)")
        self.base_loss = base_loss
        self.weights = [float(w) for w in weights]

    def forward(self, outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        if not len(outputs) == len(targets) == len(self.weights):
            raise ValueError(f"got {len(outputs)} outputs and {len(targets)} targets for {len(self.weights)} "
                             "deep supervision weights; they must match (the network's deep_supervision "
                             "setting and the loss must agree)")
        terms = [w * self.base_loss(out, tgt)
                 for w, out, tgt in zip(self.weights, outputs, targets, strict=True) if w != 0]
        return torch.stack(terms).sum()


def downsample_targets(target: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Nearest-neighbour resize of ``target`` ``(B, 1, *spatial)`` to each shape in ``shapes``.

    Output voxel i along an axis of size ``n_in`` -> ``n_out`` takes input voxel ``floor(i * n_in / n_out)``:
    a strided view ``[::n_in // n_out]`` when the ratio is an integer (no copy), an index gather otherwise.
    Values and dtype (-1 included) are kept. Returns one tensor per shape, in order.
    """
    if target.ndim < 3 or target.shape[1] != 1:
        raise ValueError(f"target has shape {tuple(target.shape)}; expected (B, 1, *spatial)")
    in_shape = tuple(target.shape[2:])
    out = []
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(in_shape) or min(shape) < 1:
            raise ValueError(f"cannot resize a target of spatial shape {in_shape} to {shape}; expected "
                             f"{len(in_shape)} positive sizes (the spatial shape of a network output)")
        resized = target
        for axis, (n_in, n_out) in enumerate(zip(in_shape, shape, strict=True), start=2):
            if n_in == n_out:
                continue
            if n_in % n_out == 0:
                index = [slice(None)] * target.ndim
                index[axis] = slice(None, None, n_in // n_out)
                resized = resized[tuple(index)]
            else:
                positions = torch.arange(n_out, device=target.device) * n_in // n_out
                resized = resized.index_select(axis, positions)
        out.append(resized)
    return out


def compute_loss(network_output: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor,
                 loss: nn.Module) -> torch.Tensor:
    """Loss of one batch. A deep-supervision list (``loss`` a ``DeepSupervisionLoss``) gets ``target``
    downsampled to each output's spatial shape; a single tensor goes to ``loss`` (to its ``base_loss`` when
    ``loss`` is a ``DeepSupervisionLoss``, e.g. with the network's deep supervision switched off)."""
    if isinstance(network_output, torch.Tensor):
        base = loss.base_loss if isinstance(loss, DeepSupervisionLoss) else loss
        return base(network_output, target)
    if not isinstance(loss, DeepSupervisionLoss):
        raise ValueError(f"the network returned {len(network_output)} deep-supervision outputs but the loss "
                         f"is a {type(loss).__name__}; wrap it in DeepSupervisionLoss or turn deep "
                         "supervision off")
    targets = downsample_targets(target, [tuple(o.shape[2:]) for o in network_output])
    return loss(network_output, targets)
