"""Training losses: soft Dice + cross-entropy (classes) or + binary cross-entropy (regions), summed over
deep-supervision outputs.

Conventions:
  logits  ``(B, C, *spatial)`` float: ``C = num_outputs`` (background = channel 0, ``C >= 2``) for
          ``DiceCELoss``, ``C = `` number of regions for ``RegionDiceBCELoss``.
  target  ``(B, 1, *spatial)`` any integer dtype, label values; ``-1`` (voxels outside the nonzero crop
          mask, written by preprocessing) counts as background. With an ignore label (``ignore_value``)
          its voxels are left out of every sum: they give no loss and no gradient.

``DiceCELoss`` returns ``CE + (1 - mean foreground Dice)``: about 0 for a perfect prediction, larger for
a worse one. ``RegionDiceBCELoss`` returns ``BCE + (1 - mean region Dice)`` on sigmoid outputs. With deep
supervision the network returns a list of logits (full resolution first); ``downsample_targets`` makes the
matching label maps (nearest: the ignore value survives) and ``DeepSupervisionLoss`` sums the weighted
losses. ``training_loss(scheme, outputs)`` builds the trainer's loss for a dataset's labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from autoseg.dataset.labels import LabelScheme


def _check_logits_target(logits: torch.Tensor, target: torch.Tensor, min_channels: int = 2) -> None:
    if logits.ndim < 3 or logits.shape[1] < min_channels:
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}; expected (B, C, *spatial) with C >= 2 "
            "(background plus at least one foreground class)"
        )
    expected = (logits.shape[0], 1, *logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"target has shape {tuple(target.shape)}; expected {expected} to match logits "
            f"{tuple(logits.shape)} (for deep supervision use downsample_targets)"
        )
    if target.is_floating_point() or target.is_complex():
        raise ValueError(f"target has dtype {target.dtype}; expected an integer label map")


def batch_soft_dice(
    probs: torch.Tensor,
    onehot: torch.Tensor,
    smooth: float = 1e-5,
    valid: torch.Tensor | None = None,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Batch soft Dice of every channel: ``(C,)`` float32.

    ``probs`` ``(B, C, *spatial)`` probabilities; ``onehot`` bool ``(B, C, *spatial)`` targets; ``valid``
    bool ``(B, 1, *spatial)`` or None: voxels outside it (the ignore label) are left out of every sum. Sums
    run over the batch and all voxels at once ("batch dice"), so a class missing from one sample does not give
    that sample a Dice of 0. Dice_c = (2 sum p_c g_c + smooth) / (sum p_c + sum g_c + smooth).
    ``reduce_sums``: applied to the stacked ``(3, C)`` sums (p g, p, g) before the ratio; a distributed run
    sums them over its ranks (``autoseg.model.distributed.Ranks.reduce_sums``): the Dice of the global batch.
    """
    axes = [0, *range(2, probs.ndim)]
    if valid is not None:
        onehot = onehot & valid  # B x C x spatial bool
        probs = probs * valid  # B x C x spatial fp32: masked probabilities carry no gradient
    with torch.no_grad():
        sum_target = onehot.sum(axes).to(probs.dtype)
    intersection = (probs * onehot).sum(axes)
    sum_probs = probs.sum(axes)
    if reduce_sums is not None:
        intersection, sum_probs, sum_target = reduce_sums(torch.stack([intersection, sum_probs, sum_target]))
    return (2 * intersection + smooth) / torch.clamp(sum_probs + sum_target + smooth, min=1e-8)


def labelled_mean_scale(
    valid: torch.Tensor, per_voxel: int = 1, reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The factor that turns a sum over this micro-batch's labelled voxels (``valid``, ``per_voxel`` terms
    each) into its share of the mean over the global micro-batch: ``ranks / labelled voxels of all ranks``
    (1 / local count for a single process). Averaging the ranks' gradients then gives the gradient of the
    global mean, however unevenly the ignore label falls on the ranks. 0-d float32; a count of 0 -> 1."""
    counts = torch.stack([valid.sum().float() * per_voxel, torch.ones((), device=valid.device)])
    if reduce_sums is not None:
        counts = reduce_sums(counts)  # (labelled terms, ranks) summed over the ranks
    return counts[1] / counts[0].clamp_min(1)


def soft_dice_per_class(
    probs: torch.Tensor,
    target: torch.Tensor,
    smooth: float = 1e-5,
    valid: torch.Tensor | None = None,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Batch soft Dice of every foreground class: ``(C - 1,)`` float32 (see ``batch_soft_dice``).

    ``probs`` ``(B, C, *spatial)`` class probabilities; ``target`` ``(B, 1, *spatial)`` int64, values
    ``0 .. C-1``. Temporaries: a bool one-hot ``(B, C, *spatial)`` and the product ``p * g`` in float32.
    """
    with torch.no_grad():
        onehot = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter_(1, target, True)
    return batch_soft_dice(probs[:, 1:], onehot[:, 1:], smooth, valid, reduce_sums)


class DiceCELoss(nn.Module):
    """``dice_weight * (1 - mean foreground batch Dice) + ce_weight * cross-entropy``, a scalar tensor.

    ``forward(logits (B, C, *spatial), target (B, 1, *spatial) int)``; -1 in the target is background.
    Dice is computed in float32 from the softmax of the logits (also under autocast). ``ignore_value``: the
    ignore label (> every class); its voxels are excluded from CE (``ignore_index``, mean over the others:
    over every rank's, ``labelled_mean_scale``) and from all Dice sums. ``reduce_sums``: see
    ``batch_soft_dice``.
    """

    def __init__(
        self,
        dice_weight: float = 1.0,
        ce_weight: float = 1.0,
        smooth: float = 1e-5,
        ignore_value: int | None = None,
        reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.dice_weight = dice_weight
        self.ce_weight = ce_weight
        self.smooth = smooth
        self.ignore_value = ignore_value
        self.reduce_sums = reduce_sums

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_logits_target(logits, target)
        target = target.long().clamp_min(0)  # -1 (outside the nonzero mask) -> background
        logits = logits.float()
        if self.ignore_value is None:
            ce = F.cross_entropy(logits, target[:, 0])
            dice = soft_dice_per_class(torch.softmax(logits, dim=1), target, self.smooth, reduce_sums=self.reduce_sums)
        else:
            valid = target != self.ignore_value  # B x 1 x spatial bool
            # Mean over the labelled voxels (of every rank); 0 (not NaN) when a patch holds only ignored ones.
            ce = F.cross_entropy(logits, target[:, 0], ignore_index=self.ignore_value, reduction="sum")
            ce = ce * labelled_mean_scale(valid, 1, self.reduce_sums)
            labelled = target * valid  # ignore -> 0 for the one-hot; masked out of the Dice by ``valid``
            dice = soft_dice_per_class(torch.softmax(logits, dim=1), labelled, self.smooth, valid, self.reduce_sums)
        return self.ce_weight * ce + self.dice_weight * (1 - dice.mean())


class RegionDiceBCELoss(nn.Module):
    """``dice_weight * (1 - mean region batch Dice) + bce_weight * binary cross-entropy``, a scalar tensor.

    ``forward(logits (B, R, *spatial), target (B, 1, *spatial) int label values)``: region ``r``'s target is
    ``scheme.target_to_regions(target)[:, r]`` (the voxel holds one of its values). BCE with logits per
    voxel and region, averaged; soft Dice on the sigmoid, every region counted. Ignore voxels (the scheme's
    ignore label) are left out of both. Computed in float32 (also under autocast). ``reduce_sums``: see
    ``batch_soft_dice``.
    """

    def __init__(
        self,
        scheme: LabelScheme,
        dice_weight: float = 1.0,
        bce_weight: float = 1.0,
        smooth: float = 1e-5,
        reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if not scheme.has_regions:
            raise ValueError("RegionDiceBCELoss needs region-based labels; use DiceCELoss for plain classes")
        self.scheme = scheme
        self.dice_weight = dice_weight
        self.bce_weight = bce_weight
        self.smooth = smooth
        self.reduce_sums = reduce_sums

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        regions = self.scheme.num_outputs
        if logits.ndim < 3 or logits.shape[1] != regions:
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}; expected (B, {regions}, *spatial), one "
                f"channel per region of {self.scheme.names}"
            )
        _check_logits_target(logits, target, min_channels=1)
        logits = logits.float()
        onehot = self.scheme.target_to_regions(target)  # B x R x spatial bool
        valid = self.scheme.valid_mask(target)  # B x 1 x spatial bool, or None
        bce = F.binary_cross_entropy_with_logits(
            logits, onehot.float(), reduction="none" if valid is not None else "mean"
        )  # B x R x spatial fp32 with an ignore label
        if valid is not None:
            bce = (bce * valid).sum() * labelled_mean_scale(valid, regions, self.reduce_sums)
        dice = batch_soft_dice(torch.sigmoid(logits), onehot, self.smooth, valid, self.reduce_sums)
        return self.bce_weight * bce + self.dice_weight * (1 - dice.mean())


LOSSES: dict[str, type[nn.Module]] = {"dice_ce": DiceCELoss, "dice_bce_regions": RegionDiceBCELoss}


def deep_supervision_weights(num_heads: int) -> list[float]:
    """Loss weight of each network output, full resolution first: 1, 1/2, 1/4, ..., the lowest resolution
    set to 0, normalized to sum to 1. A single output gets weight 1."""
    if num_heads < 1:
        raise ValueError(f"num_heads is {num_heads}; expected >= 1")
    if num_heads == 1:
        return [1.0]
    weights = [0.5**i for i in range(num_heads)]
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
            raise ValueError(
                f"deep supervision weights {list(weights)} must be non-negative with a positive "
                "sum (see deep_supervision_weights)"
            )
        self.base_loss = base_loss
        self.weights = [float(w) for w in weights]

    def forward(self, outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        if not len(outputs) == len(targets) == len(self.weights):
            raise ValueError(
                f"got {len(outputs)} outputs and {len(targets)} targets for {len(self.weights)} "
                "deep supervision weights; they must match (the network's deep_supervision "
                "setting and the loss must agree)"
            )
        terms = [
            w * self.base_loss(out, tgt) for w, out, tgt in zip(self.weights, outputs, targets, strict=True) if w != 0
        ]
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
            raise ValueError(
                f"cannot resize a target of spatial shape {in_shape} to {shape}; expected "
                f"{len(in_shape)} positive sizes (the spatial shape of a network output)"
            )
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


def compute_loss(
    network_output: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor, loss: nn.Module
) -> torch.Tensor:
    """Loss of one batch. A deep-supervision list (``loss`` a ``DeepSupervisionLoss``) gets ``target``
    downsampled to each output's spatial shape; a single tensor goes to ``loss`` (to its ``base_loss`` when
    ``loss`` is a ``DeepSupervisionLoss``, e.g. with the network's deep supervision switched off)."""
    if isinstance(network_output, torch.Tensor):
        base = loss.base_loss if isinstance(loss, DeepSupervisionLoss) else loss
        return base(network_output, target)
    if not isinstance(loss, DeepSupervisionLoss):
        raise ValueError(
            f"the network returned {len(network_output)} deep-supervision outputs but the loss "
            f"is a {type(loss).__name__}; wrap it in DeepSupervisionLoss or turn deep "
            "supervision off"
        )
    targets = downsample_targets(target, [tuple(o.shape[2:]) for o in network_output])
    return loss(network_output, targets)


def training_loss(scheme: LabelScheme, num_heads: int) -> DeepSupervisionLoss:
    """The trainer's loss for ``scheme``: Dice + CE (classes) or Dice + BCE (regions), ignore label masked,
    weighted over ``num_heads`` deep-supervision outputs (``deep_supervision_weights``)."""
    base: nn.Module = RegionDiceBCELoss(scheme) if scheme.has_regions else DiceCELoss(ignore_value=scheme.ignore_value)
    return DeepSupervisionLoss(base, deep_supervision_weights(num_heads))
