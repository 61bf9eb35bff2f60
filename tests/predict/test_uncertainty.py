"""Per-case uncertainty's pieces (``autoseg.predict.uncertainty``): the entropy map against hand-computed values (from
probabilities, from logits, for regions, block after block), its mean inside the foreground, a case's row and the
CSV, and the entropy map's bytes held against a measurement."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch
from factories import case_properties

from autoseg.dataset.labels import LabelScheme
from autoseg.model.agreement import Agreement, AgreementCounter
from autoseg.predict.uncertainty import (
    EntropyMap,
    UncertaintyParts,
    case_row,
    entropy_map_bytes,
    uncertainty_csv,
)

SCHEME = LabelScheme.plain(3)  # background, two classes


def _add(entropy: EntropyMap, maps: np.ndarray) -> None:
    """Hand ``maps`` (K, n, Y, X) over as the export does: output by output."""
    for k, m in enumerate(maps):
        entropy.add(k, m.astype(np.float32, copy=False))


def test_entropy_of_probabilities_by_hand() -> None:
    scheme = LabelScheme.plain(2)
    p = np.array([0.5, 1.0, 0.9], dtype=np.float32).reshape(1, 1, 3)
    entropy = EntropyMap(case_properties("c", (1, 1, 3)), scheme)
    _add(entropy, np.stack([p, 1 - p]))
    # H / ln 2: 1, 0, and -(0.9 ln 0.9 + 0.1 ln 0.1) / ln 2 = 0.469, as 255 levels
    assert entropy.full[0, 0].tolist() == [255, 0, round(0.4690 * 255)]


def test_entropy_from_logits_is_the_softmax_entropy() -> None:
    logits = np.random.default_rng(0).normal(0, 3, size=(3, 2, 4, 5)).astype(np.float32)
    probabilities = torch.softmax(torch.from_numpy(logits), dim=0).numpy()
    props = case_properties("c", (2, 4, 5))
    from_logits, from_probabilities = EntropyMap(props, SCHEME, logits=True), EntropyMap(props, SCHEME)
    _add(from_logits, logits)
    _add(from_probabilities, probabilities)
    h = -(probabilities * np.log(probabilities)).sum(axis=0) / math.log(3)
    assert np.abs(from_probabilities.full.astype(int) - np.rint(h * 255)).max() <= 1
    assert np.abs(from_logits.full.astype(int) - from_probabilities.full.astype(int)).max() <= 1


def test_regions_average_their_binary_entropies() -> None:
    scheme = replace(LabelScheme.plain(3), has_regions=True, regions_class_order=(1, 2))
    entropy = EntropyMap(case_properties("c", (1, 1, 2)), scheme)
    _add(entropy, np.array([[[[0.5, 1.0]]], [[[0.5, 0.5]]]]))
    assert entropy.full[0, 0].tolist() == [255, 128]  # (ln 2 + ln 2) / 2 ln 2, (0 + ln 2) / 2 ln 2


def test_blocks_fill_consecutive_slices_and_the_mean_is_taken_inside_the_foreground() -> None:
    scheme = LabelScheme.plain(2)
    entropy = EntropyMap(case_properties("c", (3, 1, 2)), scheme)
    even = np.full((1, 1, 2), 0.5, np.float32)
    _add(entropy, np.stack([even, even]))  # slice 0: 255
    certain = np.ones((2, 1, 2), np.float32)
    _add(entropy, np.stack([certain, 1 - certain]))  # slices 1, 2: 0
    assert entropy.full[:, 0].tolist() == [[255, 255], [0, 0], [0, 0]]
    labels = np.array([[[1, 0]], [[1, 1]], [[0, 0]]])
    assert entropy.mean_inside(labels) == pytest.approx(1 / 3)
    assert entropy.mean_inside(np.zeros_like(labels)) is None


def _parts(labels_per_fold: list[np.ndarray]) -> UncertaintyParts:
    agreement = Agreement("folds", len(labels_per_fold))
    counter = AgreementCounter(agreement, 3)
    counter.start(torch.ones(labels_per_fold[0].shape), tuple(slice(0, n) for n in labels_per_fold[0].shape))
    region = tuple(slice(0, n) for n in labels_per_fold[0].shape)
    for fold, labels in enumerate(labels_per_fold):
        logits = torch.nn.functional.one_hot(torch.from_numpy(labels), 3).permute(3, 0, 1, 2).float()
        counter.add(logits, region, (), fold=fold, variant=0)
    shape = labels_per_fold[0].shape
    entropy = EntropyMap(case_properties("c", shape), SCHEME)
    _add(entropy, np.stack([np.full(shape, 1 / 3, np.float32)] * 3))  # the largest entropy everywhere
    return UncertaintyParts(counter, entropy)


def test_a_cases_row_scores_its_entropy_or_without_foreground_its_disagreement() -> None:
    a = np.array([[[1, 1, 0, 0]]])
    b = np.array([[[1, 0, 0, 0]]])
    row = case_row("case_1", _parts([a, b]), a, SCHEME)
    assert row.dice == {SCHEME.names[0]: pytest.approx(2 / 3), SCHEME.names[1]: None}
    assert row.disagreement == pytest.approx(1 - 2 / 3)  # 1 - the mean Dice of the classes some fold predicts
    assert row.score == row.entropy == pytest.approx(1.0) and row.foreground_voxels == 2
    nothing = case_row("case_2", _parts([a * 0, b]), a * 0, SCHEME)  # nothing written, but fold 1 saw class 1
    assert nothing.entropy is None and nothing.score == nothing.disagreement == 1.0


def test_the_csv_has_one_row_per_case_in_case_order_and_empty_cells_for_none() -> None:
    a, b = np.array([[[1, 2, 0]]]), np.array([[[1, 0, 0]]])
    rows = [case_row("case_b", _parts([a, b]), a, SCHEME), case_row("case_a", _parts([a, a]), a, SCHEME)]
    lines = uncertainty_csv(rows).splitlines()
    names = [f"dice_{n}" for n in sorted(SCHEME.names)]
    header = ["case", "score", "entropy", "disagreement", "of", "members", "foreground_voxels", *names]
    assert lines[0].split(",") == header
    assert [line.split(",")[0] for line in lines[1:]] == ["case_a", "case_b"]
    cells = dict(zip(lines[0].split(","), lines[2].split(","), strict=True))
    assert cells["of"] == "folds" and cells["members"] == "2" and cells["foreground_voxels"] == "2"
    assert float(cells[f"dice_{SCHEME.names[0]}"]) == 1.0 and float(cells[f"dice_{SCHEME.names[1]}"]) == 0.0


@pytest.mark.parametrize(("logits", "regions"), [(False, False), (True, False), (True, True)])
def test_entropy_map_bytes_hold_against_a_measurement(logits: bool, regions: bool) -> None:
    """tracemalloc's peak while a block of (8, 32, 32) slices passes output by output: within 20% of the estimate for
    a softmax of logits (the most it holds), never above it; regions' logits hold as much."""
    shape, block = (8, 32, 32), (8, 32, 32)
    scheme = replace(SCHEME, has_regions=True, regions_class_order=(1, 2)) if regions else SCHEME
    maps = np.random.default_rng(0).random((scheme.num_outputs, *block), dtype=np.float32)
    tracemalloc.start()
    try:
        entropy = EntropyMap(case_properties("c", shape), scheme, logits=logits)
        _add(entropy, maps)
        measured = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = entropy_map_bytes(shape, math.prod(block))
    assert measured <= estimate, (measured, estimate)
    if logits:
        assert measured >= 0.8 * estimate, (measured, estimate)
