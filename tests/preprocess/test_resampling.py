from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import SimpleITK as sitk

from autoseg.core.spacing import compute_new_shape, is_anisotropic, out_of_plane_axis
from autoseg.memory.host import resampling_peak_bytes, segmentation_resampling_peak_bytes
from autoseg.preprocess.resampling import resample_channel, resample_image, resample_segmentation


def smooth_volume(shape_zyx: tuple[int, int, int], spacing_mm: tuple[float, float, float]) -> np.ndarray:
    """float32 (Z, Y, X): a smooth function of the physical position (amplitude ~1.5)."""
    z, y, x = (np.arange(n) * s for n, s in zip(shape_zyx, spacing_mm, strict=True))
    zz, yy, xx = np.meshgrid(z, y, x, indexing="ij")
    return (np.sin(zz / 4.0) * np.cos(yy / 5.0) + 0.5 * np.sin(xx / 3.0 + 1.0)).astype(np.float32)


def sitk_resample(volume: np.ndarray, spacing_mm, new_shape_zyx, interpolator) -> np.ndarray:
    """SimpleITK reference on the same grid: same physical extent, spacing s * n / n', origin shifted by
    half the spacing difference."""
    image = sitk.GetImageFromArray(volume)
    image.SetSpacing([float(s) for s in reversed(spacing_mm)])
    new_spacing = [s * n / m for s, n, m in zip(spacing_mm, volume.shape, new_shape_zyx, strict=True)]
    origin = [(t - s) / 2 for t, s in zip(new_spacing, spacing_mm, strict=True)]
    out = sitk.Resample(
        image,
        [int(n) for n in reversed(new_shape_zyx)],
        sitk.Transform(),
        interpolator,
        list(reversed(origin)),
        list(reversed(new_spacing)),
        image.GetDirection(),
        0.0,
        sitk.sitkFloat32,
    )
    return sitk.GetArrayFromImage(out)


def test_compute_new_shape_rounds_and_keeps_at_least_one_voxel():
    assert compute_new_shape((12, 16, 20), (1.5, 1.0, 0.8), (1.0, 1.0, 1.0)) == (18, 16, 16)
    assert compute_new_shape((10, 10, 10), (1.0, 1.0, 1.0), (3.0, 3.0, 3.0)) == (3, 3, 3)  # 3.33 -> 3
    assert compute_new_shape((1, 64, 64), (999.0, 0.5, 0.5), (999.0, 1.0, 1.0)) == (1, 32, 32)
    assert compute_new_shape((2, 5, 5), (1.0, 1.0, 1.0), (50.0, 1.0, 1.0)) == (1, 5, 5)
    with pytest.raises(ValueError, match="3 entries"):
        compute_new_shape((10, 10), (1.0, 1.0), (2.0, 2.0))


def test_round_trip_shapes():
    shape, spacing, target = (12, 16, 20), (1.5, 1.0, 0.8), (1.0, 1.0, 1.0)
    new_shape = compute_new_shape(shape, spacing, target)
    assert compute_new_shape(new_shape, target, spacing) == shape
    volume = smooth_volume(shape, spacing)[None]
    there = resample_image(volume, new_shape, spacing)
    back = resample_image(there, shape, target)
    assert there.shape == (1, *new_shape) and back.shape == (1, *shape) and back.dtype == np.float32
    # Up then down returns a smooth volume (amplitude 1.5, shortest wavelength ~19 mm, i.e. ~13 voxels)
    # closely: two cubic interpolations of a well-sampled signal; measured max error 0.012.
    assert np.abs(back - volume)[:, 2:-2, 2:-2, 2:-2].max() < 0.03


@pytest.mark.parametrize(
    ("spacing", "expected_aniso", "expected_axis"),
    [
        ((3.0, 1.0, 1.0), False, None),  # ratio 3 is not above the threshold
        ((3.1, 1.0, 1.0), True, 0),
        ((0.7, 0.7, 5.0), True, 2),
        ((5.0, 5.0, 1.0), True, None),  # two axes share the largest spacing: no single out-of-plane axis
        ((999.0, 0.5, 0.5), True, 0),  # a 2D image lifted to Z = 1
    ],
)
def test_anisotropy_detection(spacing, expected_aniso, expected_axis):
    assert is_anisotropic(spacing) is expected_aniso
    assert out_of_plane_axis(spacing) == expected_axis


@pytest.mark.parametrize("new_shape", [(18, 16, 16), (9, 22, 13)])
@pytest.mark.parametrize(("order", "interpolator"), [(3, sitk.sitkBSpline), (1, sitk.sitkLinear)])
def test_matches_simpleitk_resample(new_shape, order, interpolator):
    # Same grid and same boundary handling as SimpleITK: the only differences are float32 rounding (our
    # spline coefficients are float32, ITK's double; values ~1.5 -> ~1e-7 per step), so 1e-5 holds for
    # every voxel, border included (measured: <= 1.2e-7).
    spacing = (1.5, 1.0, 0.8)  # ratio 1.9: the 3D path
    volume = smooth_volume((12, 16, 20), spacing)
    ours = resample_image(volume[None], new_shape, spacing, order=order)[0]
    reference = sitk_resample(volume, spacing, new_shape, interpolator)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("order", "interpolator"), [(3, sitk.sitkBSpline), (1, sitk.sitkLinear)])
def test_anisotropic_path_with_equal_orders_is_separable_3d_interpolation(order, interpolator):
    # Tensor-product splines are separable: in-plane then out-of-plane with the same order equals the 3D
    # interpolation, so the anisotropic path must match SimpleITK too (here along x, the last axis).
    spacing = (0.8, 1.0, 4.0)
    volume = smooth_volume((14, 12, 6), spacing)
    new_shape = (11, 15, 17)
    ours = resample_image(volume[None], new_shape, spacing, order=order, order_z=order)[0]
    reference = sitk_resample(volume, spacing, new_shape, interpolator)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)


def test_anisotropic_path_agrees_with_3d_path_on_data_linear_along_z():
    # f = in-plane noise + 0.3 * z: linear interpolation along z and a cubic spline both reproduce a
    # linear function, except near the z borders where the spline's mirror extension (a kink of slope
    # 0.6) leaks in, decaying by 0.27 per voxel. Output slices 8..21 sample input z >= 2.9 voxels from
    # either border: 0.27^2.9 * ~0.3 = 7e-3 is a loose bound; measured 9e-4. Near the border the paths differ.
    spacing_aniso = (4.0, 1.0, 1.0)
    in_plane = np.random.default_rng(0).random((1, 16, 16), dtype=np.float32)
    volume = (in_plane + 0.3 * np.arange(12, dtype=np.float32)[:, None, None])[None]
    new_shape = (30, 24, 12)
    aniso = resample_image(volume, new_shape, spacing_aniso, order=3, order_z=1)
    full_3d = resample_image(volume, new_shape, (1.0, 1.0, 1.0), order=3)
    assert np.abs(aniso - full_3d)[:, 8:-8].max() < 5e-3
    assert np.abs(aniso - full_3d).max() > 2e-2  # the paths really differ (at the z borders)


def test_anisotropic_path_order_z_zero_repeats_slices():
    spacing = (5.0, 1.0, 1.0)
    volume = np.random.default_rng(0).random((2, 4, 10, 10), dtype=np.float32)
    out = resample_image(volume, (8, 10, 10), spacing, order=3, order_z=0)
    np.testing.assert_array_equal(out[:, 0::2], out[:, 1::2])  # each thick slice becomes two
    np.testing.assert_allclose(out[:, 0::2], volume, atol=1e-6)  # in-plane unchanged -> slices kept


@pytest.mark.parametrize(
    ("spacing", "new_shape"), [((1.0, 1.2, 1.0), (7, 13, 9)), ((5.0, 1.0, 1.0), (4, 13, 9))], ids=["3d", "in-plane"]
)
def test_skimage_style_reproduces_nnunets_skimage_resize(spacing, new_shape):
    """nnU-Net v2 resizes with skimage (mode "edge", no anti-aliasing, clipped to the input's range): the whole
    volume, or each slice when the spacing is anisotropic. A random image makes the spline overshoot, so both the
    border and the clipping count."""
    resize = pytest.importorskip("skimage.transform").resize
    volume = np.random.default_rng(2).random((4, 10, 12), dtype=np.float32)
    ours = resample_image(volume[None], new_shape, spacing, order=3, order_z=0, style="skimage")[0]
    if is_anisotropic(spacing):
        reference = np.stack(
            [resize(v.astype(np.float64), new_shape[1:], 3, mode="edge", anti_aliasing=False) for v in volume]
        )
    else:
        reference = resize(volume.astype(np.float64), new_shape, 3, mode="edge", anti_aliasing=False)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
    sitk_style = resample_image(volume[None], new_shape, spacing, order=3, order_z=0)[0]
    assert np.abs(sitk_style - reference).max() > 1e-2  # the styles differ on this image


def test_skimage_style_stays_in_each_slices_range():
    volume = np.random.default_rng(3).random((3, 9, 11), dtype=np.float32)
    sitk_style = resample_image(volume[None], (3, 14, 7), (5.0, 1.0, 1.0), order=3)[0]
    ours = resample_image(volume[None], (3, 14, 7), (5.0, 1.0, 1.0), order=3, style="skimage")[0]
    assert (sitk_style.max(axis=(1, 2)) > volume.max(axis=(1, 2))).any()  # the cubic spline overshoots
    assert (ours.max(axis=(1, 2)) <= volume.max(axis=(1, 2))).all()
    assert (ours.min(axis=(1, 2)) >= volume.min(axis=(1, 2))).all()


def test_resample_channel_matches_resample_image():
    spacing = (1.0, 2.0, 1.0)
    volume = np.random.default_rng(1).random((3, 6, 7, 8), dtype=np.float32)
    new_shape = (9, 5, 11)
    out = resample_image(volume, new_shape, spacing)
    for c in range(3):
        np.testing.assert_array_equal(resample_channel(volume[c], new_shape, spacing), out[c])


def test_unchanged_shape_returns_input_and_bad_input_raises():
    volume = np.zeros((2, 4, 5, 6), dtype=np.float32)
    assert resample_image(volume, (4, 5, 6), (1.0, 1.0, 1.0)) is volume
    assert resampling_peak_bytes((4, 5, 6), (4, 5, 6), 2) == 0
    with pytest.raises(ValueError, match=r"\(C, Z, Y, X\)"):
        resample_image(volume[0], (4, 5, 6), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="order=7"):
        resample_channel(volume[0], (8, 5, 6), (1.0, 1.0, 1.0), order=7)


@pytest.mark.parametrize(
    ("shape", "spacing", "new_shape", "order", "order_z"),
    [
        ((24, 40, 40), (1.0, 1.0, 1.0), (30, 30, 36), 3, 0),  # 3D, float32 spline coefficients
        ((24, 40, 40), (1.0, 1.0, 1.0), (30, 30, 36), 1, 0),  # 3D linear, no temporaries
        ((12, 40, 40), (4.0, 1.0, 1.0), (30, 50, 50), 3, 0),  # anisotropic: intermediate + slice coeffs
        ((12, 40, 40), (4.0, 1.0, 1.0), (12, 56, 50), 3, 0),  # in-plane only, straight into the output
        ((40, 40, 12), (1.0, 1.0, 4.0), (50, 50, 30), 3, 3),  # out-of-plane x with a cubic along it
    ],
)
@pytest.mark.parametrize("style", ["sitk", "skimage"])
def test_resampling_peak_bytes_bounds_the_measured_peak(shape, spacing, new_shape, order, order_z, style):
    data = np.random.default_rng(0).random((2, *shape), dtype=np.float32)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = resample_image(data, new_shape, spacing, order=order, order_z=order_z, style=style)
        measured = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert out.shape == (2, *new_shape)
    estimate = resampling_peak_bytes(shape, new_shape, 2, spacing, order, order_z, style)
    assert measured <= estimate <= 1.2 * measured
    assert resampling_peak_bytes(shape, new_shape, 2, None, order, order_z, style) >= estimate  # path unknown


def random_labels(shape, values, seed: int) -> np.ndarray:
    """int8 (1, Z, Y, X) blocky label map (2x2x2 blocks) using exactly ``values``."""
    rng = np.random.default_rng(seed)
    coarse = rng.choice(np.asarray(values, dtype=np.int8), size=tuple(n // 2 for n in shape))
    return np.kron(coarse, np.ones((2, 2, 2), dtype=np.int8))[None]


@pytest.mark.parametrize(
    ("order", "order_z", "spacing"), [(0, 0, (1, 1, 1)), (1, 0, (1, 1, 1)), (3, 0, (1, 1, 1)), (3, 1, (4.0, 1, 1))]
)
def test_segmentation_resampling_never_creates_labels(order, order_z, spacing):
    values = (-1, 0, 2, 5)
    seg = random_labels((8, 12, 10), values, seed=order)
    out = resample_segmentation(seg, (11, 7, 15), spacing, order=order, order_z=order_z)
    assert out.shape == (1, 11, 7, 15) and out.dtype == np.int8
    assert set(np.unique(out)) <= set(values)
    assert len(np.unique(out)) == 4


@pytest.mark.parametrize(("order", "new_spacing"), [(1, 1.25), (1, 0.8), (3, 1.6), (0, 1.25)])
def test_segmentation_resampling_preserves_sphere_volume(order, new_spacing):
    # A 14 mm sphere: thresholding interpolated masks cuts the voxel staircase's corners, a surface
    # effect that shrinks with the radius (measured 0.6-2.5% here; 5% at 7 mm, < 0.3% at 28 mm).
    shape, radius_mm = (40, 40, 40), 14.0
    zz, yy, xx = np.indices(shape) - 19.5
    sphere = ((zz**2 + yy**2 + xx**2) <= radius_mm**2).astype(np.int16)[None] * 3
    new_shape = compute_new_shape(shape, (1.0, 1.0, 1.0), (new_spacing,) * 3)
    out = resample_segmentation(sphere, new_shape, (1.0, 1.0, 1.0), order=order)
    assert out.dtype == np.int16 and set(np.unique(out)) == {0, 3}
    volume_before = np.count_nonzero(sphere)  # mm^3 at 1 mm spacing
    effective_spacing = [1.0 * n / m for n, m in zip(shape, new_shape, strict=True)]
    volume_after = np.count_nonzero(out) * np.prod(effective_spacing)
    assert abs(volume_after / volume_before - 1) < 0.04
    # and stays centred: the grids share their physical extent
    centre_out = (np.argwhere(out[0]).mean(axis=0) + 0.5) * np.array(effective_spacing) - 0.5
    np.testing.assert_allclose(centre_out, 19.5, atol=1e-6)


def test_segmentation_nearest_is_exact_for_integer_upsampling_and_float_input_fails():
    seg = random_labels((4, 6, 6), (0, 1, 2), seed=3)
    out = resample_segmentation(seg, (8, 12, 12), (1, 1, 1), order=0)
    np.testing.assert_array_equal(out[:, ::2, ::2, ::2], seg)
    assert resample_segmentation(seg, (4, 6, 6), (1, 1, 1)) is seg
    single = resample_segmentation(np.full((1, 4, 6, 6), -1, np.int8), (3, 9, 5), (1, 1, 1), order=1)
    assert single.shape == (1, 3, 9, 5) and (single == -1).all()
    with pytest.raises(ValueError, match="integer labels"):
        resample_segmentation(seg.astype(np.float32), (8, 12, 12), (1, 1, 1))


@pytest.mark.parametrize(
    ("spacing", "order", "num_labels"), [((1, 1, 1), 1, 3), ((4.0, 1, 1), 1, 4), ((1, 1, 1), 3, 2)]
)
def test_segmentation_peak_bytes_bounds_the_measured_peak(spacing, order, num_labels):
    shape, new_shape = (12, 40, 40), (30, 50, 50)
    seg = random_labels(shape, tuple(range(-1, num_labels - 1)), seed=0)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        resample_segmentation(seg, new_shape, spacing, order=order)
        measured = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    estimate = segmentation_resampling_peak_bytes(shape, new_shape, spacing, order, 0, 1, num_labels)
    assert measured <= estimate <= 1.2 * measured


@pytest.mark.parametrize(
    ("shape", "new_shape", "spacing", "order_z"),
    [
        ((12, 40, 40), (30, 50, 50), (1.0, 1.0, 1.0), 0),
        ((10, 31, 29), (7, 45, 18), (4.0, 1.0, 1.0), 0),
        ((10, 31, 29), (25, 20, 33), (4.0, 1.0, 1.0), 1),
        ((9, 20, 22), (9, 33, 11), (1.0, 1.0, 5.0), 0),
    ],
)
def test_fast_linear_segmentation_resampling_equals_argmax_of_resampled_masks(shape, new_shape, spacing, order_z):
    """The separable, boxed path gives what resampling every label's mask and taking the largest response
    (ties to the smaller label) gives."""
    rng = np.random.default_rng(1)
    seg = random_labels(shape, (-1, 0, 1, 2), seed=3)
    seg[0, : shape[0] // 2] = 0  # a dominant label and small, boxed ones
    seg[0, :, rng.integers(shape[1]), :] = 2
    labels = sorted(int(v) for v in np.unique(seg))
    responses = np.stack(
        [resample_channel((seg[0] == v).astype(np.float32), new_shape, spacing, 1, order_z) for v in labels]
    )
    expected = np.asarray(labels, seg.dtype)[np.argmax(responses, axis=0)]
    out = resample_segmentation(seg, new_shape, spacing, order=1, order_z=order_z)
    near_tie = np.sort(responses, axis=0)[-1] - np.sort(responses, axis=0)[-2] < 1e-5
    assert near_tie.mean() < 0.3  # most voxels are decided, so the comparison means something
    assert np.array_equal(out[0][~near_tie], expected[~near_tie])
    assert set(np.unique(out)) <= set(labels)
