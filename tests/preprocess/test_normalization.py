from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from autoseg.plan.planner import scheme_for_channel
from autoseg.plan.plans import IntensityProperties
from autoseg.preprocess.normalization import NORMALIZERS, normalize


def test_ct_clips_to_dataset_percentiles_then_standardizes():
    props = IntensityProperties(mean=100.0, std=50.0, percentile_00_5=-200.0, percentile_99_5=400.0)
    image = np.array([-1000.0, -200.0, 0.0, 100.0, 400.0, 3000.0], dtype=np.float32).reshape(1, 2, 3)
    out = normalize(image, "ct", props=props)
    # clipped to [-200, 400] first: -1000 -> -200 -> (-200 - 100) / 50 = -6; 3000 -> 400 -> 6
    np.testing.assert_allclose(out.ravel(), [-6.0, -6.0, -2.0, 0.0, 6.0, 6.0])
    assert out.dtype == np.float32
    assert out is image  # float32 input normalized in place


def test_ct_with_zero_std_does_not_divide_by_zero():
    props = IntensityProperties(mean=5.0, std=0.0, percentile_00_5=5.0, percentile_99_5=5.0)
    out = normalize(np.full((1, 2, 2), 7.0, dtype=np.float32), "ct", props=props)
    np.testing.assert_array_equal(out, 0.0)


def test_ct_without_props_says_what_to_pass():
    with pytest.raises(ValueError, match="intensity_properties"):
        normalize(np.zeros((1, 2, 2), dtype=np.float32), "ct")


def test_zscore_known_numbers():
    image = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32).reshape(1, 2, 2)  # mean 2.5, std sqrt(1.25)
    out = normalize(image, "zscore")
    np.testing.assert_allclose(out.ravel(), (np.array([1, 2, 3, 4]) - 2.5) / np.sqrt(1.25), rtol=1e-6)


def test_zscore_with_mask_uses_masked_statistics_and_zeroes_outside():
    image = np.array([[[10.0, 20.0], [30.0, 1000.0]], [[-50.0, 40.0], [7.0, 7.0]]], dtype=np.float32)
    mask = np.array([[[True, True], [True, False]], [[False, True], [False, False]]])
    out = normalize(image.copy(), "zscore", mask=mask)
    inside = np.array([10.0, 20.0, 30.0, 40.0])  # mean 25, std sqrt(125)
    np.testing.assert_allclose(out[mask], (inside - 25.0) / np.sqrt(125.0), rtol=1e-6)
    np.testing.assert_array_equal(out[~mask], 0.0)


def test_zscore_statistics_are_accurate_for_large_offsets():
    # float32 values around 1e4 with std 1: a float32 running sum would lose the variance; ours is float64.
    rng = np.random.default_rng(0)
    image = (10_000.0 + rng.standard_normal((4, 32, 32))).astype(np.float32)
    out = normalize(image.copy(), "zscore")
    assert abs(float(out.mean(dtype=np.float64))) < 1e-3
    assert abs(float(out.std(dtype=np.float64)) - 1.0) < 1e-3


def test_rescale_maps_robust_range_to_unit_interval():
    image = np.arange(1000, dtype=np.float32).reshape(10, 10, 10)
    image[0, 0, 0] = -1e6  # outliers are clipped at the image's own 0.5 / 99.5 percentiles
    image[-1, -1, -1] = 1e6
    out = normalize(image, "rescale")
    assert out.min() == 0.0 and out.max() == 1.0
    low, high = np.percentile(np.arange(1000.0), (0.5, 99.5))  # the two outliers barely move these
    np.testing.assert_allclose(out[5, 0, 0], (500 - low) / (high - low), atol=2e-3)


def test_rescale_of_constant_image_is_zero_and_none_only_casts():
    np.testing.assert_array_equal(normalize(np.full((1, 3, 3), 4.0, np.float32), "rescale"), 0.0)
    ints = np.array([[[1, -2], [300, 4]]], dtype=np.int16)
    out = normalize(ints, "none")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ints)


def test_non_float32_input_is_converted_not_modified():
    image = np.array([[[1.0, 3.0]]], dtype=np.float64)
    out = normalize(image, "zscore")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.ravel(), [-1.0, 1.0])
    np.testing.assert_array_equal(image.ravel(), [1.0, 3.0])


def test_unknown_scheme_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown normalization scheme 'minmax'") as info:
        normalize(np.zeros((1, 2, 2), dtype=np.float32), "minmax")
    for name in NORMALIZERS:
        assert name in str(info.value)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(Z, Y, X\)"):
        normalize(np.zeros((1, 1, 2, 2), dtype=np.float32), "zscore")
    with pytest.raises(ValueError, match="mask must be bool"):
        normalize(np.zeros((1, 2, 2), dtype=np.float32), "zscore", mask=np.ones((1, 2, 3), dtype=bool))


@pytest.mark.parametrize(
    ("channel_name", "scheme"),
    [
        ("CT", "ct"),
        ("ct", "ct"),
        ("noNorm", "none"),
        ("rescale_to_0_1", "rescale"),
        ("T2", "zscore"),
        ("FLAIR", "zscore"),
        ("CTA", "zscore"),
    ],
)
def test_scheme_for_channel(channel_name, scheme):
    assert scheme_for_channel(channel_name) == scheme
    assert scheme in NORMALIZERS


@pytest.mark.parametrize("scheme", ["ct", "zscore"])
def test_in_place_schemes_hold_no_volume_sized_temporaries(scheme):
    rng = np.random.default_rng(0)
    image = rng.standard_normal((16, 64, 64)).astype(np.float32)  # 256 KiB; a float64 copy would be 512 KiB
    mask = rng.random(image.shape) > 0.3
    props = IntensityProperties(mean=0.1, std=0.9, percentile_00_5=-2.5, percentile_99_5=2.5)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        normalize(image, scheme, mask=mask, props=props)
        extra = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert extra < image.nbytes // 4  # slice-sized temporaries only (one slice is 1/16 of the volume)
