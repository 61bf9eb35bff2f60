"""The final validation's prediction timed on the run's clock (``PredictionProbe``), and each validation case's work
counted as the final validation's window tiles it (``validation_work``). The clock is simulated: the network's tile
batches and reading a case advance it by fixed seconds."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from factories import set_configuration, tiny_topology
from torch._subclasses.fake_tensor import is_fake

import autoseg.predict.case as predict_case_module
from autoseg.core.workspace import Workspace
from autoseg.model.network import build_network
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.plan.plans import Plans
from autoseg.predict.networks import Predictor
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.store import open_case
from autoseg.train.fold_data import fold_cases
from autoseg.train.prediction_rates import PredictionProbe, validation_work
from autoseg.train.run_config import RunConfig
from autoseg.train.run_state import FoldJob

CONFIG = "3d_fullres"


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:
    shutil.copytree(prepared, tmp_path / "ws")
    return Workspace.at(tmp_path / "ws")


def _job(workspace: Workspace, clock: SimpleNamespace) -> FoldJob:
    plans = Plans.from_json(workspace.plans_path)
    train_ids, val_ids = fold_cases(workspace, CONFIG, 0)
    out = workspace.results(CONFIG, 0)
    run = RunConfig(validate=True, cpu_threads=1)
    config = plans.configuration(CONFIG)
    return FoldJob(
        workspace, plans, config, CONFIG, 0, train_ids, val_ids, out, run, False, lambda: clock.now, 0.0, None
    )


def _shapes(job: FoldJob) -> dict[str, tuple[int, ...]]:
    return {c: open_case(job.data_folder, c).arrays()[0].shape[1:] for c in job.val_ids}


def test_the_probe_times_one_tiles_passes_and_the_rest_of_a_case_once(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tile batch takes 2 s and reading a case 3 s: after a first pass (not timed), the passes cost 2 s / (4 variants
    x the tile's voxels) each, the rest of a case 3 s / its preprocessed voxels, timed at the first measure only; the
    network's mode is kept."""
    clock = SimpleNamespace(now=0.0)
    real_call, real_load = TorchTileRunner.__call__, predict_case_module.load_case

    def timed_call(self, tile_batch):
        clock.now += 0.0 if is_fake(tile_batch) else 2.0  # the memory simulation's batches take no time
        return real_call(self, tile_batch)

    def timed_load(case):
        clock.now += 3.0
        return real_load(case)

    monkeypatch.setattr(TorchTileRunner, "__call__", timed_call)
    monkeypatch.setattr(predict_case_module, "load_case", timed_load)
    job = _job(workspace, clock)
    network = build_network(job.planned.network).train()
    shapes = _shapes(job)
    probe = PredictionProbe(job, network, shapes)
    assert clock.now == pytest.approx(2.0)  # a first pass, not timed
    assert probe.case_id == sorted(shapes, key=lambda c: (math.prod(shapes[c]), c))[len(shapes) // 2]
    tile = tuple(probe.crop.shape[1:])
    first = probe.measure()
    assert first.window_seconds_per_voxel == pytest.approx(2.0 / (4 * math.prod(tile)))
    assert first.timing_seconds == pytest.approx(2.0)
    assert first.case_seconds_per_voxel == pytest.approx(3.0 / math.prod(shapes[probe.case_id]))
    assert clock.now == pytest.approx(7.0) and network.training  # the runner's eval mode undone
    again = probe.measure()
    assert again == first and clock.now == pytest.approx(9.0)  # the passes timed afresh; the case not again


def test_a_case_smaller_than_the_tile_is_padded_to_it(workspace: Workspace) -> None:
    """The validation case (10 x 22 x 20) under a 16 x 32 x 32 patch of a 3-stage network (sizes multiples of 4): the
    probe's first pass runs on a whole tile, not on the case itself, whose sizes the network refuses."""
    network = dataclasses.replace(tiny_topology(3), features_per_stage=(4, 8, 8), kernel_sizes=((3, 3, 3),) * 3)
    network = dataclasses.replace(network, strides=((1, 1, 1), (2, 2, 2), (2, 2, 2)))
    set_configuration(workspace, CONFIG, patch_size=(16, 32, 32), network=network)
    job = _job(workspace, SimpleNamespace(now=0.0))
    shapes = _shapes(job)
    probe = PredictionProbe(job, build_network(job.planned.network), shapes)
    assert probe.crop.shape[1:] == (16, 32, 32) and any(s % 4 for s in shapes[probe.case_id])


def test_validation_work_counts_the_tiles_the_final_validation_runs(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case's tiles x 4 mirror variants are the passes its prediction runs (counted in the runner's batches)."""
    job = _job(workspace, SimpleNamespace(now=0.0))
    shapes = _shapes(job)
    work = validation_work(job.planned, "cpu", shapes)
    network = build_network(job.planned.network)
    predictor = Predictor.of([network], job.plans, job.planned, WindowOptions(device="cpu"))
    real_call, passes = TorchTileRunner.__call__, []

    def counted(self, tile_batch):
        if not is_fake(tile_batch):
            passes.append(tile_batch.shape[0])
        return real_call(self, tile_batch)

    monkeypatch.setattr(TorchTileRunner, "__call__", counted)
    for case_id, shape in shapes.items():
        passes.clear()
        data = open_case(job.data_folder, case_id).arrays()[0]
        predict_case_module.predict_probabilities(data[:].copy(), case_id, predictor)
        assert sum(passes) == work[case_id].tiles * 4, case_id
        assert work[case_id].voxels == math.prod(shape)
