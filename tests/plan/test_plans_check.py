"""A hand-edited plans.json is checked when it is read: a value no stage could run is refused naming the file,
the configuration and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import tiny_plans

from autoseg.core.errors import InputError
from autoseg.plan.plans import Plans


def _edit(tmp_path: Path, edit) -> Path:
    path = tmp_path / "plans.json"
    tiny_plans().to_json(path)
    payload = json.loads(path.read_text())
    edit(payload, payload["configurations"]["3d_fullres"])
    path.write_text(json.dumps(payload))
    return path


EDITS = {
    "batch_size": (lambda p, c: c.update(batch_size=0), "batch_size (0)"),
    "accumulation": (lambda p, c: c.update(accumulation_steps=-1), "accumulation_steps (-1)"),
    "patch_negative": (lambda p, c: c.update(patch_size=[8, -16, 16]), "patch_size (8, -16, 16)"),
    "patch_2d_for_3d": (lambda p, c: c.update(patch_size=[16, 16]), "patch_size (16, 16)"),
    "patch_not_divisible": (lambda p, c: c.update(patch_size=[8, 15, 16]), "multiple of (2, 2, 2)"),
    "precision": (lambda p, c: c.update(precision="fp8"), "precision 'fp8'"),
    "one_stage": (
        lambda p, c: c["network"].update(features_per_stage=[8], kernel_sizes=[[3, 3, 3]], strides=[[1, 1, 1]]),
        "features_per_stage has 1 stage",
    ),
    "even_kernel": (lambda p, c: c["network"]["kernel_sizes"].__setitem__(1, [3, 2, 3]), "kernel_sizes[1]"),
    "outputs": (lambda p, c: c["network"].update(num_outputs=5), "num_outputs 5"),
    "in_channels": (lambda p, c: c["network"].update(in_channels=2), "in_channels 2"),
    "spacing": (lambda p, c: c.update(spacing_mm=[1.0, 0.0, 1.0]), "spacing_mm [1.0, 0.0, 1.0]"),
    "loader_workers": (lambda p, c: c.update(loader_workers=-1), "loader_workers >= 0"),
    "tile_not_divisible": (lambda p, c: c.update(inference_patch_size=[8, 20, 17]), "inference_patch_size [8, 20, 17]"),
    "tile_below_patch": (lambda p, c: c.update(inference_patch_size=[8, 8, 16]), "at least the patch_size [8, 16, 16]"),
    "tile_2d_for_3d": (lambda p, c: c.update(inference_patch_size=[16, 16]), "must have 3 sizes"),
    "normalization_count": (lambda p, c: p.update(normalization=["zscore", "ct"]), "normalization has 2 entries"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_value_no_stage_can_run_is_refused_naming_file_configuration_and_key(name: str, tmp_path: Path) -> None:
    edit, words = EDITS[name]
    path = _edit(tmp_path, edit)
    with pytest.raises(InputError) as info:
        Plans.from_json(path)
    message = str(info.value)
    assert str(path) in message
    assert "configuration '3d_fullres'" in message or name == "normalization_count"
    assert words in message


def test_a_plan_as_written_by_the_planner_passes_the_check(tmp_path: Path) -> None:
    path = _edit(tmp_path, lambda p, c: None)
    assert Plans.from_json(path) == tiny_plans()
