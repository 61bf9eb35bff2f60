"""The per-sample spatial transform (what it reads, where it samples) and the separable low-resolution
simulation against batchgenerators'."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from batchgenerators.transforms.color_transforms import GammaTransform
from batchgenerators.transforms.noise_transforms import GaussianBlurTransform
from batchgenerators.transforms.resample_transforms import SimulateLowResolutionTransform
from batchgenerators.transforms.spatial_transforms import MirrorTransform, SpatialTransform
from scipy import ndimage

from autoseg.data.augment import (
    Augmenter,
    Gamma,
    GaussianBlur,
    GaussianNoise,
    Mirror,
    SimulateLowResolution,
)
from autoseg.data.augment_spatial import PatchTransform, draw_patch_transform, read_size, spatial_transform
from autoseg.plan.training_data import LoaderConfig

EVERY_SPATIAL = dict(p_rotation=1.0, p_scale=1.0)


def _transformed(
    config: LoaderConfig, transform: PatchTransform | None, box: tuple[int, ...], need: tuple[int, ...] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Run spatial_transform on a box of padding (0 / -1) whose centred ``need`` region (default: the
    ``read_size``) holds the constant 7.0 / label 1 (2 at the centre): any sample taken outside shows."""
    need = need or read_size(config.patch_size, transform, config.dummy_2d)
    data = np.zeros((1, *box), dtype=np.float32)
    seg = np.full((1, *box), -1, dtype=np.int8)
    inner = (slice(None), *(slice((b - n) // 2, (b - n) // 2 + n) for b, n in zip(box, need, strict=True)))
    data[inner], seg[inner] = 7.0, 1
    seg[(slice(None), *(slice(b // 2 - 1, b // 2 + 1) for b in box))] = 2  # so that labels are interpolated
    out_data = np.empty((1, *config.patch_size), dtype=np.float32)
    out_seg = np.empty((1, *config.patch_size), dtype=np.int8)
    spatial_transform(data, seg, transform, config, out_data, out_seg)
    return out_data, out_seg


@pytest.mark.parametrize(
    "patch, dummy_2d, order, order_seg",
    [
        ((6, 10, 14), False, 1, 1),
        ((6, 10, 14), False, 3, 0),
        ((4, 14, 10), True, 1, 1),
        ((12, 16), False, 0, 0),
        ((12, 16), False, 3, 1),
    ],
)
def test_every_transform_samples_only_its_read_box(
    patch: tuple[int, ...], dummy_2d: bool, order: int, order_seg: int
) -> None:
    config = LoaderConfig(
        patch, batch_size=1, dummy_2d=dummy_2d, order_data=order, order_seg=order_seg, **EVERY_SPATIAL
    )
    worst = config.enlarged_patch_size
    rng = np.random.default_rng(0)
    draws = [draw_patch_transform(rng, config) for _ in range(40)]
    a = math.radians(config.rotation_deg_effective)  # the extremes of the ranges too
    n = 1 if (len(patch) == 2 or dummy_2d) else 3
    draws += [PatchTransform((s * a,) * n, f) for s in (-1, 1) for f in config.scale_range]
    for transform in draws:
        need = read_size(patch, transform, dummy_2d)
        assert all(p <= e <= w and (e - p) % 2 == 0 for p, e, w in zip(patch, need, worst, strict=True))
        out_data, out_seg = _transformed(config, transform, worst)
        np.testing.assert_allclose(out_data, 7.0, rtol=1e-5, err_msg=str(transform))
        assert set(np.unique(out_seg).tolist()) <= {1, 2}, transform  # no padding (-1), no background


def test_read_box_is_tight() -> None:
    """One voxel less of image on each side of the read box, and the rotated patch's corners reach padding."""
    config = LoaderConfig((16, 16), batch_size=1)
    transform = PatchTransform((math.pi / 4,), 1.4)
    need = read_size(config.patch_size, transform)
    assert need == (32, 32)  # half span 7.5 * sqrt(2) * 1.4 = 14.85: 2 * 14.85 + 1 = 30.7 -> 31 -> even: 32
    out_data, _ = _transformed(config, transform, need, need=(30, 30))
    assert out_data.min() < 6.0  # the corner voxels, 0.35 of the way to the padding
    out_data, out_seg = _transformed(config, transform, need)
    assert out_data.min() == pytest.approx(7.0) and set(np.unique(out_seg).tolist()) == {1, 2}


def test_no_transform_is_a_centre_crop_and_quarter_turn_is_exact() -> None:
    config = LoaderConfig((5, 7), batch_size=1)
    ramp = np.arange(81, dtype=np.float32).reshape(1, 9, 9)
    labels = (np.arange(81).reshape(1, 9, 9) % 3).astype(np.int8)
    out_data, out_seg = np.empty((1, 5, 7), np.float32), np.empty((1, 5, 7), np.int8)
    spatial_transform(ramp, labels, None, config, out_data, out_seg)
    np.testing.assert_array_equal(out_data[0], ramp[0, 2:7, 1:8])
    np.testing.assert_array_equal(out_seg[0], labels[0, 2:7, 1:8])
    turn = PatchTransform((math.pi / 2,), 1.0)  # output offset (dy, dx) samples (dy, dx) @ R = (dx, -dy)
    assert read_size((5, 7), turn) == (7, 7)  # the rotated patch spans (7, 5); each axis at least the patch
    spatial_transform(ramp[:, 1:8, 1:8], labels[:, 1:8, 1:8], turn, config, out_data, out_seg)
    dy, dx = np.meshgrid(np.arange(5) - 2, np.arange(7) - 3, indexing="ij")
    np.testing.assert_allclose(out_data[0], ramp[0][4 + dx, 4 - dy], atol=1e-3)
    np.testing.assert_array_equal(out_seg[0], labels[0][4 + dx, 4 - dy])


def test_rotation_and_scale_follow_batchgenerators_convention() -> None:
    """The same angles and scale as batchgenerators' SpatialTransform sample the same points (linear)."""
    angles, scale, patch = (0.3, -0.2, 0.25), 1.2, (6, 10, 14)
    config = LoaderConfig(patch, batch_size=1)
    transform = PatchTransform(angles, scale)
    box = read_size(patch, transform)
    z, y, x = np.meshgrid(*(np.linspace(0, 3, n) for n in box), indexing="ij")
    data = (np.sin(z) + np.cos(1.3 * y) * x).astype(np.float32)[None]  # smooth, so interpolation agrees
    ours = np.empty((1, *patch), np.float32)
    spatial_transform(data, np.zeros(data.shape, np.int8), transform, config, ours, np.empty((1, *patch), np.int8))
    theirs = SpatialTransform(
        patch,
        patch_center_dist_from_border=None,
        do_elastic_deform=False,
        angle_x=(angles[0],) * 2,
        angle_y=(angles[1],) * 2,
        angle_z=(angles[2],) * 2,
        scale=(scale, scale),
        random_crop=False,
        order_data=1,
        p_rot_per_sample=1,
        p_scale_per_sample=1,
    )(data=data[None].astype(np.float64))["data"][0]
    np.testing.assert_allclose(ours, theirs, atol=2e-4)


def test_labels_take_the_largest_linear_response_with_outside_as_background() -> None:
    config = LoaderConfig((12, 12), batch_size=1)
    transform = PatchTransform((0.4,), 1.1)
    box = read_size((12, 12), transform)
    rng = np.random.default_rng(3)
    seg = np.kron(rng.integers(-1, 3, size=(5, 5)), np.ones((4, 4), dtype=int))[: box[0], : box[1]]
    out_seg = np.empty((1, 12, 12), np.int8)
    spatial_transform(
        np.zeros((1, *box), np.float32),
        seg[None].astype(np.int8),
        transform,
        config,
        np.empty((1, 12, 12), np.float32),
        out_seg,
    )
    offsets = np.stack(np.meshgrid(np.arange(12) - 5.5, np.arange(12) - 5.5, indexing="ij"))
    positions = np.einsum("ij,jyx->iyx", transform.matrix(), offsets) + ((np.array(box) - 1) / 2)[:, None, None]
    background = np.maximum(seg, 0)  # -1 (outside) and 0 are both background for the network
    responses = np.stack(
        [ndimage.map_coordinates((background == k).astype(float), positions, order=1) for k in range(3)]
    )
    top_two = np.sort(responses, axis=0)[-2:]
    clear = top_two[1] - top_two[0] > 1e-3  # no near-tie
    assert clear.mean() > 0.8 and len(np.unique(out_seg)) == 3
    np.testing.assert_array_equal(out_seg[0][clear], responses.argmax(axis=0)[clear])


@pytest.mark.parametrize("shape, ignore_axes", [((6, 20, 24), (0,)), ((10, 12, 9), None), ((30, 26), None)])
def test_low_resolution_matches_batchgenerators(shape: tuple[int, ...], ignore_axes: tuple[int, ...] | None) -> None:
    rng = np.random.default_rng(0)
    data = rng.normal(size=(3, 2, *shape)).astype(np.float32)
    kwargs = dict(p_per_sample=1.0, p_per_channel=0.5, ignore_axes=ignore_axes)
    np.random.seed(5)
    ours = SimulateLowResolution((0.5, 1.0), order_upsample=3, **kwargs)(data=data.copy())["data"]
    np.random.seed(5)
    theirs = SimulateLowResolutionTransform(
        (0.5, 1.0), per_channel=True, order_downsample=0, order_upsample=3, **kwargs
    )(data=data.copy())["data"]
    assert not np.array_equal(theirs, data)  # some channels were resampled
    np.testing.assert_allclose(ours, theirs, atol=2e-5)


@pytest.mark.parametrize("invert", [False, True])
def test_gamma_matches_batchgenerators(invert: bool) -> None:
    data = np.random.default_rng(1).normal(2.0, 3.0, size=(3, 2, 6, 10, 12)).astype(np.float32)
    np.random.seed(4)
    ours = Gamma((0.7, 1.5), invert_image=invert, p_per_sample=0.7)(data=data.copy())["data"]
    np.random.seed(4)
    theirs = GammaTransform((0.7, 1.5), invert_image=invert, per_channel=True, retain_stats=True, p_per_sample=0.7)(
        data=data.copy()
    )["data"]
    assert not np.allclose(theirs, data)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(3, 2, 9, 10, 12), (4, 1, 2, 10, 12), (3, 2, 16, 20)])
def test_gaussian_blur_matches_batchgenerators(shape: tuple[int, ...]) -> None:
    """The same draws and values; the thin (2-slice) case takes scipy's path along its first axis."""
    data = np.random.default_rng(3).normal(0.0, 1.0, size=shape).astype(np.float32)
    runs = []
    for transform in (
        GaussianBlur((0.5, 1.0), p_per_sample=0.9, p_per_channel=0.7),
        GaussianBlurTransform((0.5, 1.0), different_sigma_per_channel=True, p_per_sample=0.9, p_per_channel=0.7),
    ):
        np.random.seed(5)
        random.seed(5)
        runs.append(transform(data=data.copy())["data"])
    ours, theirs = runs
    assert not np.allclose(theirs, data)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape, axes", [((2, 1, 4, 5, 6), (0, 1, 2)), ((3, 2, 5, 6), (0, 1)), ((4, 1, 3, 4, 5), (1, 2))]
)
def test_mirror_matches_batchgenerators(shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
    data = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    seg = (data % 3).astype(np.int8)[:, :1]
    np.random.seed(2)
    ours = Mirror(axes)(data=data.copy(), seg=seg.copy())
    np.random.seed(2)
    theirs = MirrorTransform(axes)(data=data.copy(), seg=seg.copy())
    np.testing.assert_array_equal(ours["data"], theirs["data"])
    np.testing.assert_array_equal(ours["seg"], theirs["seg"])


def test_augmenter_mirrors_while_writing_its_output() -> None:
    """Only mirroring on: each sample comes out as its input flipped along some axes (the target -1 -> 0),
    written into the given buffers; over the seeds every axis is flipped sometimes and sometimes not."""
    off = dict(
        p_rotation=0.0,
        p_scale=0.0,
        p_noise=0.0,
        p_blur=0.0,
        p_brightness=0.0,
        p_contrast=0.0,
        p_low_res=0.0,
        p_gamma=0.0,
        p_gamma_inverted=0.0,
    )
    config = LoaderConfig((4, 6, 8), batch_size=2, **off)
    data = np.arange(2 * 4 * 6 * 8, dtype=np.float32).reshape(2, 1, 4, 6, 8)
    seg = (data % 3 - 1).astype(np.int8)
    seen: set[tuple[bool, ...]] = set()
    for seed in range(12):
        out = {"data": np.empty_like(data), "target": np.empty_like(seg)}
        got = Augmenter(config)({"data": data.copy(), "seg": seg.copy(), "transforms": None}, seed, out=out)
        assert got is out
        for b in range(2):
            flipped = next(
                f
                for f in itertools.product((False, True), repeat=3)
                if np.array_equal(out["data"][b], np.flip(data[b], [1 + a for a in range(3) if f[a]]))
            )
            axes = [1 + a for a in range(3) if flipped[a]]
            np.testing.assert_array_equal(out["target"][b], np.maximum(np.flip(seg[b], axes), 0))
            seen.add(flipped)
    assert all({f[a] for f in seen} == {False, True} for a in range(3))


def test_gaussian_noise_replays_and_has_the_drawn_spread() -> None:
    data = np.zeros((2, 1, 20, 30, 30), dtype=np.float32)
    runs = []
    for _ in range(2):
        np.random.seed(9)
        random.seed(9)
        runs.append(GaussianNoise((0.05, 0.1), p_per_sample=1.0)(data=data.copy())["data"])
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].dtype == np.float32 and all(0.045 < s.std() < 0.105 for s in runs[0])
