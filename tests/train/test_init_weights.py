"""Fine-tuning (`autoseg train --init-from`): what is copied from a trained model, the heads of another label set,
the refusal of a model whose encoder does not fit, an imported nnU-Net model as the start, and a resume that keeps
its trained weights."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from cli_checks import assert_refused, run_cli
from factories import tiny_topology
from train_faults import killed_after_epochs

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.model.network import build_network
from autoseg.model.topology import RESIDUAL_ENCODER_UNET, preset_fields
from autoseg.nnunet.importer import import_nnunet
from autoseg.plan.plans import Plans
from autoseg.predict.archive_reader import open_model_archive
from autoseg.train.checkpoint import load_checkpoint, plan_configuration_json
from autoseg.train.init_weights import initialise_from
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

CONFIG = "3d_fullres"
TINY = dict(epochs=2, iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1)
NNUNET = (
    Path(__file__).parents[1] / "fixtures" / "nnunet_model" / "3d_fullres" / "nnUNetTrainer__nnUNetPlans__3d_fullres"
)


def _plans(workspace: Path) -> Plans:
    return Plans.from_json(Workspace.at(workspace).plans_path)


def _with_labels(plans: Plans, labels: dict[str, int]) -> Plans:
    """``plans`` for another label set: its 3d_fullres network with one output per label."""
    config = plans.configuration(CONFIG)
    network = dataclasses.replace(config.network, num_outputs=len(labels))
    return dataclasses.replace(plans, labels=labels, configurations={CONFIG: config.with_(network=network)})


def _trained_weights(trained: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(Workspace.at(trained).checkpoint(CONFIG, 0, "final")).network


def test_the_same_plan_copies_every_tensor(trained: Path) -> None:
    plans = _plans(trained)
    network = build_network(plans.configuration(CONFIG).network)
    record = initialise_from(network, plans, str(trained), CONFIG, None)
    source = _trained_weights(trained)
    assert all(torch.equal(t, source[n]) for n, t in network.state_dict().items())
    assert (record.copied_tensors, record.encoder_share, record.reinitialised) == (len(source), 1.0, ())
    assert (record.kind, record.fold, record.checkpoint) == (
        "workspace",
        "0",
        f"results/{CONFIG}/fold_0/checkpoint_final.pt",
    )
    assert "heads copied (the same label set)" in record.describe()


def test_another_label_count_reinitialises_the_heads(trained: Path) -> None:
    labels = {"background": 0, "organ": 1, "lesion": 2, "vessel": 3, "bone": 4}
    plans = _with_labels(_plans(trained), labels)
    network = build_network(plans.configuration(CONFIG).network)
    fresh = {n: t.clone() for n, t in network.state_dict().items()}
    record = initialise_from(network, plans, str(trained), CONFIG, None)
    source, now = _trained_weights(trained), network.state_dict()
    heads = [n for n in now if n.startswith("seg_heads.")]
    assert heads and all(torch.equal(now[n], fresh[n]) for n in heads)  # the network's own init
    assert all(torch.equal(now[n], source[n]) for n in now if n not in heads)
    assert record.copied_tensors == len(now) - len(heads) and record.reinitialised == ("seg_heads.0",)
    assert "re-initialised: another label set (3 outputs" in record.heads and "-> 5" in record.heads


def test_the_same_count_of_other_labels_reinitialises_the_heads(trained: Path) -> None:
    plans = _with_labels(_plans(trained), {"background": 0, "kidney": 1, "cyst": 2})
    network = build_network(plans.configuration(CONFIG).network)
    fresh = network.state_dict()["seg_heads.0.weight"].clone()
    record = initialise_from(network, plans, str(trained), CONFIG, None)
    assert torch.equal(network.state_dict()["seg_heads.0.weight"], fresh)  # shapes fit, meanings do not
    assert record.reinitialised == ("seg_heads.0",)


def test_an_encoder_that_does_not_fit_is_refused_naming_its_layers(trained: Path) -> None:
    """Forty input channels: the first convolution holds most of this tiny encoder and cannot be copied."""
    plans = _plans(trained)
    wide = dataclasses.replace(tiny_topology(3), in_channels=40)
    with pytest.raises(InputError, match=r"only \d+\.\d% of this network's encoder") as info:
        initialise_from(build_network(wide), plans, str(trained), CONFIG, None)
    message = str(info.value)
    assert "encoder.0.0.0 (4x1x3x3x3 in the model, 4x40x3x3x3 here)" in message
    assert f"--like MODEL --overwrite` with MODEL {trained}," in message


def test_another_architecture_is_refused(trained: Path) -> None:
    residual = dataclasses.replace(tiny_topology(3), **preset_fields(RESIDUAL_ENCODER_UNET, 2))
    with pytest.raises(
        InputError, match=r"only 1\.1% of this network's encoder .*encoder\.0\.1\.conv1\.0 \(absent in the model"
    ):
        initialise_from(build_network(residual), _plans(trained), str(trained), CONFIG, None)


def test_a_checkpoint_file_and_a_missing_fold(trained: Path) -> None:
    plans = _plans(trained)
    file = Workspace.at(trained).checkpoint(CONFIG, 0, "final")
    record = initialise_from(build_network(plans.configuration(CONFIG).network), plans, str(file), CONFIG, None)
    assert (record.kind, record.encoder_share) == ("checkpoint", 1.0)
    with pytest.raises(InputError, match=r"--init-fold 3: .* holds fold\(s\) 0 of 3d_fullres"):
        initialise_from(build_network(plans.configuration(CONFIG).network), plans, str(trained), CONFIG, "3")


@pytest.fixture(scope="module")
def nnunet_archive(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nnunet") / "model.zip"
    import_nnunet(NNUNET, out)
    return out


def test_an_imported_nnunet_model_is_a_start(nnunet_archive: Path) -> None:
    """Its network as planned is copied whole; with one input channel fewer only the first convolution is new."""
    with open_model_archive(nnunet_archive) as model:
        plans = Plans.from_json(model.workspace.plans_path)
        weights = load_weights(model.workspace.checkpoint(CONFIG, 0, "final"))
    topology = plans.configuration(CONFIG).network
    network = build_network(topology)
    record = initialise_from(network, plans, str(nnunet_archive), CONFIG, None)
    assert all(torch.equal(t, weights[n]) for n, t in network.state_dict().items())
    assert (record.kind, record.copied_tensors, record.total_tensors) == ("archive", len(weights), len(weights))
    one_channel = build_network(dataclasses.replace(topology, in_channels=1))
    record = initialise_from(one_channel, plans, str(nnunet_archive), CONFIG, None)
    assert record.reinitialised == ("encoder.0.0.0",) and 0.99 < record.encoder_share < 1.0


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["network"]


def test_init_is_recorded_and_a_resume_does_not_apply_it_again(trained: Path, tmp_path: Path, caplog) -> None:
    """Killed after its first epoch and resumed with --init-from again, the run ends as one uninterrupted run does
    (the init would have replaced the trained weights), and does not even read the model, gone by then."""
    workspace = Workspace.at(shutil.copytree(trained, tmp_path / "ws"))
    shutil.rmtree(workspace.results(CONFIG, 0))
    model = shutil.copytree(trained, tmp_path / "model")
    run = RunConfig(**TINY, init_from=str(model))
    reference = train(workspace, CONFIG, 0, run, progress=False).rename(tmp_path / "reference")
    with killed_after_epochs(1):
        train(workspace, CONFIG, 0, run, progress=False)
    shutil.rmtree(model)
    caplog.set_level(logging.INFO, "autoseg.train.trainer")
    fold = train(workspace, CONFIG, 0, dataclasses.replace(run, resume=True), progress=False)
    expected, got = (load_checkpoint(p / "checkpoint_final.pt") for p in (reference, fold))
    assert all(torch.equal(t, got.network[n]) for n, t in expected.network.items())
    init = json.loads((fold / "run.json").read_text())["init"]
    assert init["model"] == str(model) and init["sha256"] == expected.progress.init["sha256"]
    assert "not applied: a resumed run goes on from its checkpoint" in caplog.text


def test_cli_refuses_an_encoder_that_does_not_fit(trained: Path, tmp_path: Path, capsys) -> None:
    """A model of another architecture (a residual encoder for this plain U-Net): refused before the fold's folder
    is made."""
    source = Workspace.at(shutil.copytree(trained, tmp_path / "source"))
    plans = _plans(trained)
    residual = dataclasses.replace(tiny_topology(3), **preset_fields(RESIDUAL_ENCODER_UNET, 2))
    config = plans.configuration(CONFIG).with_(network=residual)
    dataclasses.replace(plans, configurations={CONFIG: config}).to_json(source.plans_path)
    torch.save(
        {
            **torch.load(source.checkpoint(CONFIG, 0, "final"), weights_only=True),
            "network": build_network(residual).state_dict(),
            "plan_configuration": plan_configuration_json(config),
        },
        source.checkpoint(CONFIG, 0, "final"),
    )
    target = Workspace.at(shutil.copytree(trained, tmp_path / "target"))
    shutil.rmtree(target.results(CONFIG, 0))
    result = run_cli(capsys, "train", "fold", "0", "-w", target.root, "--init-from", source.root, "--epochs", "1")
    assert_refused(result, 2, "encoder.0.1.0 (absent in the model, 4x4x3x3x3 here)", "residual_encoder_unet", "--like")
    assert not target.results(CONFIG, 0).exists()
