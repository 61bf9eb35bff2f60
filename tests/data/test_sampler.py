from __future__ import annotations

import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from batchgenerators.augmentations.utils import create_zero_centered_coordinate_mesh, rotate_coords_3d
from factories import make_cases, write_case

from autoseg.core.errors import InputError
from autoseg.data.augment import Augmenter
from autoseg.data.augment_spatial import PatchSpatialTransform, draw_patch_transform, read_size
from autoseg.data.loader import BatchLoader
from autoseg.data.sampler import PatchSampler
from autoseg.memory.loader_worker import batch_bytes, batch_bytes_terms
from autoseg.plan.training_data import LoaderConfig, enlarged_patch_size
from autoseg.preprocess.store import case_files, properties_path


def expected_box(data: np.ndarray, origin: tuple[int, ...], size: tuple[int, ...], pad: float) -> np.ndarray:
    """data (C, *S)[origin : origin + size] with ``pad`` outside the array."""
    out = np.full((data.shape[0], *size), pad, dtype=data.dtype)
    src, dst = [], []
    for lo, e, s in zip(origin, size, data.shape[1:], strict=True):
        a, b = max(lo, 0), min(lo + e, s)
        src.append(slice(a, b))
        dst.append(slice(a - lo, b - lo))
    out[(slice(None), *dst)] = data[(slice(None), *src)]
    return out


def test_3d_shapes_dtypes_and_values(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_channels=2)
    config = LoaderConfig((8, 16, 16), batch_size=2)
    sampler = PatchSampler(tmp_path, ids, config, np.random.default_rng(0))
    worst = sampler.enlarged_patch_size
    assert len(worst) == 3 and all(a > p and (a - p) % 2 == 0 for a, p in zip(worst, (8, 16, 16), strict=True))
    boxes = set()
    for _ in range(12):
        batch = sampler.sample_batch()
        e = batch["data"].shape[2:]  # the largest box the batch's transforms need, the patch if none
        needs = [read_size((8, 16, 16), t) for t in batch["transforms"]]
        assert e == tuple(max(n) for n in zip(*needs, strict=True)) and all(a <= w for a, w in zip(e, worst))
        boxes.add(e)
        assert batch["data"].shape == (2, 2, *e) and batch["data"].dtype == np.float32
        assert batch["seg"].shape == (2, 1, *e) and batch["seg"].dtype == np.int8
        for i, need in enumerate(needs):  # the case in the centre part the sample needs, padded 0 / -1
            files = case_files(tmp_path, batch["case_ids"][i])
            full_data, full_seg = np.load(files.data), np.load(files.seg)
            inner = tuple(slice((a - n) // 2, (a - n) // 2 + n) for a, n in zip(e, need, strict=True))
            origin = tuple(o + s.start for o, s in zip(batch["origins"][i], inner, strict=True))
            np.testing.assert_array_equal(
                batch["data"][i][(slice(None), *inner)], expected_box(full_data, origin, need, 0.0)
            )
            np.testing.assert_array_equal(
                batch["seg"][i][(slice(None), *inner)], expected_box(full_seg, origin, need, -1)
            )
            outside = np.ones(e, dtype=bool)
            outside[inner] = False
            assert np.all(batch["data"][i][:, outside] == 0) and np.all(batch["seg"][i][:, outside] == -1)
    assert (8, 16, 16) in boxes and len(boxes) > 1  # untransformed batches read only the patch
    with BatchLoader(tmp_path, ids, config, seed=0) as loader:
        out = next(loader)
    assert out["data"].shape == (2, 2, 8, 16, 16) and out["data"].dtype == torch.float32
    assert out["target"].shape == (2, 1, 8, 16, 16) and out["target"].dtype == torch.int8  # the labels' dtype
    assert set(out["target"].unique().tolist()) <= {0, 1}


def test_rotated_and_scaled_patches_of_a_constant_image_hold_no_padding(tmp_path: Path) -> None:
    """Every sample whose box lies inside the image: the augmented patch is the image's value and label."""
    shape = (30, 60, 60)
    write_case(tmp_path, "flat", np.full((1, *shape), 5.0), np.ones((1, *shape)))
    no_intensity = dict(p_noise=0, p_blur=0, p_brightness=0, p_contrast=0, p_low_res=0, p_gamma=0, p_gamma_inverted=0)
    for patch, dummy_2d in (((8, 12, 16), False), ((4, 16, 12), True), ((16, 12), False)):
        config = LoaderConfig(
            patch,
            batch_size=4,
            dummy_2d=dummy_2d,
            p_rotation=1.0,
            p_scale=1.0,
            oversample_foreground=0.0,
            **no_intensity,
        )
        sampler, augmenter = PatchSampler(tmp_path, ["flat"], config, np.random.default_rng(1)), Augmenter(config)
        inside = 0
        for seed in range(6):
            batch = sampler.sample_batch()
            box, origins = batch["data"].shape[2:], batch["origins"][:, -len(patch) :]
            out = augmenter(batch, seed)
            for i, origin in enumerate(origins):
                if np.all(origin >= 0) and np.all(origin + box <= shape[-len(patch) :]):
                    inside += 1
                    np.testing.assert_allclose(out["data"][i], 5.0, rtol=1e-5)
                    assert np.all(out["target"][i] == 1)
        assert inside >= 8, f"{patch}: only {inside} samples had their box inside the image"


def test_2d_samples_one_slice(tmp_path: Path) -> None:
    ids = make_cases(tmp_path)
    config = LoaderConfig((16, 16), batch_size=4, augment=False)
    batch = PatchSampler(tmp_path, ids, config, np.random.default_rng(1)).sample_batch()
    assert batch["data"].shape == (4, 1, 16, 16) and batch["seg"].shape == (4, 1, 16, 16)
    for i in range(4):
        z, y, x = batch["origins"][i]
        full = np.load(case_files(tmp_path, batch["case_ids"][i]).data)
        np.testing.assert_array_equal(batch["data"][i], expected_box(full[:, z], (y, x), (16, 16), 0.0))
    with BatchLoader(tmp_path, ids, LoaderConfig((16, 16), batch_size=2), seed=0) as loader:
        out = next(loader)
    assert out["data"].shape == (2, 1, 16, 16) and out["target"].shape == (2, 1, 16, 16)
    assert out["target"].min() >= 0


def test_dummy_2d_keeps_z_and_augments_in_plane(tmp_path: Path) -> None:
    ids = make_cases(tmp_path)
    config = LoaderConfig((8, 16, 16), batch_size=2, dummy_2d=True)
    sampler = PatchSampler(tmp_path, ids, config, np.random.default_rng(0))
    assert sampler.enlarged_patch_size[0] == 8 and sampler.enlarged_patch_size[1] > 16
    out = Augmenter(config)(sampler.sample_batch(), seed=3)
    assert out["data"].shape == (2, 1, 8, 16, 16) and out["target"].shape == (2, 1, 8, 16, 16)


def test_padding_when_patch_exceeds_image(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_cases=1, shape_zyx=(4, 10, 10))
    config = LoaderConfig((8, 16, 16), batch_size=4, augment=False, oversample_foreground=0.5)
    batch = PatchSampler(tmp_path, ids, config, np.random.default_rng(0)).sample_batch()
    full_data = np.load(case_files(tmp_path, "case_0").data)
    for i in range(4):
        origin = batch["origins"][i]
        sizes = zip(origin, (8, 16, 16), (4, 10, 10), strict=True)
        assert all(lo <= 0 and lo + p >= s for lo, p, s in sizes)  # the whole image is inside the patch
        inside = batch["data"][i] > 0  # the ramp is >= 1 everywhere inside the image
        assert inside.sum() == full_data.size
        assert np.all(batch["data"][i][~inside] == 0) and np.all(batch["seg"][i][~inside[:1]] == -1)
    target = Augmenter(config)(batch, seed=0)["target"]
    assert target.dtype == np.int8 and target.min() == 0  # -1 (padding, outside the mask) -> 0


@pytest.mark.parametrize("patch_size", [(8, 16, 16), (16, 16)])
def test_oversample_one_puts_foreground_in_every_patch(tmp_path: Path, patch_size: tuple[int, ...]) -> None:
    ids = make_cases(tmp_path, foreground="blob")
    for oversample, expect_all in ((1.0, True), (0.0, False)):
        config = LoaderConfig(patch_size, batch_size=40, augment=False, oversample_foreground=oversample)
        seg = PatchSampler(tmp_path, ids, config, np.random.default_rng(2)).sample_batch()["seg"]
        has_foreground = (seg == 1).reshape(40, -1).any(axis=1)
        assert has_foreground.all() == expect_all, f"oversample={oversample}: {has_foreground.mean():.2f}"


def test_uniform_sampling_matches_volume_fraction(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_cases=3, foreground="scatter")
    volume_fraction = np.mean([(np.load(case_files(tmp_path, c).seg) == 1).mean() for c in ids])
    config = LoaderConfig((8, 16, 16), batch_size=64, augment=False, oversample_foreground=0.0)
    seg = PatchSampler(tmp_path, ids, config, np.random.default_rng(5)).sample_batch()["seg"]
    assert abs((seg == 1).mean() - volume_fraction) < 0.015


def test_case_without_foreground_falls_back_to_uniform(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_cases=1, foreground="none")
    config = LoaderConfig((8, 16, 16), batch_size=4, augment=False, oversample_foreground=1.0)
    seg = PatchSampler(tmp_path, ids, config, np.random.default_rng(0)).sample_batch()["seg"]
    assert seg.shape == (4, 1, 8, 16, 16) and not (seg == 1).any()


def test_same_seed_same_batches_and_replay_from_seed(tmp_path: Path) -> None:
    ids = make_cases(tmp_path)
    config = LoaderConfig((8, 16, 16), batch_size=2, p_rotation=1.0, p_noise=1.0)
    runs = []
    for seed in (7, 7, 8):
        with BatchLoader(tmp_path, ids, config, seed=seed) as loader:
            runs.append([next(loader) for _ in range(3)])
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a["data"], b["data"]) and torch.equal(a["target"], b["target"])
    assert not torch.equal(runs[0][0]["data"], runs[2][0]["data"])

    sampled = PatchSampler(tmp_path, ids, config, np.random.default_rng(0)).sample_batch()
    copy = {"data": sampled["data"].copy(), "seg": sampled["seg"].copy(), "transforms": sampled["transforms"]}
    assert all(t is not None for t in sampled["transforms"])  # the spatial part travels with the batch
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    augmenter = Augmenter(config)
    first, replay = augmenter(sampled, seed=42), augmenter(copy, seed=42)
    np.testing.assert_array_equal(first["data"], replay["data"])
    np.testing.assert_array_equal(first["target"], replay["target"])
    np.testing.assert_array_equal(np.random.get_state()[1], before)  # the caller's global state is untouched


def test_errors_say_what_to_change(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_cases=1)
    properties_path(tmp_path, "case_0").unlink()
    with pytest.raises(InputError, match="case_0.json.*run preprocessing"):
        PatchSampler(tmp_path, ids, LoaderConfig((8, 16, 16), 1), np.random.default_rng(0))
    with pytest.raises(ValueError, match="dummy_2d"):
        LoaderConfig((16, 16), 1, dummy_2d=True)
    with pytest.raises(ValueError, match="mirror_axes"):
        LoaderConfig((16, 16), 1, mirror_axes=(2,))
    with pytest.raises(ValueError, match="patch_size"):
        LoaderConfig((4, 8, 16, 16), 1)


def test_enlarged_patch_size_covers_every_rotation_and_scale() -> None:
    assert enlarged_patch_size((8, 16, 16), 0.0, (1.0, 1.0)) == (8, 16, 16)
    # 2D square, angles up to 90 deg: worst case the diagonal, 15 * sqrt(2) + 1 = 22.2 -> 23 -> even: 24
    assert enlarged_patch_size((16, 16), 90.0, (1.0, 1.0)) == (24, 24)
    assert enlarged_patch_size((16, 16), 90.0, (0.7, 1.4)) == (32, 32)  # 2 * 10.61 * 1.4 + 1 = 30.7 -> 32
    assert enlarged_patch_size((6, 16, 16), 180.0, (0.7, 1.4), dummy_2d=True) == (6, 32, 32)
    patch, size = (8, 16, 24), enlarged_patch_size((8, 16, 24), 30.0, (0.7, 1.4))
    rng = np.random.default_rng(0)
    corners = create_zero_centered_coordinate_mesh(patch)[:, ::7, ::15, ::23]  # the 8 corners
    for _ in range(200):  # batchgenerators' own rotation; the sampled points must stay inside the box
        a = rng.uniform(-math.radians(30), math.radians(30), 3)
        coords = rotate_coords_3d(corners.copy(), *a) * 1.4
        for d in range(3):
            centre = size[d] / 2 - 0.5
            assert 0 <= coords[d].min() + centre and coords[d].max() + centre <= size[d] - 1
    config = LoaderConfig(patch, batch_size=1, p_rotation=1.0, p_scale=1.0)
    draws = [draw_patch_transform(rng, config) for _ in range(2000)]  # what samples read stays within it
    needs = np.array([read_size(patch, t) for t in draws])
    assert np.all(needs <= size) and np.all(needs.max(axis=0) >= np.array(size) - 6)


def test_sample_patches_equals_sample_batch_then_the_spatial_transform(tmp_path: Path) -> None:
    ids = make_cases(tmp_path, num_channels=2)
    config = LoaderConfig((8, 16, 16), batch_size=3, p_rotation=0.7, p_scale=0.7)
    eager = PatchSampler(tmp_path, ids, config, np.random.default_rng(4))
    streamed = PatchSampler(tmp_path, ids, config, np.random.default_rng(4))
    for _ in range(4):
        batch = eager.sample_batch()
        expected = PatchSpatialTransform(config)(data=batch["data"], seg=batch["seg"], transforms=batch["transforms"])
        got = streamed.sample_patches()
        assert got["case_ids"] == batch["case_ids"] and got["transforms"] == [None] * 3
        np.testing.assert_array_equal(got["data"], expected["data"])
        np.testing.assert_array_equal(got["seg"], expected["seg"])


def test_batch_bytes_matches_allocated_buffers_and_peak(tmp_path: Path) -> None:
    """What a worker holds while it builds a batch: the patches, one sample's box at a time, the scratch."""
    ids = make_cases(tmp_path, num_channels=2)
    every = dict(
        p_rotation=1.0,
        p_scale=1.0,
        p_noise=1.0,
        p_blur=1.0,
        p_brightness=1.0,
        p_contrast=1.0,
        p_low_res=1.0,
        p_gamma=1.0,
        p_gamma_inverted=1.0,
    )
    config = LoaderConfig((8, 16, 16), batch_size=2, oversample_foreground=0.0, **every)
    sampler, augmenter = PatchSampler(tmp_path, ids, config, np.random.default_rng(0)), Augmenter(config)
    augmenter(sampler.sample_patches(), seed=0)  # warm up lazy imports and caches
    box = PatchSampler(tmp_path, ids, config, np.random.default_rng(1)).sample_batch()["data"].shape[2:]
    sampler = PatchSampler(tmp_path, ids, config, np.random.default_rng(1))  # the same draws: the largest box
    out = {"data": np.empty((2, 2, 8, 16, 16), np.float32), "target": np.empty((2, 1, 8, 16, 16), np.int8)}
    tracemalloc.start()
    try:
        patches = sampler.sample_patches()
        data, seg = patches["data"], patches["seg"]  # the augmenter takes them over
        augmenter(patches, seed=1, out=out)  # into the shared-memory slot: worker_bytes counts those
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    terms = batch_bytes_terms((8, 16, 16), box, 2, 2)
    assert data.nbytes == terms["augmented_data"] and seg.nbytes == terms["augmented_seg"]
    assert terms["enlarged_data"] == 2 * math.prod(box) * 4  # one sample's box of 2 channels
    estimate = batch_bytes((8, 16, 16), box, 2, 2)
    assert estimate == sum(terms.values())
    assert peak <= estimate <= 1.35 * peak, f"measured peak {peak} B, estimate {estimate} B"
