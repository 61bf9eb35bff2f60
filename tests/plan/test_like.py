"""`autoseg plan --like MODEL`: a dataset of other shapes, spacing, channels and labels planned with a trained
model's network, target spacing and patch; what the budget changes (batch, accumulation, checkpointing) and the
refusal when even the cheapest setting does not fit. The CLI end to end: an imported nnU-Net model's network planned
for the tiny dataset, then trained from its weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from cli_checks import run_cli
from factories import thick_slice_fingerprint

from autoseg.core.errors import InputError
from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.nnunet.importer import import_nnunet
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.like import LIKE_MODEL, PlanTemplate
from autoseg.plan.planner import plan
from autoseg.plan.plans import IntensityProperties, Plans
from autoseg.plan.step_cost import rough_training_peak_bytes

NNUNET = (
    Path(__file__).parents[1] / "fixtures" / "nnunet_model" / "3d_fullres" / "nnUNetTrainer__nnUNetPlans__3d_fullres"
)


def _other_dataset() -> Fingerprint:
    """12 isotropic 1 mm two-channel MRI cases of about 150 x 190 x 170 voxels, five labels: nothing like the
    model's thick-slice CT."""
    cases = tuple(
        CaseFingerprint(f"c{i}", (1.0, 1.0, 1.0), (160 + i, 200, 180), (150 + i, 190, 170), (1000, 100, 10, 5, 5))
        for i in range(12)
    )
    props = IntensityProperties(0.0, 1.0, -1.0, 1.0)
    labels = {"background": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    return Fingerprint("Dataset011_Other", ("MRI", "T2"), labels, ".nii.gz", 3, cases, (props, props), 0.9)


def _like(gib: float, model: Plans) -> Plans:
    budget = Budget(gpu_memory_bytes=int(gib * GiB), cpu_count=8)
    return plan(
        _other_dataset(),
        budget,
        peak_fn=rough_training_peak_bytes,
        like=PlanTemplate("model.zip", model.configurations),
    )


@pytest.fixture(scope="module")
def model() -> Plans:
    """A thick-slice CT model planned for 24 GiB (the memory model's first-order estimate: milliseconds)."""
    return plan(
        thick_slice_fingerprint(), Budget(gpu_memory_bytes=24 * GiB, cpu_count=8), peak_fn=rough_training_peak_bytes
    )


def test_the_models_network_spacing_and_patch_are_kept_for_other_shapes(model: Plans) -> None:
    own = plan(_other_dataset(), Budget(gpu_memory_bytes=24 * GiB, cpu_count=8), peak_fn=rough_training_peak_bytes)
    like = _like(24, model)
    assert set(like.configurations) == set(model.configurations) == {"3d_fullres", "2d"}
    for name, config in like.configurations.items():
        theirs = model.configuration(name)
        assert config.network == dataclasses.replace(theirs.network, in_channels=2, num_outputs=5)
        assert config.patch_size == theirs.patch_size and config.limited_by == LIKE_MODEL
        assert config.network != own.configuration(name).network  # this dataset alone plans another network
        assert "network of model.zip" in config.notes[0] and "--init-from model.zip" in config.notes[0]
    assert like.configuration("3d_fullres").spacing_mm == model.configuration("3d_fullres").spacing_mm
    assert like.configuration("2d").spacing_mm[1:] == model.configuration("2d").spacing_mm[1:]  # z: the slices'
    assert like.configuration("3d_fullres").median_shape_zyx != model.configuration("3d_fullres").median_shape_zyx


def test_a_smaller_budget_checkpoints_and_accumulates_then_is_refused(model: Plans) -> None:
    roomy, tight = (_like(gib, model).configuration("3d_fullres") for gib in (24, 8))
    assert (roomy.batch_size, roomy.accumulation_steps, roomy.checkpointing) == (2, 1, False)
    assert (tight.batch_size, tight.accumulation_steps, tight.checkpointing) == (1, 2, True)
    assert tight.memory["predicted_peak_bytes"] <= 8 * GiB * 0.95
    assert any("do not fit the budget otherwise" in note for note in tight.notes)
    with pytest.raises(InputError, match=r"3d_fullres: the network of model.zip .* give at least --gpu-memory \d+MiB"):
        _like(4, model)


@pytest.mark.slow
def test_cli_plans_like_an_imported_nnunet_model_and_trains_from_it(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    """The tiny dataset (one channel where the model has two) planned like the nnU-Net fixture's 3d_fullres, then a
    fold started from its weights: everything but the first convolution copied."""
    archive = tmp_path / "model.zip"
    import_nnunet(NNUNET, archive)
    workspace = Workspace.at(tmp_path / "ws")
    common = ("--device", "cpu", "--cpu-flops", "1e10", "--ram", "4GiB", "-w", workspace.root)
    result = run_cli(capsys, "plan_and_preprocess", tiny_dataset, *common, "--like", archive, "-c", "3d_fullres")
    assert result.status == 0, result.err
    config = Plans.from_json(workspace.plans_path).configuration("3d_fullres")
    with open(NNUNET / "plans.json") as f:
        theirs = json.load(f)["configurations"]["3d_fullres"]
    assert list(config.patch_size) == theirs["patch_size"]
    assert list(config.network.features_per_stage) == theirs["architecture"]["arch_kwargs"]["features_per_stage"]
    assert config.network.in_channels == 1 and config.limited_by == LIKE_MODEL
    args = ("--epochs", "1", "--iterations-per-epoch", "1", "--val-iterations", "1", "--no-validation")
    result = run_cli(
        capsys, "train", "fold", "0", "-w", workspace.root, "--device", "cpu", *args, "--init-from", archive
    )
    assert result.status == 0, result.err
    init = json.loads((workspace.results("3d_fullres", 0) / "run.json").read_text())["init"]
    assert (init["kind"], init["reinitialised"]) == ("archive", ["encoder.0.0.0"]) and init["encoder_share"] > 0.99
    shutil.rmtree(workspace.root)
