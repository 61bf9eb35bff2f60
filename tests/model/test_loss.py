"""Tests of the Dice + CE loss, deep-supervision weighting and target downsampling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoseg.dataset.labels import LabelScheme
from autoseg.model.loss import (
    DeepSupervisionLoss,
    DiceCELoss,
    RegionDiceBCELoss,
    compute_loss,
    deep_supervision_weights,
    downsample_targets,
    training_loss,
)

PLAIN_IGNORE = LabelScheme.from_labels({"background": 0, "organ": 1, "lesion": 2, "ignore": 3})
REGIONS = LabelScheme.from_labels({"background": 0, "organ": [1, 2], "lesion": 2}, [1, 2])
REGIONS_IGNORE = LabelScheme.from_labels({"background": 0, "organ": [1, 2], "lesion": 2, "ignore": 3}, [1, 2])


def random_target(shape: tuple[int, ...], num_outputs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_outputs, shape, generator=g)


def confident_logits(target: torch.Tensor, num_outputs: int, margin: float = 30.0) -> torch.Tensor:
    """Logits ``(B, C, *spatial)`` that put almost all probability on ``target`` ``(B, 1, *spatial)``."""
    onehot = torch.zeros(target.shape[0], num_outputs, *target.shape[2:])
    return margin * onehot.scatter_(1, target.long(), 1.0)


def test_perfect_prediction_gives_near_zero_loss_and_wrong_one_a_large_loss() -> None:
    target = random_target((2, 1, 8, 8, 8), 3)
    loss = DiceCELoss()
    perfect = loss(confident_logits(target, 3), target)
    wrong = loss(confident_logits((target + 1) % 3, 3), target)
    assert 0 <= perfect.item() < 1e-4
    assert wrong.item() > 1 + 29  # Dice term ~1 plus CE ~ margin 30


def test_uniform_prediction_matches_hand_computed_batch_dice() -> None:
    # two samples of 8 voxels: 3 and 1 foreground voxels (4 of 16 in the batch); p = 0.5 everywhere
    target = torch.zeros(2, 1, 8, dtype=torch.int64)
    target[0, 0, :3] = 1
    target[1, 0, 0] = 1
    loss = DiceCELoss()(torch.zeros(2, 2, 8), target)
    # batch dice: (2 * 0.5 * 4) / (0.5 * 16 + 4) = 1/3; per-sample dice would average 0.4 and 1/6.5 instead
    expected = math.log(2) + (1 - 4 / 12)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_background_is_excluded_from_dice() -> None:
    target = torch.tensor([[[0, 0, 1, 1]]])
    logits = torch.tensor([[[30.0, 30.0, 0.0, 0.0], [30.0, 30.0, 30.0, 30.0]]])  # p1 = 0.5, 0.5, ~1, ~1
    loss = DiceCELoss(ce_weight=0.0)(logits, target)
    dice_class1 = (2 * 2) / (3 + 2)  # intersection 2, sum p1 = 3, sum g1 = 2
    dice_background = (2 * 1) / (1 + 2)  # would pull the mean to 0.733 if it were included
    assert loss.item() == pytest.approx(1 - dice_class1, abs=1e-4)
    assert loss.item() != pytest.approx(1 - (dice_class1 + dice_background) / 2, abs=1e-2)


def test_minus_one_is_background_for_any_int_dtype() -> None:
    target = random_target((2, 1, 6, 6), 3, seed=1)
    with_outside = target.clone()
    with_outside[:, :, :2] = -1
    as_background = with_outside.clamp_min(0)
    logits = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    loss = DiceCELoss()
    expected = loss(logits, as_background)
    assert torch.allclose(loss(logits, with_outside), expected)
    assert torch.allclose(loss(logits, with_outside.to(torch.int8)), expected)
    assert torch.allclose(loss(logits, with_outside.to(torch.int16)), expected)


def test_loss_backpropagates_to_logits() -> None:
    target = random_target((1, 1, 4, 4), 2)
    logits = torch.zeros(1, 2, 4, 4, requires_grad=True)
    DiceCELoss()(logits, target).backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad) > 0


def test_loss_rejects_mismatched_or_float_targets() -> None:
    loss = DiceCELoss()
    with pytest.raises(ValueError, match=r"target has shape \(1, 1, 4\); expected \(1, 1, 8\)"):
        loss(torch.zeros(1, 2, 8), torch.zeros(1, 1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer label map"):
        loss(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match="C >= 2"):
        loss(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8, dtype=torch.int64))


def test_deep_supervision_weights() -> None:
    assert deep_supervision_weights(3) == pytest.approx([2 / 3, 1 / 3, 0.0])
    weights5 = deep_supervision_weights(5)
    assert weights5 == pytest.approx([w / 1.875 for w in (1, 0.5, 0.25, 0.125, 0)])
    assert sum(weights5) == pytest.approx(1.0)
    assert deep_supervision_weights(1) == [1.0]
    with pytest.raises(ValueError, match="num_heads is 0"):
        deep_supervision_weights(0)


class RecordingLoss(nn.Module):
    """Returns the mean of the logits and records the shapes it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(logits.shape[2:]))
        return logits.mean()


def test_deep_supervision_loss_is_weighted_sum_and_skips_zero_weights() -> None:
    base = RecordingLoss()
    loss = DeepSupervisionLoss(base, deep_supervision_weights(3))
    outputs = [torch.full((1, 2, 8, 8), 3.0), torch.full((1, 2, 4, 4), 6.0), torch.full((1, 2, 2, 2), 100.0)]
    targets = [torch.zeros(1, 1, *o.shape[2:], dtype=torch.int64) for o in outputs]
    assert loss(outputs, targets).item() == pytest.approx(2 / 3 * 3 + 1 / 3 * 6)
    assert base.calls == [(8, 8), (4, 4)]  # the 2x2 output was never evaluated
    with pytest.raises(ValueError, match="got 2 outputs and 2 targets for 3"):
        loss(outputs[:2], targets[:2])


def test_downsample_targets_shapes_and_values() -> None:
    target = torch.arange(2 * 8 * 12, dtype=torch.int16).reshape(2, 1, 8, 12) - 1  # includes -1
    full, half, aniso, odd = downsample_targets(target, [(8, 12), (4, 6), (8, 3), (3, 5)])
    assert full is target
    assert torch.equal(half, target[:, :, ::2, ::2]) and half.dtype == torch.int16
    assert torch.equal(aniso, target[:, :, :, ::4])
    assert odd.shape == (2, 1, 3, 5)
    # non-integer ratio: output voxel i takes input floor(i * n_in / n_out): rows 0, 2, 5; cols 0, 2, 4, 7, 9
    assert torch.equal(odd, target[:, :, [0, 2, 5]][:, :, :, [0, 2, 4, 7, 9]])
    assert half[0, 0, 0, 0] == -1
    with pytest.raises(ValueError, match=r"spatial shape \(8, 12\) to \(4,\)"):
        downsample_targets(target, [(4,)])


def test_compute_loss_with_network_outputs() -> None:
    target = random_target((1, 1, 8, 8), 2)
    outputs = [confident_logits(t, 2) for t in downsample_targets(target, [(8, 8), (4, 4), (2, 2)])]
    ds_loss = DeepSupervisionLoss(DiceCELoss(), deep_supervision_weights(3))
    assert compute_loss(outputs, target, ds_loss).item() < 1e-4
    wrong = [confident_logits(1 - t, 2) for t in downsample_targets(target, [(8, 8), (4, 4), (2, 2)])]
    assert compute_loss(wrong, target, ds_loss).item() > 1
    assert compute_loss(outputs[0], target, ds_loss).item() < 1e-4  # deep supervision switched off
    with pytest.raises(ValueError, match="wrap it in DeepSupervisionLoss"):
        compute_loss(outputs, target, DiceCELoss())


@pytest.mark.parametrize("scheme", [PLAIN_IGNORE, REGIONS_IGNORE], ids=["classes", "regions"])
def test_ignore_voxels_have_no_effect_on_loss_or_gradient(scheme: LabelScheme) -> None:
    target = random_target((2, 1, 6, 6), 4, seed=3)  # values 0..3, 3 = ignore (about a quarter)
    target[0, 0, 0, :3] = -1
    ignored = (target == 3).expand(-1, scheme.num_outputs, -1, -1)
    loss = training_loss(scheme, 1).base_loss
    logits = torch.randn(2, scheme.num_outputs, 6, 6, generator=torch.Generator().manual_seed(4), requires_grad=True)
    value = loss(logits, target)
    value.backward()
    assert torch.count_nonzero(logits.grad[ignored]) == 0 and torch.count_nonzero(logits.grad[~ignored]) > 0
    changed = logits.detach().clone()
    changed[ignored] = 50 * torch.randn(int(ignored.sum()), generator=torch.Generator().manual_seed(5))
    assert loss(changed, target).item() == pytest.approx(value.item(), abs=1e-6)


@pytest.mark.parametrize("scheme", [PLAIN_IGNORE, REGIONS_IGNORE], ids=["classes", "regions"])
def test_ignore_equals_leaving_the_voxels_out(scheme: LabelScheme) -> None:
    target = torch.tensor([[[0, 1, 2, 3, 2, 3, 1, 0]]])
    logits = torch.randn(1, scheme.num_outputs, 8, generator=torch.Generator().manual_seed(6))
    kept = (target[0, 0] != 3).nonzero()[:, 0]
    without = (
        LabelScheme.from_labels({"background": 0, "organ": [1, 2], "lesion": 2}, [1, 2])
        if scheme.has_regions
        else LabelScheme.plain(3)
    )
    expected = training_loss(without, 1).base_loss(logits[:, :, kept], target[:, :, kept])
    assert training_loss(scheme, 1).base_loss(logits, target).item() == pytest.approx(expected.item(), abs=1e-6)


def test_all_ignored_patch_gives_a_finite_loss() -> None:
    target = torch.full((1, 1, 4, 4), 3)
    for scheme in (PLAIN_IGNORE, REGIONS_IGNORE):
        value = training_loss(scheme, 1).base_loss(torch.randn(1, scheme.num_outputs, 4, 4), target)
        assert math.isfinite(value.item())


def test_region_loss_matches_a_hand_computation() -> None:
    # regions organ = {1, 2}, lesion = {2}; 4 voxels with labels 0, 1, 2, 2 (and -1 = background)
    target = torch.tensor([[[0, 1, 2, -1]]])
    logits = torch.tensor([[[2.0, -1.0, 0.0, 1.0], [0.0, 0.5, 3.0, -2.0]]])
    g = [[0, 1, 1, 0], [0, 0, 1, 0]]
    bce = 0.0
    dice = []
    for r in range(2):
        p = [1 / (1 + math.exp(-z)) for z in logits[0, r].tolist()]
        bce += sum(-(gi * math.log(pi) + (1 - gi) * math.log(1 - pi)) for gi, pi in zip(g[r], p))
        dice.append((2 * sum(pi * gi for pi, gi in zip(p, g[r])) + 1e-5) / (sum(p) + sum(g[r]) + 1e-5))
    expected = bce / 8 + 1 - sum(dice) / 2
    assert RegionDiceBCELoss(REGIONS)(logits, target).item() == pytest.approx(expected, abs=1e-6)


def test_region_loss_near_zero_for_confident_right_regions() -> None:
    target = random_target((2, 1, 6, 6), 3, seed=7)
    logits = 30 * (2 * REGIONS.target_to_regions(target).float() - 1)
    assert RegionDiceBCELoss(REGIONS)(logits, target).item() < 1e-4
    with pytest.raises(ValueError, match=r"expected \(B, 2, \*spatial\), one channel per region"):
        RegionDiceBCELoss(REGIONS)(torch.zeros(2, 3, 6, 6), target)
    with pytest.raises(ValueError, match="needs region-based labels"):
        RegionDiceBCELoss(PLAIN_IGNORE)


@pytest.mark.parametrize("scheme", [PLAIN_IGNORE, REGIONS_IGNORE], ids=["classes", "regions"])
def test_deep_supervision_keeps_the_ignore_label(scheme: LabelScheme) -> None:
    target = random_target((1, 1, 8, 8), 4, seed=8)
    low = downsample_targets(target, [(4, 4)])[0]
    assert torch.equal(low, target[:, :, ::2, ::2]) and (low == 3).any()  # nearest: ignore stays ignore
    outputs = [torch.randn(1, scheme.num_outputs, 8, 8), torch.randn(1, scheme.num_outputs, 4, 4)]
    loss = training_loss(scheme, 2)  # weights 1, 0 -> only full resolution counts
    changed = [o.clone() for o in outputs]
    changed[0][(target == 3).expand_as(changed[0])] = 100.0
    assert compute_loss(changed, target, loss).item() == pytest.approx(compute_loss(outputs, target, loss).item())
