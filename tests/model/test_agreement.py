"""The ensemble members' agreement (``autoseg.model.agreement``): pairwise Dice against hand-computed values on tiny
label tiles, the padding left out, regions, mirror variants flipped back, the sliding window feeding it, and its
bytes held against a measurement of the real code path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from autoseg.memory.tracker import StorageTracker
from autoseg.model.agreement import Agreement, AgreementCounter, agreement_bytes
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow

FULL = (slice(0, 1), slice(0, 2), slice(0, 3))  # a (1, 2, 3) tile that is the whole image


def _logits(labels: list[list[int]], num_outputs: int = 3) -> torch.Tensor:
    """(K, 1, 2, 3) logits whose argmax is ``labels`` (2 x 3)."""
    one_hot = torch.nn.functional.one_hot(torch.tensor(labels), num_outputs).permute(2, 0, 1)
    return one_hot[:, None].float() * 5


def _counter(agreement: Agreement, num_outputs: int = 3, region=FULL) -> AgreementCounter:
    counter = AgreementCounter(agreement, num_outputs)
    counter.start(torch.ones((1, 2, 3)), region)
    return counter


def test_pairwise_dice_of_three_folds_by_hand() -> None:
    a = [[1, 1, 0], [2, 0, 0]]  # class 1: 2 voxels, class 2: 1
    b = [[1, 0, 0], [2, 2, 0]]  # class 1: 1 (shared with a: 1), class 2: 2 (shared with a: 1)
    c = [[0, 0, 0], [0, 0, 0]]  # nothing
    counter = _counter(Agreement("folds", 3))
    for fold, labels in enumerate((a, b, c)):
        counter.add(_logits(labels), FULL, (), fold=fold, variant=0)
    dice = counter.pairwise_dice()
    # class 1: (a, b) 2*1/(2+1), (a, c) 0/2, (b, c) 0/1 -> mean of three; class 2: 2*1/(1+2), 0, 0
    assert dice[1] == pytest.approx((2 / 3 + 0 + 0) / 3)
    assert dice[2] == pytest.approx((2 / 3 + 0 + 0) / 3)


def test_a_class_no_member_predicts_is_nan_and_agreeing_members_give_one() -> None:
    counter = _counter(Agreement("folds", 2))
    for fold in range(2):
        counter.add(_logits([[1, 1, 0], [0, 0, 0]]), FULL, (), fold=fold, variant=0)
    dice = counter.pairwise_dice()
    assert dice[1] == 1.0 and math.isnan(dice[2])


def test_voxels_over_the_padding_are_not_counted() -> None:
    """The image is the tile's first column only (the rest is padding): there the members agree."""
    counter = _counter(Agreement("folds", 2), region=(slice(0, 1), slice(0, 2), slice(0, 1)))
    counter.add(_logits([[1, 2, 2], [1, 2, 2]]), FULL, (), fold=0, variant=0)
    counter.add(_logits([[1, 1, 1], [1, 1, 1]]), FULL, (), fold=1, variant=0)
    dice = counter.pairwise_dice()
    assert dice[1] == 1.0 and math.isnan(dice[2])


def test_regions_compare_each_output_above_zero() -> None:
    counter = _counter(Agreement("folds", 2, regions=True), num_outputs=2)
    first = torch.tensor([[[[1.0, 1.0, -1.0], [-1.0, -1.0, -1.0]]], [[[1.0, 1.0, 1.0], [1.0, -1.0, -1.0]]]])
    second = torch.tensor([[[[1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]], [[[1.0, 1.0, 1.0], [1.0, -1.0, -1.0]]]])
    counter.add(first, FULL, (), fold=0, variant=0)
    counter.add(second, FULL, (), fold=1, variant=0)
    assert counter.pairwise_dice() == {0: pytest.approx(2 / 3), 1: 1.0}


def test_mirror_variants_are_flipped_back_before_they_are_compared() -> None:
    """One fold, two variants: the second's labels are the first's mirrored along x, so flipped back they agree."""
    labels = [[1, 0, 0], [2, 2, 0]]
    counter = _counter(Agreement("variants", 2))
    counter.add(_logits(labels), FULL, (), fold=0, variant=0)
    counter.add(torch.flip(_logits(labels), [3]), FULL, (2,), fold=0, variant=1)
    assert counter.pairwise_dice() == {1: 1.0, 2: 1.0}


class _Constant(nn.Module):
    def __init__(self, label: int, num_outputs: int = 3) -> None:
        super().__init__()
        self.logits = torch.zeros(num_outputs)
        self.logits[label] = 4.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], len(self.logits), *x.shape[2:])
        return self.logits.reshape(1, -1, 1, 1, 1).expand(shape).clone()


def _window_dice(labels: tuple[int, ...], **settings) -> dict[int, float]:
    runners = [TorchTileRunner(_Constant(label), torch.device("cpu"), "fp32") for label in labels]
    agreement = Agreement("folds", len(labels))
    window = SlidingWindow((4, 4, 4), 3, agreement=agreement, **settings)
    counter = AgreementCounter(agreement, 3)
    sliding_window_predict(runners, np.zeros((1, 6, 7, 5), np.float32), window, agreement=counter)
    return counter.pairwise_dice()


def test_the_sliding_window_counts_every_fold_on_every_tile() -> None:
    assert _window_dice((1, 1), tile_batch_size=3) == {1: 1.0, 2: pytest.approx(math.nan, nan_ok=True)}
    dice = _window_dice((1, 2, 1), mirror_axes=(0, 1, 2), tta=2)
    assert dice[1] == pytest.approx(1 / 3) and dice[2] == 0.0  # pairs (0, 1), (0, 2), (1, 2): Dice 0, 1, 0


def test_a_window_asking_for_agreement_needs_its_counter() -> None:
    runners = [TorchTileRunner(_Constant(1), torch.device("cpu"), "fp32") for _ in range(2)]
    window = SlidingWindow((4, 4, 4), 3, agreement=Agreement("folds", 3))
    with pytest.raises(ValueError, match="agreement of 3 folds, but the window runs 2 network"):
        sliding_window_predict(runners, np.zeros((1, 4, 4, 4), np.float32), window, agreement=None)


@pytest.mark.parametrize(
    ("of", "members", "batch", "regions"),
    [("folds", 2, 1, False), ("folds", 3, 4, False), ("folds", 4, 2, True), ("variants", 4, 3, False)],
)
def test_agreement_bytes_hold_against_a_measurement(of: str, members: int, batch: int, regions: bool) -> None:
    """The counter's peak live tensor bytes (``StorageTracker`` on real CPU tensors) while it takes a batch's logits
    as ``run_tile_batch`` hands them over (fold by fold, or variant by variant), over the padding's edge: within 10%
    of ``agreement_bytes``, never above it."""
    tile, num_outputs = (8, 8, 8), 3
    agreement = Agreement(of, members, regions)
    generator = torch.Generator().manual_seed(0)
    image = (slice(1, 16), slice(0, 8), slice(0, 8))  # the first tile's first slice is padding
    regions_ = [(slice(z, z + 8), slice(0, 8), slice(0, 8)) for z in (0, 8)]
    if of == "folds":  # one batch of ``batch`` tiles (the first over the padding), through every fold in turn
        items, runs = [((slice(0, 8), slice(0, 8), slice(8 * i, 8 * i + 8)), 0) for i in range(batch)], members
    else:  # one fold: two tiles' variants, tile by tile, in batches of ``batch``
        items, runs = [(r, v) for r in regions_ for v in range(members)], 1
    batches = [items[i : i + batch] for i in range(0, len(items), batch)]
    logits = [torch.randn((len(b), num_outputs, *tile), generator=generator) for b in batches for _ in range(runs)]
    counter = AgreementCounter(agreement, num_outputs)
    gaussian = torch.ones(tile)
    counter.start(gaussian, image)
    with StorageTracker() as tracker:
        for tensor in (*logits, gaussian):  # seen now: what the window holds anyway is not the counter's
            tensor.view(-1)
        before = tracker.live_bytes
        batch_logits = iter(logits)
        for b in batches:
            for fold in range(runs):
                for out, (region, variant) in zip(next(batch_logits), b, strict=True):
                    counter.add(out, region, (), fold=fold, variant=variant)
    measured, estimate = tracker.peak_bytes - before, agreement_bytes(agreement, batch, tile, num_outputs)
    assert 0.9 * estimate <= measured <= estimate, (measured, estimate)
