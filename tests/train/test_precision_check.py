"""Making the bf16 agreement check: a real run on the trained fold, scored as the final validation scores it; none on a
CPU without native bf16; at the end of training; and what export-model packs (stored, made now, or why none)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import pytest

from autoseg.cli.parser import build_parser
from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import write_image
from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.metrics import evaluate_pairs
from autoseg.plan.plans import Plans
from autoseg.predict.archive import export_model
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.case import predict_case
from autoseg.predict.graphs import file_digest
from autoseg.predict.networks import Predictor, load_networks
from autoseg.predict.precision_check import precision_check_path, read_precision_check
from autoseg.predict.window import WindowOptions
from autoseg.train.fold_data import fold_cases
from autoseg.train.precision_check import ExportChecks, bf16_runtimes, check_after_validation, run_precision_check
from autoseg.train.run_config import RunConfig
from autoseg.train.run_record import FinalValidation
from autoseg.train.trainer import train

CONFIG = "3d_fullres"
pytestmark = pytest.mark.slow  # the trained fixture: one fold trained once per session (~5 s)


@pytest.fixture()
def workspace(trained: Path, tmp_path: Path) -> Workspace:
    return Workspace.at(shutil.copytree(trained, tmp_path / "ws"))


def test_a_check_of_the_trained_fold_scores_fp32_as_evaluate_scores_a_prediction(
    workspace: Workspace, native_bf16, tmp_path: Path
) -> None:
    plans = Plans.from_json(workspace.plans_path)
    val_ids = fold_cases(workspace, CONFIG, 0)[1]
    check = run_precision_check(workspace, plans, CONFIG, 0, tta="none")
    assert check is not None and read_precision_check(workspace, CONFIG, 0) == check
    assert check.case_ids == tuple(val_ids) and tuple(check.bf16_dice) == bf16_runtimes()
    # the same fold predicted in fp32 from the raw images as `autoseg predict` does, written, then `evaluate`d
    config = plans.configuration(CONFIG)
    network = load_networks(workspace, plans, config, (0,), "final", "cpu")[0]
    predictor = Predictor.of([network], plans, config, WindowOptions(device="cpu", tta="none"))
    dataset = load_dataset(workspace.dataset_root())
    pairs = []
    for case in (c for c in dataset.cases if c.case_id in val_ids):
        labels, props = predict_case(case, predictor)
        write_image(out := tmp_path / f"{case.case_id}.nii.gz", labels, props.geometry)
        pairs.append((out, case.label_path))
    summary = evaluate_pairs(pairs, dataset.labels, nsd_tolerance_mm=None)
    assert list(check.class_names) == list(summary.mean)
    for name, mean in summary.mean.items():
        assert check.fp32_dice[name] == (None if math.isnan(mean.dice) else pytest.approx(mean.dice, abs=1e-12))
        assert check.bf16_dice["torch"][name] is None or 0 <= check.bf16_dice["torch"][name] <= 1


def test_a_cpu_without_native_bf16_makes_no_check_and_says_so(workspace: Workspace, caplog) -> None:
    plans = Plans.from_json(workspace.plans_path)
    with caplog.at_level(logging.INFO, logger="autoseg"):
        assert run_precision_check(workspace, plans, CONFIG, 0) is None
    assert "this CPU has no native bf16" in caplog.text
    assert not precision_check_path(workspace, CONFIG, 0).exists()


def test_export_packs_the_stored_check_makes_a_stale_one_anew_or_says_why_none(
    workspace: Workspace, native_bf16, tmp_path: Path, monkeypatch
) -> None:
    plans = Plans.from_json(workspace.plans_path)
    made = run_precision_check(workspace, plans, CONFIG, 0, tta="none")
    checks = ExportChecks()
    export_model(workspace, tmp_path / "a.zip", precision_checks=checks)
    assert [(o.check, o.how) for o in checks.outcomes] == [(made, "stored")]
    with open_model_archive(tmp_path / "a.zip") as model:
        assert model.manifest.precision_checks == ("results/3d_fullres/fold_0/precision_check.json",)
        assert read_precision_check(model.workspace, CONFIG, 0) == made

    stale = precision_check_path(workspace, CONFIG, 0)
    stale.write_text(stale.read_text().replace(made.checkpoint_sha256, "0" * 64))  # as if trained again
    export_model(workspace, tmp_path / "b.zip")  # by default only a check of this checkpoint is packed
    with open_model_archive(tmp_path / "b.zip") as model:
        assert model.manifest.precision_checks == ()
    skipped = ExportChecks(run=False)
    export_model(workspace, tmp_path / "c.zip", precision_checks=skipped)
    assert skipped.outcomes[0].check is None and "--no-precision-check" in skipped.outcomes[0].describe()[0]
    checks = ExportChecks()
    monkeypatch.setattr("autoseg.train.precision_check.default_tta", lambda device: "none")
    export_model(workspace, tmp_path / "d.zip", precision_checks=checks)
    assert checks.outcomes[0].how == "made now" and checks.outcomes[0].check.checkpoint_sha256 == made.checkpoint_sha256
    lines = checks.outcomes[0].describe()
    assert [line.split(": ")[2].split(" mean")[0] for line in lines] == [
        f"fp32 / bf16 ({r})" for r in sorted(made.bf16_dice)
    ]


def test_training_ends_with_the_check_on_the_final_validations_cases_and_tta(
    prepared: Path, tmp_path: Path, native_bf16
) -> None:
    workspace = Workspace.at(shutil.copytree(prepared, tmp_path / "ws"))
    run = RunConfig(epochs=1, iterations_per_epoch=1, val_iterations=1, cpu_threads=1)
    train(workspace, CONFIG, 0, run, progress=False)
    check = read_precision_check(workspace, CONFIG, 0)
    record = json.loads((workspace.results(CONFIG, 0) / "run.json").read_text())
    assert check is not None and list(check.case_ids) == record["final_validation"]["cases"]
    assert check.tta == record["final_validation"]["tta"] == "4"
    assert check.checkpoint_sha256 == file_digest(workspace.checkpoint(CONFIG, 0, "final"))


def test_no_precision_check_flag_turns_the_check_off_for_train() -> None:
    assert build_parser().parse_args(["train", "fold", "0", "--no-precision-check"]).no_precision_check
    assert not build_parser().parse_args(["train", "fold", "0"]).no_precision_check
    assert build_parser().parse_args(["export-model", "m.zip", "--no-precision-check"]).no_precision_check


def test_a_time_budget_too_short_for_the_check_leaves_it_to_export_model(
    workspace: Workspace, native_bf16, caplog
) -> None:
    plans = Plans.from_json(workspace.plans_path)
    final = FinalValidation(tuple(fold_cases(workspace, CONFIG, 0)[1]), "none")
    runs = 1 + len(bf16_runtimes())
    with caplog.at_level(logging.INFO, logger="autoseg"):
        assert check_after_validation(workspace, plans, CONFIG, 0, final, 10.0, runs * 10.0 - 1) is None
    assert "the time budget leaves" in caplog.text and "export-model model.zip -c 3d_fullres -f 0" in caplog.text
    assert not precision_check_path(workspace, CONFIG, 0).exists()
    assert check_after_validation(workspace, plans, CONFIG, 0, final, 10.0, runs * 10.0) is not None


def test_a_validation_case_without_its_reference_is_refused_naming_it(
    workspace: Workspace, native_bf16, monkeypatch
) -> None:
    import autoseg.train.precision_check as module

    val_id = fold_cases(workspace, CONFIG, 0)[1][0]
    real = module.load_dataset

    def without_label(root):
        dataset = real(root)
        cases = tuple(dataclasses.replace(c, label_path=None) if c.case_id == val_id else c for c in dataset.cases)
        return dataclasses.replace(dataset, cases=cases)

    monkeypatch.setattr(module, "load_dataset", without_label)
    plans = Plans.from_json(workspace.plans_path)
    with pytest.raises(InputError, match=f"no reference label map of validation case.s. {val_id}; .*--overwrite"):
        run_precision_check(workspace, plans, CONFIG, 0, tta="none")
    assert not precision_check_path(workspace, CONFIG, 0).exists()
