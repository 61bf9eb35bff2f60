"""`autoseg import-nnunet` on tests/fixtures/nnunet_model (tiny nnU-Net v2 models made by
benchmarks/_nnunet_fixture.py, with nnU-Net's own predictions): the imported network computes nnU-Net's logits, the
archive predicts what nnU-Net predicted, and what autoseg cannot reproduce is refused naming the file. No nnunetv2
import: its files are read."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_checks import assert_refused, run_cli
from nnunet_fixture import CASES, FIXTURE, agreement, copied, edit_plans, model_folder, older_layout

from autoseg.cli.main import main
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import read_image
from autoseg.nnunet.checkpoint import read_nnunet_checkpoint
from autoseg.nnunet.folder import read_model_folder
from autoseg.nnunet.importer import import_nnunet
from autoseg.plan.plans import Plans
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.networks import check_trained_with, load_trained_network
from autoseg.preprocess.plan_fields import model_input_fields
from autoseg.preprocess.preprocessor import preprocess_case

CONFIGS = ("3d_fullres", "2d")
WEIGHTS = "fold_0/checkpoint_final.pth"


@pytest.fixture(scope="module", params=CONFIGS)
def imported(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("imported") / f"{request.param}.zip"
    import_nnunet(model_folder(request.param), out)
    return request.param, out


def test_the_imported_network_computes_nnunets_logits(imported) -> None:
    config, archive = imported
    check = np.load(FIXTURE / config / "network_check.npz")
    with open_model_archive(archive) as model:
        plans = Plans.from_json(model.workspace.plans_path)
        path = model.workspace.checkpoint(config, 0, "final")
        network = load_trained_network(path, plans, plans.configuration(config), "cpu")
    network.deep_supervision = False
    with torch.no_grad():
        logits = network(torch.from_numpy(check["input"])).numpy()
    assert np.abs(logits - check["logits"]).max() <= 1e-5 * np.abs(check["logits"]).max()


@pytest.fixture(scope="module", params=["streamed", "with probabilities"])
def predicted(imported, tmp_path_factory, request) -> tuple[str, Path]:
    """The fixture's test cases predicted by ``predict -m`` with nnU-Net's mirroring (all axes): the label maps
    exported slab by slab, or with the probabilities kept (the whole-image export)."""
    config, archive = imported
    out = tmp_path_factory.mktemp("predicted")
    argv = ["-q", "predict", "-m", str(archive), "-i", str(FIXTURE / "imagesTs"), "-o", str(out)]
    kept = ["--save-probabilities"] if request.param == "with probabilities" else []
    assert main([*argv, "--tta", "all", "--runtime", "torch", *kept]) == 0
    return config, out


def test_predict_m_reproduces_nnunets_predictions(predicted) -> None:
    """Both cases, demo_006 resampled in-plane, agree to the issue's bar: the imported plan resamples the averaged
    logits back and takes their argmax, as nnU-Net does (``Plans.export_space`` "logits"; resampling the
    probabilities instead flipped 1 of 31 and 5 of 305 foreground voxels of demo_006)."""
    config, out = predicted
    for case in CASES:
        ours = read_image(out / f"{case}.nii.gz")[0]
        theirs = read_image(FIXTURE / config / "predictions" / f"{case}.nii.gz")[0]
        agree, dice = agreement(ours, theirs, range(1, 3))
        assert agree >= 0.99 and min(dice) >= 0.99, (case, agree, dice)


def test_probabilities_agree_with_nnunets(predicted) -> None:
    """The softmax of the resampled logits, as nnU-Net writes it, within the fixture's float16."""
    config, out = predicted
    if out.name.startswith("predicted") and not any(out.glob("*.npz")):  # streamed: the label maps alone
        labels = sorted(p.name for p in out.iterdir() if p.name.endswith(".nii.gz"))
        assert labels == [f"{case}.nii.gz" for case in CASES]
        return
    for case in CASES:
        with np.load(out / f"{case}.npz") as ours, np.load(FIXTURE / config / "predictions" / f"{case}.npz") as theirs:
            difference = np.abs(ours["probabilities"].astype(np.float32) - theirs["probabilities"].astype(np.float32))
        assert difference.max() <= 2e-3, case


def test_the_plan_reproduces_nnunets_preprocessing_settings() -> None:
    model = read_model_folder(model_folder("3d_fullres"))
    plans, nnunet = model.plans, json.loads((model_folder("3d_fullres") / "plans.json").read_text())
    config = plans.configuration("3d_fullres")
    assert plans.normalization == ("ct", "zscore")  # CTNormalization, ZScoreNormalization
    assert plans.use_nonzero_mask == (False, True)
    fingerprint = json.loads((model_folder("3d_fullres") / "dataset_fingerprint.json").read_text())
    assert plans.intensity_properties[0].percentile_99_5 == pytest.approx(
        fingerprint["foreground_intensity_properties_per_channel"]["0"]["percentile_99_5"]
    )
    assert list(config.spacing_mm) == pytest.approx(nnunet["configurations"]["3d_fullres"]["spacing"])
    assert model.folds == (0,)


def test_the_older_plans_layout_gives_the_same_network(tmp_path: Path) -> None:
    folder = copied("3d_fullres", tmp_path)
    edit_plans(folder, older_layout("PlainConvUNet", "n_conv_per_stage"))
    old = read_model_folder(folder).plans.configuration("3d_fullres").network
    assert old == read_model_folder(model_folder("3d_fullres")).plans.configuration("3d_fullres").network


def _edit_plans(folder: Path, edit) -> None:
    plans = json.loads((folder / "plans.json").read_text())
    edit(plans["configurations"][folder.name.rsplit("__", 1)[-1]])
    (folder / "plans.json").write_text(json.dumps(plans))


def test_an_unsupported_network_class_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    folder = copied("3d_fullres", tmp_path)
    residual = "dynamic_network_architectures.architectures.residual_unet.ResidualUNet"  # residual decoder too
    _edit_plans(folder, lambda c: c["architecture"].update(network_class_name=residual))
    result = run_cli(capsys, "import-nnunet", folder, "-o", tmp_path / "model.zip")
    assert_refused(result, 2, folder / "plans.json", "ResidualUNet", "is not supported")
    assert not (tmp_path / "model.zip").exists()


def test_layers_autoseg_does_not_build_are_refused(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    _edit_plans(folder, lambda c: c["architecture"]["arch_kwargs"].update(norm_op="torch.nn.BatchNorm2d"))
    with pytest.raises(InputError, match="norm_op torch.nn.BatchNorm2d"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_a_missing_checkpoint_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    folder = model_folder("2d")
    result = run_cli(capsys, "import-nnunet", folder, "-o", tmp_path / "model.zip", "--folds", "0", "3")
    assert_refused(result, 2, folder / "fold_3" / "checkpoint_final.pth", "no such checkpoint")
    assert not (tmp_path / "model.zip").exists()


def test_a_checkpoint_with_a_wrong_key_is_refused_naming_it(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    state = read_nnunet_checkpoint(folder / WEIGHTS)
    weights = state["network_weights"]
    weights["decoder.seg_layers.7.weight"] = weights.pop("decoder.seg_layers.1.weight")
    torch.save(state, folder / WEIGHTS)
    with pytest.raises(InputError, match=r"no weight for seg_heads\.0\.weight"):
        import_nnunet(folder, tmp_path / "model.zip")
    weights["decoder.attention.0.weight"] = weights.pop("decoder.seg_layers.7.weight")
    torch.save(state, folder / WEIGHTS)
    with pytest.raises(InputError, match=r"decoder\.attention\.0\.weight belong to no module"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_plans_and_checkpoint_that_disagree_are_refused(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    _edit_plans(folder, lambda c: c["architecture"]["arch_kwargs"].update(features_per_stage=[8, 16, 32]))
    with pytest.raises(InputError, match="the checkpoint and plans.json disagree"):
        import_nnunet(folder, tmp_path / "model.zip")


class _Payload:
    """An object whose unpickling would create ``marker``: what a crafted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_pickles_an_object_is_refused_unrun(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    state = read_nnunet_checkpoint(folder / WEIGHTS)
    marker = tmp_path / "code_ran"
    torch.save({**state, "payload": _Payload(marker)}, folder / WEIGHTS)
    with pytest.raises(InputError, match="refused: it pickles objects"):
        import_nnunet(folder, tmp_path / "model.zip")
    assert not marker.exists()


def test_a_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="not a readable checkpoint"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_a_missing_plans_file_is_refused_naming_it(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    (folder / "dataset_fingerprint.json").unlink()
    with pytest.raises(InputError, match="dataset_fingerprint.json: missing"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_a_configuration_not_supported_is_refused(tmp_path: Path) -> None:
    folder = copied("3d_fullres", tmp_path)
    plans = json.loads((folder / "plans.json").read_text())
    plans["configurations"]["3d_verylowres"] = {"inherits_from": "3d_fullres"}
    (folder / "plans.json").write_text(json.dumps(plans))
    other = folder.rename(tmp_path / "nnUNetTrainer__nnUNetPlans__3d_verylowres")
    with pytest.raises(InputError, match="'3d_verylowres' is not supported"):
        import_nnunet(other, tmp_path / "model.zip")


def test_the_imported_plan_resamples_as_nnunet_and_its_checkpoints_say_so(imported) -> None:
    """The plan carries nnU-Net's image resampling; the checkpoints record it, so a plans.json edited back to
    autoseg's own is refused; a plan with autoseg's own records nothing (records made before the field existed
    match)."""
    config, archive = imported
    with open_model_archive(archive) as model:
        plans = Plans.from_json(model.workspace.plans_path)
        path = model.workspace.checkpoint(config, 0, "final")
        state = torch.load(path, weights_only=True)
    assert plans.image_resampling == "skimage" and plans.gaussian_centre == "floor"  # nnU-Net's importance map
    own = replace(plans, image_resampling="sitk")
    with pytest.raises(InputError, match="image_resampling: 'skimage' -> None"):
        check_trained_with(state, own, own.configuration(config), path)
    assert "image_resampling" not in model_input_fields(own, config)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_preprocessing_reproduces_nnunets(config: str, case: str) -> None:
    """Cropped, normalized (CT and z-score) and resampled (demo_006, in-plane) as nnU-Net's DefaultPreprocessor
    did it for the fixture."""
    model = read_model_folder(model_folder(config))
    channels = [read_image(FIXTURE / "imagesTs" / f"{case}_{c:04d}.nii.gz") for c in range(2)]
    data = np.stack([image for image, _ in channels]).astype(np.float32)
    plan = model.plans.configuration(config)
    ours, _, _ = preprocess_case(data, None, channels[0][1], model.plans, plan, case)
    theirs = np.load(FIXTURE / config / "predictions" / f"{case}_preprocessed.npz")["data"]
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


# transpose_forward -> the permutation of a network's (B, C, *spatial) input that puts nnU-Net's transposed axes in
# the image's own order (worked out by hand: transposed axis i is image axis transpose_forward[i])
TRANSPOSES = {"3d_fullres": ([2, 0, 1], (0, 1, 3, 4, 2)), "2d": ([0, 2, 1], (0, 1, 3, 2))}


@pytest.mark.parametrize("config", CONFIGS)
def test_a_transposed_model_is_imported_in_the_images_own_axis_order(config: str, tmp_path: Path) -> None:
    """nnU-Net runs a model planned with ``transpose_forward`` on transposed images: the imported network, run on the
    image as it is, gives nnU-Net's logits transposed back; its patch and spacing are in the image's order too."""
    folder = copied(config, tmp_path)
    plans = json.loads((folder / "plans.json").read_text())
    forward, to_image = TRANSPOSES[config]
    plans["transpose_forward"] = forward
    (folder / "plans.json").write_text(json.dumps(plans))
    out = tmp_path / "model.zip"
    import_nnunet(folder, out)
    check = np.load(FIXTURE / config / "network_check.npz")
    with open_model_archive(out) as model:
        imported = Plans.from_json(model.workspace.plans_path)
        path = model.workspace.checkpoint(config, 0, "final")
        network = load_trained_network(path, imported, imported.configuration(config), "cpu")
    network.deep_supervision = False
    with torch.no_grad():
        logits = network(torch.from_numpy(check["input"]).permute(to_image)).numpy()
    expected = np.transpose(check["logits"], to_image)
    assert np.abs(logits - expected).max() <= 1e-5 * np.abs(expected).max()
    patch = plans["configurations"][config]["patch_size"]
    assert imported.configuration(config).patch_size == tuple(patch[a - 2] for a in to_image[2:])


def test_a_2d_model_sliced_along_another_axis_is_refused(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    plans = json.loads((folder / "plans.json").read_text())
    plans["transpose_forward"] = [1, 0, 2]
    (folder / "plans.json").write_text(json.dumps(plans))
    with pytest.raises(
        InputError, match=r"transpose_forward \[1, 0, 2\] slices the 2D configuration along image axis 1"
    ):
        import_nnunet(folder, tmp_path / "model.zip")


def test_fold_all_and_a_subset_of_folds_are_imported(tmp_path: Path) -> None:
    folder = copied("2d", tmp_path)
    shutil.copytree(folder / "fold_0", folder / "fold_all")
    assert import_nnunet(folder, tmp_path / "both.zip").folds == (0, "all")
    assert import_nnunet(folder, tmp_path / "all.zip", folds=["all"]).folds == ("all",)
    with open_model_archive(tmp_path / "all.zip") as model:
        assert model.workspace.checkpoint("2d", "all", "final").is_file()


def test_a_trainer_that_mirrors_fewer_axes_is_warned_about(tmp_path: Path, caplog) -> None:
    folder = copied("2d", tmp_path)
    state = read_nnunet_checkpoint(folder / WEIGHTS)
    torch.save({**state, "inference_allowed_mirroring_axes": (1,)}, folder / WEIGHTS)
    with caplog.at_level("WARNING", logger="autoseg"):
        import_nnunet(folder, tmp_path / "model.zip")
    assert "mirrors axes (1,) only at inference" in caplog.text


def test_an_alias_that_differs_from_its_weight_is_refused(tmp_path: Path) -> None:
    """nnU-Net's state dict names each conv and norm twice more (all_modules, decoder.encoder); they must agree."""
    folder = copied("2d", tmp_path)
    state = read_nnunet_checkpoint(folder / WEIGHTS)
    alias = "encoder.stages.1.0.convs.0.all_modules.1.weight"  # the norm's weight
    state["network_weights"][alias] = state["network_weights"][alias] + 1
    torch.save(state, folder / WEIGHTS)
    with pytest.raises(InputError, match=f"weight {alias} differs from encoder.stages.1.0.convs.0.norm.weight"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_a_plans_json_without_a_patch_is_refused_naming_it(tmp_path: Path) -> None:
    folder = copied("3d_fullres", tmp_path)
    _edit_plans(folder, lambda c: c.pop("patch_size"))
    with pytest.raises(InputError, match=r"configuration '3d_fullres': no patch_size list"):
        import_nnunet(folder, tmp_path / "model.zip")
