"""Precomputed spatial augmentations: the transform, its memory, the copies preprocessing writes, and the
loader reading them without the on-the-fly spatial transform."""

from __future__ import annotations

import dataclasses
import logging
import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from factories import tiny_plans
from scipy import ndimage

from autoseg.data.augment import Augmenter, build_train_transforms
from autoseg.data.augment_spatial import PatchSpatialTransform
from autoseg.data.loader import BatchLoader
from autoseg.data.sampler import PatchSampler
from autoseg.dataset.raw import load_dataset
from autoseg.plan.training_data import LoaderConfig
from autoseg.preprocess.parallel import PreprocessOptions, preprocess
from autoseg.preprocess.precompute import (
    PrecomputeConfig,
    SpatialParams,
    augment_case,
    augment_case_bytes,
    draw_spatial_params,
    rotation_matrix,
)
from autoseg.preprocess.store import case_files, is_complete, open_case, read_properties


def random_case(shape_zyx: tuple[int, ...] = (9, 11, 11), seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((2, *shape_zyx)).astype(np.float32)
    seg = rng.integers(-1, 3, (1, *shape_zyx)).astype(np.int8)
    return data, seg


def params(angles=(0.0, 0.0, 0.0), scale=1.0, in_plane=False, elastic=0.0, order_seg=1) -> SpatialParams:
    return SpatialParams(
        seed=7,
        in_plane_only=in_plane,
        rotation_rad_zyx=angles,
        scale=scale,
        elastic=elastic > 0,
        elastic_magnitude_vox=elastic,
        elastic_grid_vox=4.0,
        order_seg=order_seg,
    )


def test_identity_reproduces_the_case() -> None:
    data, seg = random_case()
    out_data, out_seg = augment_case(data, seg, params())
    np.testing.assert_allclose(out_data, data, atol=1e-5)
    np.testing.assert_array_equal(out_seg, seg)
    assert out_data.dtype == np.float32 and out_seg.dtype == np.int8


@pytest.mark.parametrize("in_plane", [False, True])
@pytest.mark.parametrize("order_seg", [0, 1])
def test_a_quarter_turn_about_z_is_rot90(in_plane: bool, order_seg: int) -> None:
    data, seg = random_case()
    out_data, out_seg = augment_case(data, seg, params((math.pi / 2, 0, 0), in_plane=in_plane, order_seg=order_seg))
    np.testing.assert_allclose(out_data, np.rot90(data, -1, axes=(2, 3)), atol=1e-5)
    np.testing.assert_array_equal(out_seg, np.rot90(seg, -1, axes=(2, 3)))


def test_rotation_and_scale_match_scipy_affine_transform() -> None:
    data, seg = random_case((14, 20, 18), seed=1)
    p = params((0.3, -0.2, 0.25), scale=1.2)
    out_data, out_seg = augment_case(data, seg, p)
    matrix = p.scale * rotation_matrix(p.rotation_rad_zyx)
    centre = (np.array(data.shape[1:]) - 1) / 2
    offset = centre - matrix @ centre
    for c in range(2):  # scipy: float64 throughout
        reference = ndimage.affine_transform(
            data[c].astype(np.float64), matrix, offset, order=3, mode="constant", cval=0.0
        )
        np.testing.assert_allclose(out_data[c], reference, atol=2e-5)
    nearest = augment_case(data, seg, dataclasses.replace(p, order_seg=0))[1]
    reference_seg = ndimage.affine_transform(seg[0], matrix, offset, order=0, mode="constant", cval=-1)
    assert np.mean(nearest[0] == reference_seg) > 0.999  # float32 positions may round a tie differently


def test_elastic_copies_replay_from_their_params_and_create_no_labels() -> None:
    data, seg = random_case((10, 24, 24), seed=2)
    seg[0, 3:7, 8:16, 8:16] = 2
    for in_plane in (False, True):
        p = params((0.2, 0.1, 0.0), scale=0.9, in_plane=in_plane, elastic=2.0)
        first, again = augment_case(data, seg, p), augment_case(data, seg, p)
        np.testing.assert_array_equal(first[0], again[0])
        np.testing.assert_array_equal(first[1], again[1])
        rigid = augment_case(data, seg, dataclasses.replace(p, elastic=False))
        assert np.abs(first[0] - rigid[0]).max() > 0.1  # the deformation did something
        assert set(np.unique(first[1])) <= set(np.unique(seg)) | {-1}
        if in_plane:  # slices move in-plane only, never mix: slice k comes from slice k alone
            one_slice = augment_case(data[:, 4:5], seg[:, 4:5], p)
            np.testing.assert_allclose(one_slice[0][:, 0], first[0][:, 4], atol=1e-5)


def test_draw_spatial_params_is_seeded_and_in_range() -> None:
    config = PrecomputeConfig(num_copies=1, p_elastic=1.0)
    a = draw_spatial_params(np.random.default_rng(3), config, in_plane_only=False)
    assert a == draw_spatial_params(np.random.default_rng(3), config, in_plane_only=False)
    assert all(abs(v) <= math.radians(config.rotation_deg) for v in a.rotation_rad_zyx)
    assert config.scale_range[0] <= a.scale <= config.scale_range[1] and a.elastic
    b = draw_spatial_params(np.random.default_rng(3), config, in_plane_only=True)
    assert b.rotation_rad_zyx[1:] == (0.0, 0.0) and abs(b.rotation_rad_zyx[0]) <= math.pi
    with pytest.raises(ValueError, match="--precompute-augmentations"):
        PrecomputeConfig(num_copies=-1)


@pytest.mark.parametrize("in_plane", [False, True])
def test_augment_case_bytes_bounds_the_measured_peak(in_plane: bool) -> None:
    data, seg = random_case((20, 48, 40), seed=4)
    p = params((0.2, 0.1, 0.3), scale=1.1, in_plane=in_plane, elastic=2.0)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    tracemalloc.reset_peak()
    augment_case(data, seg, p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    predicted = augment_case_bytes(data.shape[1:], num_channels=2, num_labels=4)
    assert peak <= predicted, (peak, predicted)
    assert peak >= 2 * math.prod(data.shape[1:]) * 4  # at least the output copy's data


@pytest.fixture(scope="module")
def with_copies(tiny_dataset: Path, tmp_path_factory) -> tuple[Path, list[str]]:
    dataset = load_dataset(tiny_dataset)
    dataset = dataclasses.replace(dataset, cases=dataset.cases[:2])
    out = preprocess(
        dataset,
        tiny_plans(),
        "3d_fullres",
        tmp_path_factory.mktemp("copies") / "3d_fullres",
        PreprocessOptions(progress=False, precompute=PrecomputeConfig(num_copies=2, p_elastic=0.5)),
    )
    return out, [c.case_id for c in dataset.cases]


def test_preprocessing_writes_copies_with_their_parameters(with_copies) -> None:
    out, case_ids = with_copies
    for case_id in case_ids:
        assert is_complete(out, case_id, num_copies=2) and not is_complete(out, case_id, 3)
        case = open_case(out, case_id)
        props = case.properties
        data, seg = (np.array(a) for a in case.arrays())
        assert [a.index for a in props.augmentations] == [0, 1] and case.copies == (0, 1)
        assert props.augmentations[0].params != props.augmentations[1].params
        for copy in props.augmentations:
            aug_data, aug_seg = (np.array(a) for a in case.arrays(copy.index))
            assert copy.params.in_plane_only  # z spacing 2.75 mm vs 0.9 in-plane: anisotropic
            replay = augment_case(data, seg, copy.params)  # the recorded parameters reproduce the copy
            np.testing.assert_array_equal(replay[0], aug_data)
            np.testing.assert_array_equal(replay[1], aug_seg)
            assert aug_seg.dtype == np.int8 and set(np.unique(aug_seg)) <= {-1, 0, 1, 2}
            assert copy.class_voxels == tuple(int(np.sum(np.maximum(aug_seg, 0) == k)) for k in range(3))
            rows = np.load(case.files(copy.index).locations)  # (N, 4): class, z, y, x
            assert rows.dtype == np.int32 and set(rows[:, 0]) == {1, 2}
            for label in (1, 2):
                voxels = rows[rows[:, 0] == label, 1:]
                assert len(voxels) == copy.class_voxels[label]  # fewer than 10,000: all of them
                assert np.all(aug_seg[0][tuple(voxels.T)] == label)


def test_a_case_without_the_requested_copies_is_redone(tiny_dataset: Path, tmp_path: Path, caplog) -> None:
    dataset = load_dataset(tiny_dataset)
    dataset = dataclasses.replace(dataset, cases=dataset.cases[:1])
    case_id, plans = dataset.cases[0].case_id, tiny_plans(spacing_mm=(1.5, 1.5, 1.5))
    out = preprocess(dataset, plans, "3d_fullres", tmp_path / "out", PreprocessOptions(progress=False))
    assert not case_files(out, case_id, copy=0).data.exists()
    with caplog.at_level(logging.INFO, logger="autoseg"):
        options = PreprocessOptions(progress=False, precompute=PrecomputeConfig(num_copies=1))
        preprocess(dataset, plans, "3d_fullres", out, options)
    props = read_properties(out, case_id)
    assert len(props.augmentations) == 1 and not props.augmentations[0].params.in_plane_only  # isotropic
    copy_bytes = sum(p.stat().st_size for p in case_files(out, case_id, copy=0))
    assert f"(augmented copies {copy_bytes / 2**20:.1f} MiB)" in caplog.text  # disk use is reported


def test_use_precomputed_drops_the_spatial_transform_only() -> None:
    plain = LoaderConfig(patch_size=(8, 16, 16), batch_size=2)
    precomputed = dataclasses.replace(plain, use_precomputed=True)
    kinds = [type(t) for part in build_train_transforms(precomputed) for t in part.transforms]
    assert PatchSpatialTransform in [type(t) for part in build_train_transforms(plain) for t in part.transforms]
    assert PatchSpatialTransform not in kinds and len(kinds) >= 7  # the intensity transforms stay
    assert Augmenter(precomputed).mirror is not None  # and mirroring, applied while writing the output
    assert precomputed.enlarged_patch_size == (8, 16, 16) != plain.enlarged_patch_size


def test_the_loader_samples_the_case_and_its_copies(with_copies) -> None:
    out, case_ids = with_copies
    config = LoaderConfig(patch_size=(4, 8, 8), batch_size=4, use_precomputed=True, oversample_foreground=0.5)
    sampler = PatchSampler(out, case_ids, config, np.random.default_rng(0))
    seen = set()
    for _ in range(6):
        batch = sampler.sample_batch()
        for i, (case_id, copy) in enumerate(zip(batch["case_ids"], batch["copies"], strict=True)):
            seen.add(copy)
            source = np.load(case_files(out, case_id, copy).data)
            z, y, x = batch["origins"][i]
            if min(z, y, x) >= 0 and z + 4 <= source.shape[1]:  # a box inside the image: equal voxels
                np.testing.assert_array_equal(batch["data"][i], source[:, z : z + 4, y : y + 8, x : x + 8])
    assert seen == {-1, 0, 1}
    validation = dataclasses.replace(config, augment=False)  # validation patches: the cases themselves
    validation_batch = PatchSampler(out, case_ids, validation, np.random.default_rng(0)).sample_batch()
    assert validation_batch["copies"] == [-1] * 4
    with BatchLoader(out, case_ids, config, seed=0) as loader:
        b = next(loader)
    assert tuple(b["data"].shape) == (4, 1, 4, 8, 8) and tuple(b["target"].shape) == (4, 1, 4, 8, 8)
    assert set(b["target"].unique().tolist()) <= {0, 1, 2}
