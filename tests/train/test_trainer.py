from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import set_configuration
from torch._subclasses.fake_tensor import is_fake

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.memory.device import predict_device_peak
from autoseg.memory.training import simulate_training_step
from autoseg.model.step import TrainStep
from autoseg.plan.plans import Plans
from autoseg.train import trainer
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.degrade import choose_degradation
from autoseg.train.run_config import RunConfig
from autoseg.train.schedule import epochs_within_budget, final_validation_seconds, parse_duration, poly_lr
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

    train(workspace, CONFIG, 0, RunConfig(**TINY, stop_after_epochs=2), progress=False)  # "killed" after epoch 1
    assert not (fold / "checkpoint_final.pt").exists()
    assert load_checkpoint(fold / "checkpoint_latest.pt")["epoch"] == 1
    with open(fold / "metrics.jsonl", "a") as f:  # killed after the epoch-2 row, before its checkpoint
        f.write(json.dumps({"epoch": 2, "train_loss": 0.0}) + "\n")
    train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 50}, resume=True), progress=False)

    expected, got = (load_checkpoint(p / "checkpoint_final.pt") for p in (reference, fold))
    assert expected["network"].keys() == got["network"].keys()
    for name, tensor in expected["network"].items():
        assert torch.equal(tensor, got["network"][name]), name
    momentum = [s["momentum_buffer"] for s in expected["optimizer"]["state"].values()]
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(momentum, got["optimizer"]["state"].values()))
    assert got["schedule"] == {"epochs": 3, "iterations_per_epoch": 2}  # the checkpoint's, not epochs=50
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
    train(workspace, CONFIG, 0, RunConfig(**TINY, stop_after_epochs=1), progress=False)
    _set_plan(workspace, batch_size=3)
    with pytest.raises(ValueError, match=r"differs .*batch_size: 2 -> 3"):
        train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)


def test_out_of_memory_halves_the_micro_batch_and_is_recorded(workspace: Workspace) -> None:
    fold = train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 2}, inject_oom_at_step=1), progress=False)
    run = json.loads((fold / "run.json").read_text())
    (record,) = run["degradations"]
    assert record["action"] == "halve_micro_batch" and (record["epoch"], record["iteration"]) == (0, 1)
    assert record["from"]["batch_size"] == 2 and record["from"]["accumulation_steps"] == 1
    assert record["to"]["batch_size"] == 1 and record["to"]["accumulation_steps"] == 2
    assert record["to"]["checkpointing"] is True  # it was on already: halving was the only option
    assert record["to"]["predicted_bytes"] < record["from"]["predicted_bytes"]
    assert run["effective_configuration"] == {"batch_size": 1, "accumulation_steps": 2, "checkpointing": True}
    assert [r["epoch"] for r in _rows(fold)] == [0, 1]  # training went on
    assert load_checkpoint(fold / "checkpoint_final.pt")["degradations"] == [record]


def test_out_of_memory_degradation_after_resume_is_kept(workspace: Workspace) -> None:
    train(workspace, CONFIG, 0, RunConfig(**TINY, inject_oom_at_step=0, stop_after_epochs=1), progress=False)
    fold = train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)
    run = json.loads((fold / "run.json").read_text())
    assert len(run["degradations"]) == 1
    assert run["effective_configuration"]["batch_size"] == 1


def test_degradation_takes_the_option_with_the_lower_predicted_peak(prepared: Path) -> None:
    config = Plans.from_json(Workspace.at(prepared).plans_path).configuration(CONFIG).with_(checkpointing=False)
    chosen, record = choose_degradation(config, torch.device("cpu"))
    halved, checkpointed = (predict_device_peak(simulate_training_step(
        config.network, b, config.patch_size, checkpointing=c, accumulation_steps=a), "cpu")["total"]
        for b, c, a in [(1, False, 2), (2, True, 1)])
    assert halved != checkpointed
    expected = "halve_micro_batch" if halved < checkpointed else "activation_checkpointing"
    assert record["action"] == expected
    assert record["to"]["predicted_bytes"] == min(halved, checkpointed)
    assert chosen.batch_size * chosen.accumulation_steps == 2  # the effective batch is kept


def test_nothing_left_to_degrade_explains_what_to_change(prepared: Path) -> None:
    config = Plans.from_json(Workspace.at(prepared).plans_path).configuration(CONFIG)
    with pytest.raises(torch.OutOfMemoryError, match=r"micro-batch of 1 .*predicts .*GiB.*--gpu-memory.*patch_size"):
        choose_degradation(config.with_(batch_size=1, checkpointing=True), torch.device("cpu"))


@pytest.mark.parametrize(("text", "seconds"), [("2h", 7200), ("30m", 1800), ("90s", 90), ("1h30m", 5400),
                                               ("1.5h", 5400), ("45", 45)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2 hours", "h", "0s", "1h 30"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration|positive"):
        parse_duration(text)


def test_epochs_within_budget() -> None:
    # 100 s budget, 10 s spent, 20 s kept for the final validation: 70 s of 7 s epochs -> 10
    assert epochs_within_budget(100, 10, 0, 7, 20) == 10
    # 0.5 of the first epoch done: its other half (3.5 s) is paid first -> 1 + floor(66.5 / 7) = 10
    assert epochs_within_budget(100, 10, 0.5, 7, 20) == 10
    assert epochs_within_budget(100, 99, 3, 7, 20) == 3  # over budget: stop after the epochs done
    assert epochs_within_budget(1, 5, 0.1, 7, 0) == 1  # never fewer than one epoch
    assert final_validation_seconds([(12, 28, 28)], (8, 16, 16), 0.3) == pytest.approx(1.5 * 2 * 3 * 3 * 8 * 0.1)
    assert poly_lr(0.01, 5, 10) == pytest.approx(0.01 * 0.5 ** 0.9) and poly_lr(0.01, 10, 10) == 0.0


def test_time_budget_sets_the_epochs_from_measured_speed(workspace: Workspace,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's clock is simulated: the training steps take 2 s (warm-up), 1 s, 1 s, 1 s, then 3 s each;
    nothing else takes time. Budget 14 s, 2 iterations and 1 validation iteration per epoch, no final
    validation; the decisions below are worked out by hand."""
    clock = SimpleNamespace(now=50.0)
    step_seconds = iter([2.0, 1.0, 1.0, 1.0] + [3.0] * 100)
    real_step = TrainStep.__call__

    def timed_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if not is_fake(next(self.network.parameters())):  # the memory check's simulation runs TrainStep too
            clock.now += next(step_seconds)
        return result

    monkeypatch.setattr(TrainStep, "__call__", timed_step)
    monkeypatch.setattr(trainer, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    fold = train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 1000}, time_budget_s=14.0), progress=False)
    run = json.loads((fold / "run.json").read_text())
    decisions = [(d["source"], d["epochs"], d["elapsed_seconds"], d["seconds_per_epoch"]) for d in run["time_budget"]]
    assert decisions == [
        # after 2 iterations (t = 3 s): 1 s per iteration (the 2 s warm-up left out); an epoch 2 x 1 s + 1 s / 3
        # (validation) + 0.3 s: 11 s left hold 4 more epochs after this one
        ("first iterations", 5, 3.0, pytest.approx(2.0 + 1.0 / 3.0 + 0.3)),
        ("first epoch", 4, 3.0, 3.0),  # epoch 0 took 3 s: 11 s hold 3 more
        # epoch 1 (2 s) would allow 5 epochs: not lengthened; epoch 2 (6 s) makes the mean 11/3 s: 3 epochs
        ("epoch 2", 3, 11.0, pytest.approx(11.0 / 3.0)),
    ]
    assert run["schedule"]["epochs"] == 3
    rows = _rows(fold)
    assert [r["epoch"] for r in rows] == [0, 1, 2] and [r["epoch_seconds"] for r in rows] == [3.0, 2.0, 6.0]
    assert clock.now - 50.0 == 11.0 <= 14.0
    # each row's learning rate is its last step's: on the schedule in force when the step ran (1000 epochs
    # until the first decision, then 4, until epoch 2 ended)
    assert [r["lr"] for r in rows] == pytest.approx([poly_lr(1e-2, 1, 2000), poly_lr(1e-2, 3, 8), poly_lr(1e-2, 5, 8)])


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
        workspace: Workspace) -> None:
    folder = workspace.preprocessed(CONFIG)
    case_id = sorted(p.stem for p in folder.glob("*.json"))[0]
    (folder / f"{case_id}_seg.npy").unlink()
    with pytest.raises(InputError, match=rf"case '{case_id}' is missing {case_id}_seg.npy.*plan_and_preprocess"):
        trainer.fold_cases(workspace, CONFIG, 0)


def test_a_checkpoint_written_before_plans_schema_3_still_resumes(workspace: Workspace) -> None:
    """The saved configuration of a pre-restructure checkpoint (network.num_classes, no architecture, no
    blocks_per_stage, no inference_patch_size) matches the upgraded plan: resuming reports no plan change; nor does a
    changed inference tile, which training does not read."""
    from autoseg.train.checkpoint import check_same_plan

    fold = train(workspace, CONFIG, 0, RunConfig(**{**TINY, "epochs": 1}), progress=False)
    state = load_checkpoint(fold / "checkpoint_latest.pt")
    saved = json.loads(state["plan_configuration"])
    saved["network"]["num_classes"] = saved["network"].pop("num_outputs")
    del saved["network"]["architecture"]
    assert saved["network"].pop("blocks_per_stage") == []  # plans schema 5
    del saved["inference_patch_size"]
    state["plan_configuration"] = json.dumps(saved)
    config = Plans.from_json(workspace.plans_path).configuration(CONFIG)
    check_same_plan(state, config, CONFIG, fold / "checkpoint_latest.pt")  # no ValueError
    check_same_plan(state, config.with_(inference_patch_size=(8, 24, 24)), CONFIG, fold / "checkpoint_latest.pt")
    saved["network"]["num_classes"] += 1
    state["plan_configuration"] = json.dumps(saved)
    with pytest.raises(ValueError, match="differs"):
        check_same_plan(state, config, CONFIG, fold / "checkpoint_latest.pt")
