from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from factories import set_configuration
from train_faults import killed_after_epochs, out_of_memory_at_step, simulated_passes, simulated_steps

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.memory.device import predict_device_peak
from autoseg.memory.step_record import StepConfig
from autoseg.memory.training import simulate_training_step
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.plan.plans import Plans
from autoseg.predict.class_weights import CLASS_WEIGHTS_FILE, ClassWeights
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.degrade import choose_degradation
from autoseg.train.fold_data import fold_cases
from autoseg.train.progress import Schedule
from autoseg.train.run_config import RunConfig
from autoseg.train.schedule import parse_duration, poly_lr
from autoseg.train.trainer import train

CONFIG = "3d_fullres"
TINY = dict(epochs=3, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1)


def _set_plan(workspace: Workspace, **changes) -> None:
    set_configuration(workspace, CONFIG, **changes)


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:
    shutil.copytree(prepared, tmp_path / "ws")
    return Workspace.at(tmp_path / "ws")


def _rows(fold: Path) -> list[dict]:
    return [json.loads(line) for line in (fold / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(workspace: Workspace) -> None:
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    reference = fold.with_name("reference")
    fold.rename(reference)

    with killed_after_epochs(2):
        train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    assert not (fold / "checkpoint_final.pt").exists()
    assert load_checkpoint(fold / "checkpoint_latest.pt").progress.epoch == 1
    with open(fold / "metrics.jsonl", "a") as f:  # killed after the epoch-2 row, before its checkpoint
        f.write(json.dumps({"epoch": 2, "train_loss": 0.0}) + "\n")
    train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 50}, resume=True), progress=False)

    expected, got = (load_checkpoint(p / "checkpoint_final.pt") for p in (reference, fold))
    assert expected.network.keys() == got.network.keys()
    for name, tensor in expected.network.items():
        assert torch.equal(tensor, got.network[name]), name
    momentum = [s["momentum_buffer"] for s in expected.optimizer["state"].values()]
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(momentum, got.optimizer["state"].values()))
    assert got.progress.schedule == Schedule(epochs=3, iterations_per_epoch=2, steps_done=6)  # not epochs=50
    rows, reference_rows = _rows(fold), _rows(reference)
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in reference_rows]
    assert [r["lr"] for r in rows] == [r["lr"] for r in reference_rows]


def test_resume_without_checkpoint_names_the_file(workspace: Workspace) -> None:
    missing = workspace.results(CONFIG, 0) / "checkpoint_latest.pt"
    with pytest.raises(InputError, match="checkpoint_latest.pt not found") as info:
        train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)
    assert str(missing) in str(info.value)


def test_resume_refuses_a_changed_plan(workspace: Workspace) -> None:
    with killed_after_epochs(1):
        train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    _set_plan(workspace, batch_size=3)
    with pytest.raises(ValueError, match=r"differs .*batch_size: 2 -> 3"):
        train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)


def test_out_of_memory_halves_the_micro_batch_and_is_recorded(workspace: Workspace) -> None:
    with out_of_memory_at_step(1):
        fold = train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 2}), progress=False)
    run = json.loads((fold / "run.json").read_text())
    (record,) = run["degradations"]
    assert record["action"] == "halve_micro_batch" and (record["epoch"], record["iteration"]) == (0, 1)
    assert record["from"]["batch_size"] == 2 and record["from"]["accumulation_steps"] == 1
    assert record["to"]["batch_size"] == 1 and record["to"]["accumulation_steps"] == 2
    assert record["to"]["checkpointing"] is True  # it was on already: halving was the only option
    assert record["to"]["predicted_bytes"] < record["from"]["predicted_bytes"]
    assert run["effective_configuration"] == {"batch_size": 1, "accumulation_steps": 2, "checkpointing": True}
    assert [r["epoch"] for r in _rows(fold)] == [0, 1]  # training went on
    assert load_checkpoint(fold / "checkpoint_final.pt").progress.degradations == (record,)


def test_out_of_memory_degradation_after_resume_is_kept(workspace: Workspace) -> None:
    with out_of_memory_at_step(0), killed_after_epochs(1):
        train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False)
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)
    run = json.loads((fold / "run.json").read_text())
    assert len(run["degradations"]) == 1
    assert run["effective_configuration"]["batch_size"] == 1


def test_degradation_takes_the_option_with_the_lower_predicted_peak(prepared: Path) -> None:
    config = Plans.from_json(Workspace.at(prepared).plans_path).configuration(CONFIG).with_(checkpointing=False)
    chosen, record = choose_degradation(config, torch.device("cpu"))
    halved, checkpointed = (
        predict_device_peak(
            simulate_training_step(
                StepConfig(config.network, b, config.patch_size, checkpointing=c, accumulation_steps=a)
            ),
            "cpu",
        )["total"]
        for b, c, a in [(1, False, 2), (2, True, 1)]
    )
    assert halved != checkpointed
    expected = "halve_micro_batch" if halved < checkpointed else "activation_checkpointing"
    assert record["action"] == expected
    assert record["to"]["predicted_bytes"] == min(halved, checkpointed)
    assert chosen.batch_size * chosen.accumulation_steps == 2  # the effective batch is kept


def test_nothing_left_to_degrade_explains_what_to_change(prepared: Path) -> None:
    config = Plans.from_json(Workspace.at(prepared).plans_path).configuration(CONFIG)
    with pytest.raises(torch.OutOfMemoryError, match=r"micro-batch of 1 .*predicts .*GiB.*--gpu-memory.*patch_size"):
        choose_degradation(config.with_(batch_size=1, checkpointing=True), torch.device("cpu"))


@pytest.mark.parametrize(
    ("text", "seconds"), [("2h", 7200), ("30m", 1800), ("90s", 90), ("1h30m", 5400), ("1.5h", 5400), ("45", 45)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2 hours", "h", "0s", "1h 30"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration|positive"):
        parse_duration(text)


def test_poly_lr() -> None:
    assert poly_lr(0.01, 5, 10) == pytest.approx(0.01 * 0.5**0.9) and poly_lr(0.01, 10, 10) == 0.0


def test_time_budget_shortens_epochs_on_the_runs_clock(workspace: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's clock is simulated: the training steps take 2.4 s twice (warm-up), then 1 s; nothing else takes
    time. Budget 120 s, 50 iterations and 1 validation iteration per epoch, no final validation; the plan below is
    worked out by hand."""
    clock = simulated_steps(monkeypatch, [2.4, 2.4, 1.0])
    run = RunConfig(**{**TINY, "epochs": 1000, "iterations_per_epoch": 50}, time_budget_s=120.0)
    fold = train(workspace, CONFIG, 0, run, progress=False, clock=lambda: clock.now)
    run_json = json.loads((fold / "run.json").read_text())
    decisions = [
        (d["source"], d["epochs"], d["iterations_per_epoch"], d["elapsed_seconds"], d["seconds_per_iteration"])
        for d in run_json["time_budget"]
    ]
    # after 5 iterations (7.8 s): 1 s per iteration (the warm-up left out), 1 / 3 + 0.3 s per epoch besides;
    # 95% of 120 s is 114 s: 106.2 s left + the 5 iterations done need ceil(111.2 / 50.63) = 3 epochs, each
    # shortened to floor(111.2 / 3 - 0.63) = 36 iterations. Later checks find it on time: no new decision.
    assert decisions == [("iteration 5 of epoch 0", 3, 36, pytest.approx(7.8), 1.0)]
    assert run_json["schedule"] == {"epochs": 3, "iterations_per_epoch": 36}
    assert clock.now - 50.0 == pytest.approx(110.8)  # 2 x 2.4 + 106 x 1 s: 92% of the budget
    rows = _rows(fold)
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    # each row's learning rate is its last step's, on the 108 steps of the plan in force
    assert [r["lr"] for r in rows] == pytest.approx([poly_lr(1e-2, s, 108) for s in (35, 71, 107)])
    assert load_checkpoint(fold / "checkpoint_final.pt").progress.schedule.steps_done == 108
    # each epoch's line and row: the run's elapsed time, its end predicted from the epochs so far, the budget
    assert [r["planned_run_seconds"] for r in rows] == [120.0] * 3
    assert rows[0]["predicted_run_seconds"] == pytest.approx(rows[0]["elapsed_seconds"] + 2 * rows[0]["epoch_seconds"])
    assert rows[-1]["predicted_run_seconds"] == pytest.approx(rows[-1]["elapsed_seconds"]) == pytest.approx(110.8)


def test_time_budget_reduces_the_final_validation_and_it_is_honoured(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tile batches of 4 s simulated make the final validation of fold "all" (5 cases, 4 mirror variants on CPU) cost
    more than a quarter of 100 s: it runs without mirroring on the first cases that fit, as run.json records."""
    from autoseg.train import validation

    clock = simulated_steps(monkeypatch, [3.0])
    simulated_passes(monkeypatch, clock, 4.0)
    real_predict, seen = validation.predict_case, []

    def spy(case, predictor, *args, **kwargs):
        if isinstance(predictor.runners[0], TorchTileRunner):  # not the timing of a case without the network
            seen.append((case.case_id, predictor.window.tta))
        return real_predict(case, predictor, *args, **kwargs)

    monkeypatch.setattr(validation, "predict_case", spy)
    run = RunConfig(**{**TINY, "epochs": 1000, "validate": True}, time_budget_s=100.0)
    fold = train(workspace, CONFIG, "all", run, progress=False, clock=lambda: clock.now)
    final = json.loads((fold / "run.json").read_text())["final_validation"]
    all_cases = sorted(fold_cases(workspace, CONFIG, "all")[1])
    assert final["tta"] == "none" and final["reduced_by_time_budget"]
    assert 1 <= len(final["cases"]) < len(all_cases) and final["cases"] == all_cases[: len(final["cases"])]
    assert seen == [(c, "none") for c in final["cases"]]
    assert sorted(p.stem for p in (fold / "validation").glob("*.npz")) == final["cases"]
    weights = ClassWeights.from_json(fold / CLASS_WEIGHTS_FILE)  # fitted on the final validation's cases
    assert list(weights.case_ids) == final["cases"] and set(weights.dice_before) == set(weights.weights)
    decision = json.loads((fold / "run.json").read_text())["time_budget"][-1]
    assert decision["validation_cases"] == final["cases"] and decision["validation_tta"] == "none"


def test_time_budget_estimates_the_final_validation_from_the_runs_own_prediction(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each tile batch through the run's network takes 2 s on the run's clock, and nothing else does: before the first
    step the budget times one tile's 4 mirror variants (one batch of 4, after an untimed first pass), so a pass costs
    0.5 s per tile, and the final validation takes what it estimated."""
    clock = simulated_steps(monkeypatch, [3.0])
    passes = simulated_passes(monkeypatch, clock, 2.0)
    run = RunConfig(**{**TINY, "epochs": 1000, "validate": True}, time_budget_s=100.0)
    with caplog.at_level(logging.INFO, logger="autoseg.train.trainer"):
        fold = train(workspace, CONFIG, 0, run, progress=False, clock=lambda: clock.now)
    # before the first step (the network still in training mode): a first pass, then one tile's 4 mirror variants
    assert passes[:2] == [((1, 1, 8, 16, 16), True), ((4, 1, 8, 16, 16), True)]
    decision = json.loads((fold / "run.json").read_text())["time_budget"][0]
    assert decision["window_seconds_per_voxel"] == pytest.approx(2.0 / (4 * 8 * 16 * 16))
    assert decision["case_seconds_per_voxel"] == 0.0  # nothing but the passes takes time here
    final = json.loads((fold / "run.json").read_text())["final_validation"]
    assert final["tta"] == "4" and not final["reduced_by_time_budget"] and final["estimated_seconds"] > 0
    took = re.search(r"final validation took ([0-9.]+) s \(estimated ([0-9.]+) s\)", caplog.text)
    assert took is not None and float(took.group(1)) == pytest.approx(float(took.group(2)))


def test_train_cli_reads_resume_and_time_budget() -> None:
    from autoseg.cli.parser import build_parser

    args = build_parser().parse_args(["train", "fold", "0", "--resume", "--time-budget", "1h30m"])
    assert args.resume and args.time_budget == 5400
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "fold", "0", "--time-budget", "soon"])


def test_pseudo_dice_counts_per_class_and_region_skip_ignore() -> None:
    from autoseg.dataset.labels import LabelScheme
    from autoseg.train.patch_validation import pseudo_dice_counts

    target = torch.tensor([[[0, 1, 2, 2, 3, 3]]])  # 3 = ignore
    classes = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2, "ignore": 3})
    logits = torch.zeros(1, 3, 6)
    logits[0, [0, 1, 2, 1, 2, 1], torch.arange(6)] = 5.0  # argmax 0 1 2 1 2 1
    # class 1: tp voxel 1, fp voxel 3 (voxel 5 is ignored), fn 0; class 2: tp voxel 2, fn voxel 3
    assert pseudo_dice_counts(logits, target, classes).tolist() == [[1, 1], [1, 0], [0, 1]]
    regions = LabelScheme.from_labels({"background": 0, "ab": [1, 2], "b": 2, "ignore": 3}, [1, 2])
    region_logits = torch.tensor([[[-1.0, 1.0, 1.0, -1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, 1.0, 1.0, -1.0]]])
    # region ab = {1, 2}: predicted voxels 1, 2 (4, 5 ignored) -> tp 2, fn voxel 3; b: tp 2 and 3
    assert pseudo_dice_counts(region_logits, target, regions).tolist() == [[2, 2], [0, 0], [1, 0]]


def test_a_preprocessed_case_with_missing_arrays_stops_training_instead_of_leaving_the_folds(
    workspace: Workspace,
) -> None:
    folder = workspace.preprocessed(CONFIG)
    case_id = sorted(p.stem for p in folder.glob("*.json"))[0]
    (folder / f"{case_id}_seg.npy").unlink()
    with pytest.raises(InputError, match=rf"case '{case_id}' is missing {case_id}_seg.npy.*plan_and_preprocess"):
        fold_cases(workspace, CONFIG, 0)


def test_a_checkpoint_written_before_plans_schema_3_still_resumes(workspace: Workspace) -> None:
    """The saved configuration of a pre-restructure checkpoint (network.num_classes, no architecture, no
    blocks_per_stage, no inference_patch_size) matches the upgraded plan: resuming reports no plan change; nor does a
    changed inference tile, which training does not read."""
    from autoseg.train.checkpoint import check_same_plan

    fold = train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 1}), progress=False)
    checkpoint = load_checkpoint(fold / "checkpoint_latest.pt")
    saved = json.loads(checkpoint.plan_configuration)
    saved["network"]["num_classes"] = saved["network"].pop("num_outputs")
    del saved["network"]["architecture"]
    assert saved["network"].pop("blocks_per_stage") == []  # plans schema 5
    del saved["inference_patch_size"]
    old = dataclasses.replace(checkpoint, plan_configuration=json.dumps(saved))
    config = Plans.from_json(workspace.plans_path).configuration(CONFIG)
    check_same_plan(old, config, CONFIG)  # no ValueError
    check_same_plan(old, config.with_(inference_patch_size=(8, 24, 24)), CONFIG)
    saved["network"]["num_classes"] += 1
    with pytest.raises(ValueError, match="differs"):
        check_same_plan(dataclasses.replace(checkpoint, plan_configuration=json.dumps(saved)), config, CONFIG)
