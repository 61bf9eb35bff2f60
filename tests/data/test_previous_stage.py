"""A cascade stage's batches: the previous stage's label map, read a box at a time beside the image, one-hot as the
last channels; moved with the image by the spatial transform and mirroring, never by the intensity transforms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from factories import SHAPE_ZYX, make_cases

from autoseg.data.augment import Augmenter
from autoseg.data.loader import BatchLoader
from autoseg.data.sampler import PatchSampler
from autoseg.plan.training_data import LoaderConfig
from autoseg.preprocess.store import PreviousStageSource, write_previous_stage

VALUES = (1, 2)


def _previous_maps(folder: Path, case_ids: list[str]) -> dict[str, np.ndarray]:
    """A label map per case whose value at (z, y, x) is (z + y + x) % 3: every patch holds all three values."""
    z, y, x = np.meshgrid(*(np.arange(s) for s in SHAPE_ZYX), indexing="ij")
    maps = {}
    for i, case_id in enumerate(case_ids):
        maps[case_id] = ((z + y + x + i) % 3).astype(np.int8)[None]
        write_previous_stage(
            folder,
            case_id,
            maps[case_id],
            PreviousStageSource(
                label_file=f"{case_id}.nii.gz", label_digest="x", crop_bbox=((0, 1),) * 3, shape_zyx=SHAPE_ZYX
            ),
        )
    return maps


def test_the_sampler_appends_the_one_hot_of_the_box_it_reads(tmp_path: Path) -> None:
    data_dir, previous_dir = tmp_path / "data", tmp_path / "previous"
    data_dir.mkdir()
    ids = make_cases(data_dir, num_cases=2)
    maps = _previous_maps(previous_dir, ids)
    config = LoaderConfig(patch_size=(4, 8, 8), batch_size=3, augment=False, previous_labels=VALUES)
    sampler = PatchSampler(data_dir, ids, config, np.random.default_rng(0), previous_dir)
    assert (sampler.image_channels, sampler.num_channels) == (1, 3)
    batch = sampler.sample_batch()
    assert batch["data"].shape == (3, 3, 4, 8, 8)
    for b, (case_id, origin) in enumerate(zip(batch["case_ids"], batch["origins"], strict=True)):
        box = tuple(slice(max(o, 0), o + s) for o, s in zip(origin, (4, 8, 8), strict=True))
        labels = maps[case_id][0][box]
        inside = tuple(slice(max(-o, 0), max(-o, 0) + n) for o, n in zip(origin, labels.shape, strict=True))
        for k, value in enumerate(VALUES):
            assert np.array_equal(batch["data"][b, 1 + k][inside], (labels == value).astype(np.float32))
    with pytest.raises(ValueError, match="needs their folder"):
        PatchSampler(data_dir, ids, config, np.random.default_rng(0))


def test_intensity_transforms_leave_the_one_hot_channels_alone(tmp_path: Path) -> None:
    data_dir, previous_dir = tmp_path / "data", tmp_path / "previous"
    data_dir.mkdir()
    ids = make_cases(data_dir, num_cases=2)
    _previous_maps(previous_dir, ids)
    always = {
        "p_noise": 1.0,
        "p_blur": 1.0,
        "p_brightness": 1.0,
        "p_contrast": 1.0,
        "p_low_res": 1.0,
        "p_gamma": 1.0,
        "p_gamma_inverted": 1.0,
        "p_rotation": 0.0,
        "p_scale": 0.0,
    }
    config = LoaderConfig(patch_size=(4, 8, 8), batch_size=2, previous_labels=VALUES, mirror_axes=(), **always)
    sampled = PatchSampler(data_dir, ids, config, np.random.default_rng(1), previous_dir).sample_batch()
    before = sampled["data"].copy()
    out = Augmenter(config)(sampled, seed=5)
    assert np.array_equal(out["data"][:, 1:], before[:, 1:])  # the one-hot, untouched
    assert not np.array_equal(out["data"][:, :1], before[:, :1])  # the image, augmented
    with BatchLoader(data_dir, ids, config, seed=0, previous_folder=previous_dir) as loader:
        batch = next(loader)
    assert tuple(batch["data"].shape) == (2, 3, 4, 8, 8)
    assert set(np.unique(batch["data"][:, 1:].numpy())) <= {0.0, 1.0}
