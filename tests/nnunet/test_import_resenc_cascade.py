"""`autoseg import-nnunet` of nnU-Net's ResidualEncoderUNet (nnUNetResEncUNetMPlans), 3d_lowres and the cascade
(3d_lowres -> 3d_cascade_fullres, ``--previous-stage``) on tests/fixtures/nnunet_model: the imported networks
compute nnU-Net's logits, the archives predict what nnU-Net predicted, and what autoseg cannot reproduce is refused
naming it. No nnunetv2 import: its files are read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_checks import assert_refused, run_cli
from nnunet_fixture import CASES, FIXTURE, agreement, copied, edit_plans, model_folder, older_layout

from autoseg.cli.main import main
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import read_image
from autoseg.model.residual import ResidualEncoderUNet
from autoseg.nnunet.checkpoint import read_nnunet_checkpoint
from autoseg.nnunet.folder import read_model_folder
from autoseg.nnunet.importer import import_nnunet
from autoseg.plan.plans import Plans
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.networks import load_trained_network

RESENC = "resenc_3d_fullres"
FOLD = {RESENC: 0, "3d_lowres": "all", "3d_cascade_fullres": "all"}
CONFIG = {RESENC: "3d_fullres", "3d_lowres": "3d_lowres", "3d_cascade_fullres": "3d_cascade_fullres"}


def _import(name: str, out: Path) -> Path:
    previous = model_folder("3d_lowres") if name == "3d_cascade_fullres" else None
    import_nnunet(model_folder(name), out, previous_stage=previous)
    return out


@pytest.fixture(scope="module", params=list(FOLD))
def imported(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _import(request.param, tmp_path_factory.mktemp("imported") / f"{request.param}.zip")


def _network(archive: Path, config: str, fold: int | str) -> torch.nn.Module:
    with open_model_archive(archive) as model:
        plans = Plans.from_json(model.workspace.plans_path)
        path = model.workspace.checkpoint(config, fold, "final")
        network = load_trained_network(path, plans, plans.configuration(config), "cpu")
    network.deep_supervision = False
    return network


def test_the_imported_network_computes_nnunets_logits(imported) -> None:
    """ResEnc (BasicBlockD's bias-free skip convs as zero biases), 3d_lowres and the cascade stage (its input: the
    image's 2 channels and the one-hot of the 2 foreground labels)."""
    name, archive = imported
    check = np.load(FIXTURE / name / "network_check.npz")
    network = _network(archive, CONFIG[name], FOLD[name])
    assert isinstance(network, ResidualEncoderUNet) == (name == RESENC)
    with torch.no_grad():
        logits = network(torch.from_numpy(check["input"])).numpy()
    assert np.abs(logits - check["logits"]).max() <= 1e-5 * np.abs(check["logits"]).max()


@pytest.fixture(scope="module")
def predicted(imported, tmp_path_factory) -> tuple[str, Path]:
    """The fixture's test cases predicted by ``predict -m`` with nnU-Net's mirroring (all axes); the cascade's
    archive runs 3d_lowres first and gives its label map to the cascade stage."""
    name, archive = imported
    out = tmp_path_factory.mktemp("predicted")
    argv = ["-q", "predict", "-m", str(archive), "-i", str(FIXTURE / "imagesTs"), "-o", str(out)]
    assert main([*argv, "--tta", "all", "--runtime", "torch"]) == 0
    return name, out


TIE = 2e-3  # the fixture's float16 probabilities resolve about 5e-4 near 1


def test_predict_m_reproduces_nnunets_predictions(predicted) -> None:
    """The issue's bar on the voxels where nnU-Net's two likeliest classes are not tied to the fixture's float16
    resolution (its stored probabilities); the fixture's tiny models leave few foreground voxels, so one tied voxel
    is several percent of the union (ResEnc, demo_006: one voxel at 0.47949 against 0.47925)."""
    name, out = predicted
    for case in CASES:
        ours = read_image(out / f"{case}.nii.gz")[0]
        theirs = read_image(FIXTURE / name / "predictions" / f"{case}.nii.gz")[0]
        probabilities = np.load(FIXTURE / name / "predictions" / f"{case}.npz")["probabilities"].astype(np.float32)
        second, first = np.sort(probabilities, axis=0)[-2:]
        decided = first - second > TIE
        agree, dice = agreement(ours[decided], theirs[decided], range(1, 3))
        assert agree >= 0.99 and min(dice) >= 0.99, (case, agree, dice)


def test_the_cascade_archive_holds_both_stages(tmp_path: Path) -> None:
    archive = _import("3d_cascade_fullres", tmp_path / "cascade.zip")
    with open_model_archive(archive) as model:
        plans = Plans.from_json(model.workspace.plans_path)
        assert model.workspace.checkpoint("3d_lowres", "all", "final").is_file()
    assert plans.configuration("3d_cascade_fullres").previous_stage == "3d_lowres"
    assert plans.input_channels(plans.configuration("3d_cascade_fullres")) == 4  # 2 images + 2 labels


def test_a_resenc_checkpoint_missing_a_key_is_refused_naming_it(tmp_path: Path) -> None:
    folder = copied(RESENC, tmp_path)
    weights_file = folder / "fold_0" / "checkpoint_final.pth"
    state = read_nnunet_checkpoint(weights_file)
    del state["network_weights"]["encoder.stages.1.blocks.0.skip.1.norm.weight"]
    torch.save(state, weights_file)
    with pytest.raises(InputError, match=r"ResidualEncoderUNet .*no weight for encoder\.1\.0\.skip\.2\.weight"):
        import_nnunet(folder, tmp_path / "model.zip")
    state = read_nnunet_checkpoint(model_folder(RESENC) / "fold_0" / "checkpoint_final.pth")
    del state["network_weights"]["encoder.stages.1.blocks.0.conv1.conv.bias"]  # only the skip convs lack a bias
    torch.save(state, weights_file)
    with pytest.raises(InputError, match=r"no weight for encoder\.1\.0\.conv1\.0\.bias"):
        import_nnunet(folder, tmp_path / "model.zip")


def test_the_older_plans_layout_gives_the_same_resenc_network(tmp_path: Path) -> None:
    """nnU-Net before 2.4 named the class in ``UNet_class_name`` and a ResidualEncoderUNet's blocks per stage in
    ``n_conv_per_stage_encoder``."""
    folder = copied(RESENC, tmp_path)

    edit_plans(folder, older_layout("ResidualEncoderUNet", "n_blocks_per_stage"))
    old = read_model_folder(folder).plans.configuration("3d_fullres").network
    new = read_model_folder(model_folder(RESENC)).plans.configuration("3d_fullres").network
    assert old == new and new.architecture == "residual_encoder_unet" and new.blocks_per_stage == (1, 2, 2)


def test_a_resenc_with_bottleneck_blocks_is_refused_naming_it(tmp_path: Path) -> None:
    folder = copied(RESENC, tmp_path)
    block = "dynamic_network_architectures.building_blocks.residual.BottleneckD"
    edit_plans(folder, lambda c: c["architecture"]["arch_kwargs"].update(block=block))
    with pytest.raises(InputError, match=r"ResidualEncoderUNet's block .*BottleneckD \(autoseg: BasicBlockD\)"):
        import_nnunet(folder, tmp_path / "model.zip")


def _cascade_folder(tmp_path: Path) -> Path:
    """A 3d_cascade_fullres model folder for the refusals, which stop before its weights are read: the lowres
    fixture's files (its plans.json holds the cascade's configuration, as nnU-Net's planner writes it)."""
    return copied("3d_lowres", tmp_path).rename(tmp_path / "nnUNetTrainer__nnUNetPlans__3d_cascade_fullres")


def test_a_cascade_without_its_previous_stage_is_refused(tmp_path: Path, capsys) -> None:
    folder = _cascade_folder(tmp_path)
    result = run_cli(capsys, "import-nnunet", folder, "-o", tmp_path / "model.zip")
    assert_refused(result, 2, folder, "is a cascade stage", "--previous-stage", "3d_lowres")
    assert not (tmp_path / "model.zip").exists()


def test_a_previous_stage_of_another_configuration_is_refused(tmp_path: Path, capsys) -> None:
    folder, other = _cascade_folder(tmp_path), model_folder("3d_fullres")
    result = run_cli(capsys, "import-nnunet", folder, "-o", tmp_path / "model.zip", "--previous-stage", other)
    assert_refused(result, 2, other, "configuration '3d_fullres'", "give the 3d_lowres model folder")
    result = run_cli(capsys, "import-nnunet", other, "-o", tmp_path / "model.zip", "--previous-stage", folder)
    assert_refused(result, 2, other, "is no cascade stage")
    assert not (tmp_path / "model.zip").exists()


def test_a_previous_stage_without_the_cascades_folds_is_refused(tmp_path: Path) -> None:
    folder = _cascade_folder(tmp_path / "cascade")
    lowres = copied("3d_lowres", tmp_path)
    (lowres / "fold_all").rename(lowres / "fold_0")
    with pytest.raises(InputError, match=r"3d_lowres: no fold_all/checkpoint_final.pth; a cascade predicts"):
        import_nnunet(folder, tmp_path / "model.zip", previous_stage=lowres)


def test_a_cascade_resampling_label_maps_otherwise_is_refused(tmp_path: Path) -> None:
    """autoseg puts the previous stage's label map on the cascade's grid linearly per label, nearest across z."""
    folder = _cascade_folder(tmp_path)
    plans = json.loads((folder / "plans.json").read_text())
    plans["configurations"]["3d_fullres"]["resampling_fn_seg_kwargs"]["order"] = 3  # the cascade inherits it
    (folder / "plans.json").write_text(json.dumps(plans))
    with pytest.raises(InputError, match=r"resampling_fn_seg_kwargs \{'order': 3, .*not supported for a cascade"):
        import_nnunet(folder, tmp_path / "model.zip", previous_stage=model_folder("3d_lowres"))
