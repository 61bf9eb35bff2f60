from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
from factories import set_configuration, tiny_plans, tiny_topology

import autoseg.data.loader as batch_loader
from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.memory.loader_worker import output_batch_bytes
from autoseg.plan.budget import Budget
from autoseg.plan.run import plan_dataset
from autoseg.plan.training_data import loader_config, uses_dummy_2d
from autoseg.preprocess.run import preprocess_workspace
from autoseg.preprocess.store import list_complete_cases, precomputed_copies, properties_path, read_properties
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

CONFIG = "3d_fullres"


def test_dummy_2d_for_patches_more_than_3x_thinner_along_z() -> None:
    assert uses_dummy_2d((8, 64, 64)) and uses_dummy_2d((4, 16, 13))
    assert not uses_dummy_2d((32, 64, 96)) and not uses_dummy_2d((16, 48, 48))
    assert not uses_dummy_2d((16, 160))  # a 2D patch


def test_loader_config_follows_the_plan() -> None:
    config = tiny_plans().configuration(CONFIG).with_(patch_size=(4, 32, 32))
    train_cfg = loader_config(config, augment=True)
    assert train_cfg.patch_size == (4, 32, 32) and train_cfg.batch_size == 2 and train_cfg.dummy_2d
    assert train_cfg.enlarged_patch_size[0] == 4  # in-plane rotation keeps the z extent
    val_cfg = loader_config(config, augment=False)
    assert not val_cfg.dummy_2d and val_cfg.enlarged_patch_size == (4, 32, 32)
    assert loader_config(config, augment=True, use_precomputed=True).enlarged_patch_size == (4, 32, 32)


@pytest.fixture(scope="module")
def precomputed(tiny_dataset: Path, tmp_path_factory) -> Workspace:
    """A preprocessed workspace with one precomputed augmented copy per case and a tiny network."""
    workspace = Workspace.at(tmp_path_factory.mktemp("train_data") / "ws")
    plans = plan_dataset(tiny_dataset, workspace, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    preprocess_workspace(workspace, [CONFIG], processes=1, progress=False, precompute_augmentations=1)
    set_configuration(
        workspace,
        CONFIG,
        network=tiny_topology(plans.num_label_values),
        patch_size=(8, 16, 16),
        batch_size=2,
        accumulation_steps=1,
        checkpointing=False,
    )
    return workspace


def test_precomputed_copies_counts_the_fewest(precomputed: Workspace) -> None:
    folder = precomputed.preprocessed(CONFIG)
    cases = list_complete_cases(folder)
    assert precomputed_copies(folder, cases) == 1
    props = read_properties(folder, cases[0])
    dataclasses.replace(props, augmentations=()).to_json(properties_path(folder, cases[0]))
    try:
        assert precomputed_copies(folder, cases) == 0
    finally:
        props.to_json(properties_path(folder, cases[0]))


def test_training_samples_precomputed_copies_in_a_worker_process(precomputed: Workspace, caplog) -> None:
    caplog.set_level(logging.INFO, logger="autoseg.train.trainer")
    run = RunConfig(epochs=1, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1, loader_workers=1)
    fold = train(precomputed, CONFIG, 0, run, progress=False)
    record = json.loads((fold / "run.json").read_text())
    assert record["data"] == {"loader_workers": 1, "use_precomputed": True}
    assert "1 loader worker(s) x 2 queued batches; spatial augmentation precomputed copies (1 per case)" in caplog.text


def test_planned_workers_shrink_to_the_shared_memory(
    precomputed: Workspace, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's 2 workers, but /dev/shm (Docker's 64 MiB, say) holds the slots of one: train with one."""
    set_configuration(precomputed, CONFIG, loader_workers=2, loader_queue_depth=2)
    one_worker = 3 * output_batch_bytes((8, 16, 16), 2, 1)  # queue depth 2 + 1 slots
    monkeypatch.setattr(
        batch_loader.shutil,
        "disk_usage",
        lambda folder: shutil._ntuple_diskusage(2**30, 2**30 - one_worker - 1, one_worker + 1),
    )
    caplog.set_level(logging.INFO, logger="autoseg.train.trainer")
    try:
        run = RunConfig(epochs=1, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1)
        fold = train(precomputed, CONFIG, 0, run, progress=False)
    finally:
        set_configuration(precomputed, CONFIG, loader_workers=0)
    assert json.loads((fold / "run.json").read_text())["data"]["loader_workers"] == 1
    assert "room for the batch slots of 1 of the planned 2 loader worker(s)" in caplog.text


def test_use_precomputed_without_copies_names_the_flag(tiny_dataset: Path, tmp_path: Path) -> None:
    workspace = Workspace.at(tmp_path / "ws")
    plans = plan_dataset(tiny_dataset, workspace, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    preprocess_workspace(workspace, [CONFIG], processes=1, progress=False)
    set_configuration(
        workspace,
        CONFIG,
        network=tiny_topology(plans.num_label_values),
        patch_size=(8, 16, 16),
        batch_size=2,
        accumulation_steps=1,
    )
    run = RunConfig(
        epochs=1, iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1, use_precomputed=True
    )
    with pytest.raises(ValueError, match="--precompute-augmentations"):
        train(workspace, CONFIG, 0, run, progress=False)
