"""apply_postprocessing (largest connected components) and reading {case}.npz back as a label map."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from autoseg.core.errors import InputError
from autoseg.dataset.labels import LabelScheme
from autoseg.predict.postprocessing import (
    Postprocessing,
    apply_postprocessing,
    largest_component_bytes,
    largest_component_mask,
)
from autoseg.predict.probabilities import labels_from_probabilities, read_probabilities

PLAIN = LabelScheme.from_labels({"background": 0, "organ": 1, "lesion": 2})
REGIONS = LabelScheme.from_labels({"background": 0, "whole": [1, 2], "core": [2]}, [1, 2])


def _labels() -> np.ndarray:
    """organ: a 2x2x2 cube and a lone voxel; lesion: a 1x1x2 bar and a lone voxel."""
    labels = np.zeros((4, 6, 6), dtype=np.uint8)
    labels[0:2, 0:2, 0:2] = 1
    labels[3, 5, 5] = 1
    labels[0, 4, 4:6] = 2
    labels[3, 5, 0] = 2
    return labels


def test_a_class_keeps_its_largest_component_and_the_others_are_untouched() -> None:
    labels = _labels()
    out = apply_postprocessing(labels, Postprocessing(largest_component_of=("organ",)), PLAIN)
    expected = _labels()
    expected[3, 5, 5] = 0
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(labels, _labels())  # the input is left unchanged
    assert out.dtype == labels.dtype


def test_each_named_class_in_turn() -> None:
    out = apply_postprocessing(_labels(), Postprocessing(largest_component_of=("organ", "lesion")), PLAIN)
    assert (out == 1).sum() == 8 and (out == 2).sum() == 2 and out[3, 5, 0] == 0


def test_all_foreground_as_one_keeps_the_largest_component_of_any_class() -> None:
    labels = _labels()
    labels[2, 2, 2] = 2  # touches the organ cube diagonally: one component with it
    out = apply_postprocessing(labels, Postprocessing(largest_foreground_component=True), PLAIN)
    assert out[2, 2, 2] == 2 and (out == 1).sum() == 8 and (out == 2).sum() == 1


def test_no_postprocessing_is_the_identity() -> None:
    np.testing.assert_array_equal(apply_postprocessing(_labels(), Postprocessing(), PLAIN), _labels())
    assert Postprocessing().is_identity and Postprocessing().describe() == "none"


def test_a_region_is_the_union_of_its_values() -> None:
    labels = np.zeros((1, 5, 9), dtype=np.uint8)
    labels[0, 1:4, 0:2] = 1
    labels[0, 1:4, 2:3] = 2  # 'whole' = values 1 and 2: one component of 9 voxels
    labels[0, 2, 7] = 2  # a second 'whole' (and 'core') component
    out = apply_postprocessing(labels, Postprocessing(largest_component_of=("whole",)), REGIONS)
    assert out[0, 2, 7] == 0 and (out > 0).sum() == 9


def test_diagonal_neighbours_are_connected_and_ties_are_all_kept() -> None:
    mask = np.zeros((1, 4, 4), dtype=bool)
    mask[0, 0, 0] = mask[0, 1, 1] = True  # diagonal: one component (full connectivity, as nnU-Net)
    mask[0, 3, 3] = True
    np.testing.assert_array_equal(largest_component_mask(mask), mask & (np.arange(4)[None, :, None] < 2))
    tie = np.zeros((1, 1, 5), dtype=bool)
    tie[0, 0, [0, 4]] = True
    np.testing.assert_array_equal(largest_component_mask(tie), tie)


def test_an_unknown_class_name_is_refused() -> None:
    with pytest.raises(InputError, match=r"'liver', which is not a foreground class or region .*find-best"):
        apply_postprocessing(_labels(), Postprocessing(largest_component_of=("liver",)), PLAIN)


def test_probabilities_become_labels_by_exports_rule() -> None:
    p = np.zeros((3, 1, 1, 3), dtype=np.float32)
    p[:, 0, 0, 0] = (0.2, 0.5, 0.3)
    p[:, 0, 0, 1] = (0.4, 0.4, 0.2)  # a tie: the first
    p[:, 0, 0, 2] = (0.1, 0.2, 0.7)
    np.testing.assert_array_equal(labels_from_probabilities(p, PLAIN)[0, 0], [1, 0, 2])
    regions = np.array([[0.6, 0.6, 0.4], [0.2, 0.7, 0.9]], dtype=np.float32).reshape(2, 1, 1, 3)
    np.testing.assert_array_equal(labels_from_probabilities(regions, REGIONS)[0, 0], [1, 2, 2])


def test_probabilities_of_other_labels_are_refused(tmp_path) -> None:
    path = tmp_path / "case.npz"
    np.savez(
        path,
        probabilities=np.zeros((2, 1, 2, 2), dtype=np.float16),
        names=np.array(["background", "x"]),
        activation=np.array("softmax"),
    )
    with pytest.raises(InputError, match=r"case.npz: holds softmax outputs \['background', 'x'\], but the labels"):
        read_probabilities(path, PLAIN)
    path.write_bytes(b"not a zip")
    with pytest.raises(InputError, match="not a readable probability file"):
        read_probabilities(path, PLAIN)


@pytest.mark.parametrize(
    "postprocessing", [Postprocessing(largest_foreground_component=True), Postprocessing(True, ("organ", "lesion"))]
)
def test_postprocessing_memory_estimate_holds_against_tracemalloc(postprocessing: Postprocessing) -> None:
    """largest_component_bytes is what apply_postprocessing holds beside its input (the copy, masks, the int32
    component map, a chunk of the count): at or above the tracemalloc peak, by at most 10%. Breaks when a step
    allocates a voxel-sized temporary the estimate does not name (np.isin sorts: ~10 bytes a voxel; a whole-array
    bincount casts to int64: 8)."""
    rng = np.random.default_rng(0)
    labels = ((rng.random((40, 96, 96)) < 0.3) * rng.integers(1, 3, (40, 96, 96))).astype(np.uint8)  # many components
    tracemalloc.start()
    try:
        apply_postprocessing(labels, postprocessing, PLAIN)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = largest_component_bytes(labels.size, labels.itemsize)
    assert peak <= estimate <= 1.1 * peak, (estimate, peak)
