from __future__ import annotations

import numpy as np
import pytest

from autoseg.dataset.cropping import (
    CropResult,
    bounding_box,
    crop_to_nonzero,
    nonzero_mask,
    signed_label_dtype,
    uncrop,
)


def hollow_body() -> np.ndarray:
    """(2, 6, 8, 9) float32: channel 0 is a hollow box (a zero cavity inside), channel 1 one extra voxel."""
    data = np.zeros((2, 6, 8, 9), dtype=np.float32)
    data[0, 1:5, 2:7, 1:6] = 5.0
    data[0, 2:4, 3:6, 2:5] = 0.0  # cavity, enclosed on all sides
    data[1, 3, 4, 7] = -1.0  # only this channel is nonzero here: extends the box along x to 8
    return data


def test_nonzero_mask_unites_channels_and_fills_holes():
    mask = nonzero_mask(hollow_body())
    assert mask.dtype == bool and mask.shape == (6, 8, 9)
    assert mask[2:4, 3:6, 2:5].all()  # the cavity is filled
    assert mask[3, 4, 7]  # from channel 1
    assert mask.sum() == 4 * 5 * 5 + 1
    with pytest.raises(ValueError, match=r"\(C, Z, Y, X\)"):
        nonzero_mask(np.zeros((6, 8, 9)))


def test_nonzero_mask_fills_holes_like_scipy_on_the_whole_array():
    """Filling inside the mask's bounding box only gives scipy's whole-array result (random masks, some
    touching the border, some with a background margin)."""
    from scipy.ndimage import binary_fill_holes

    rng = np.random.default_rng(0)
    for trial in range(60):
        shape = tuple(int(n) for n in rng.integers(3, 12, 3))
        data = (rng.random(shape) < rng.uniform(0.3, 0.95)).astype(np.float32)
        if trial % 2:
            data[:, :2] = 0
            data[-1:] = 0
        assert np.array_equal(nonzero_mask(data[None]), binary_fill_holes(data != 0)), trial
    assert nonzero_mask(np.ones((1, 3, 4, 5), np.float32)).all()


def test_bounding_box_and_empty_mask():
    mask = np.zeros((6, 8, 9), dtype=bool)
    assert bounding_box(mask) == ((0, 6), (0, 8), (0, 9))
    mask[1, 2, 3] = mask[4, 6, 7] = True
    assert bounding_box(mask) == ((1, 5), (2, 7), (3, 8))


def test_crop_to_nonzero_crops_and_marks_outside_background():
    data = hollow_body()
    seg = np.zeros((1, 6, 8, 9), dtype=np.uint8)
    seg[0, 2, 3, 2] = 2  # inside the (filled) cavity
    seg[0, 1, 2, 6] = 1  # outside the nonzero mask but labelled: keeps its label
    result = crop_to_nonzero(data, seg)
    assert isinstance(result, CropResult)
    assert result.bbox == ((1, 5), (2, 7), (1, 8))
    assert result.data.shape == (2, 4, 5, 7) and result.seg.shape == (1, 4, 5, 7)
    assert result.mask.shape == (4, 5, 7)
    np.testing.assert_array_equal(result.data, data[:, 1:5, 2:7, 1:8])
    assert result.seg.dtype == np.int8  # uint8 with labels <= 127 -> int8
    assert result.seg[0, 1, 1, 1] == 2 and result.seg[0, 0, 0, 5] == 1
    assert result.seg[0, 1, 1, 2] == 0  # cavity voxel: background inside the mask stays 0
    outside_and_background = ~result.mask & (seg[0, 1:5, 2:7, 1:8] == 0)
    assert outside_and_background.any()
    np.testing.assert_array_equal(result.seg[0][outside_and_background], -1)
    np.testing.assert_array_equal(result.seg[0][result.mask], seg[0, 1:5, 2:7, 1:8][result.mask])
    assert seg.min() == 0 and data[0, 0, 0, 0] == 0  # inputs unchanged


def test_crop_without_seg_and_of_an_all_zero_image():
    result = crop_to_nonzero(np.zeros((1, 3, 4, 5), dtype=np.float32))
    assert result.seg is None
    assert result.bbox == ((0, 3), (0, 4), (0, 5)) and result.data.shape == (1, 3, 4, 5)


def test_crop_rejects_mismatched_seg():
    with pytest.raises(ValueError, match=r"expected \(1, 6, 8, 9\)"):
        crop_to_nonzero(hollow_body(), np.zeros((1, 6, 8, 8), dtype=np.int16))


@pytest.mark.parametrize(
    ("dtype", "max_label", "expected"),
    [
        (np.uint8, 3, np.int8),
        (np.uint8, 200, np.int16),
        (np.uint16, 40_000, np.int32),
        (np.int16, 3, np.int16),
        (np.int64, 3, np.int64),
        (bool, 1, np.int8),
    ],
)
def test_signed_label_dtype(dtype, max_label, expected):
    seg = np.array([0, max_label]).astype(dtype)
    assert signed_label_dtype(seg) == np.dtype(expected)


def test_float_labels_are_rejected():
    with pytest.raises(ValueError, match="integer labels"):
        signed_label_dtype(np.zeros(3, dtype=np.float32))


def test_uncrop_round_trip():
    data = hollow_body()
    result = crop_to_nonzero(data)
    restored = uncrop(result.data, result.bbox, data.shape[1:])  # leading channel axis kept
    np.testing.assert_array_equal(restored, data)  # everything outside the box was zero
    filled = uncrop(result.mask, result.bbox, data.shape[1:], fill=False)
    np.testing.assert_array_equal(filled, nonzero_mask(data))
    marked = uncrop(np.ones((4, 5, 7), dtype=np.int8), result.bbox, (6, 8, 9), fill=-1)
    assert marked.dtype == np.int8 and (marked == -1).sum() == 6 * 8 * 9 - 4 * 5 * 7


def test_uncrop_errors():
    with pytest.raises(ValueError, match="does not match the bounding box"):
        uncrop(np.zeros((4, 5, 6)), ((1, 5), (2, 7), (1, 8)), (6, 8, 9))
    with pytest.raises(ValueError, match="does not fit"):
        uncrop(np.zeros((4, 5, 7)), ((1, 5), (2, 7), (3, 10)), (6, 8, 9))
