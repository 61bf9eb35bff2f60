"""Every command a message advises runs as written: each backticked `autoseg ...` in autoseg's code either parses
with the CLI's own parser (a command with nothing to fill in), or, when it is filled in from what the message is
about, is printed by one of the scenarios below in a real workspace and checked against it (``advice``: its
workspace, folds and configurations). One advice, the archive's `autoseg predict -m ...`, is run end to end."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path

import pytest
from advice import (
    PLACEHOLDERS,
    Template,
    advice_templates,
    advised_commands,
    check_advice,
    command_parsers,
    parse_advice,
)
from cascade_workspace import CASCADE, RUN
from cli_checks import run_cli
from factories import set_configuration
from train_faults import simulated_steps

from autoseg.cli.main import main
from autoseg.core.workspace import Workspace
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

# A value for each placeholder, for parsing a command with nothing filled in.
VALUES = {
    "DATASET": "some/dataset",
    "INPUT": "in",
    "OUTPUT": "out",
    "WORKSPACE": "ws",
    "K": "2",
    "N": "2",
    "MODEL": "model.zip",
}

_FIND_BEST = (
    "autoseg train fold {' '.join(map(str, _every_fold(workspace, plans)))} -c {plans.default_configuration()} "
    "-w {workspace.root}"
)
_REDO = "autoseg plan_and_preprocess {root} -w {workspace.root} --overwrite"
_TRAIN_LOWRES = "autoseg train fold {folds} -c {stage} -w {workspace.root}"
_RESUME_LOWRES = "autoseg train fold {fold} -c {stage} -w {workspace.root} --resume"

# Every templated advice (module, text as written) and the scenario below that prints it.
SCENARIOS: dict[tuple[str, str], str] = {
    (
        "autoseg/cli/model_commands.py",
        "autoseg predict -m {out} -i INPUT -o OUTPUT",
    ): "test_export_advises_a_running_prediction",
    ("autoseg/core/workspace.py", "{self.advice(produced_by)}"): "test_an_empty_workspace",
    ("autoseg/core/workspace.py", "{self.advice('plan_and_preprocess')}"): "test_a_workspace_without_its_record",
    ("autoseg/plan/run.py", _REDO): "test_a_changed_dataset_advises_the_overwrite",
    ("autoseg/preprocess/run.py", _REDO): "test_an_edited_plan_advises_preprocessing_again",
    ("autoseg/selection/sources.py", _FIND_BEST): "test_find_best_without_folds",
    ("autoseg/predict/archive.py", "{workspace.advice(f'train fold 0 -c {config_name}')}"): "test_untrained_folds",
    ("autoseg/predict/archive.py", "{workspace.advice(f'train fold {untrained[0]} -c {config_name}')}"): (
        "test_untrained_folds"
    ),
    ("autoseg/predict/segmenter.py", "{workspace.advice(f'train fold 0 -c {config_name}')}"): "test_untrained_folds",
    ("autoseg/predict/networks.py", "{workspace.advice(f'train fold {fold} -c {config.name}')}"): (
        "test_untrained_folds"
    ),
    ("autoseg/train/fold_data.py", "{workspace.advice('plan_and_preprocess')}"): "test_missing_preprocessed_cases",
    ("autoseg/train/fold_data.py", _TRAIN_LOWRES): "test_a_cascade_without_its_previous_stage",
    ("autoseg/train/fold_data.py", _RESUME_LOWRES): "test_a_cascade_without_its_previous_stage",
    ("autoseg/predict/cascade.py", "autoseg train fold {listed} -c {stage.name} -w {workspace.root}"): (
        "test_a_cascade_without_its_previous_stage"
    ),
    ("autoseg/train/memory_check.py", "autoseg check-memory -c {config_name} --device {config.device} -w WORKSPACE"): (
        "test_a_plan_too_large_for_this_machine"
    ),
    (
        "autoseg/plan/iteration_target.py",
        "autoseg plan_and_preprocess {dataset} -w {workspace} --device cpu --time-budget {budget} --overwrite",
    ): "test_a_time_budget_the_plan_was_not_sized_for",
}


def _literal_is_a_mention(command: str) -> bool:
    """`autoseg export-model`, `autoseg predict -m`, `autoseg train ... --gpus N`: a command named with some of its
    flags, for the reader to complete, rather than one to run as it stands."""
    tokens = shlex.split(command)[2:]
    return "..." in tokens or all(t.startswith("-") or t in PLACEHOLDERS for t in tokens)


def test_every_advice_without_fields_parses_or_names_a_real_command_and_flags() -> None:
    literal = [t for t in advice_templates() if not t.is_templated]
    assert len(literal) >= 10  # the collector finds them (a broken collector finds none)
    commands = command_parsers()
    for template in literal:
        tokens = shlex.split(template.text)
        assert tokens[1] in commands, f"{template.module}:{template.line}: `{template.text}`: no such command"
        if _literal_is_a_mention(template.text):
            _assert_flags_exist(template, tokens[1], {t for t in tokens[2:] if t.startswith("-")})
        else:
            parse_advice(template.text, VALUES)


def _assert_flags_exist(template: Template, command: str, flags: set[str]) -> None:
    unknown = flags - set(command_parsers()[command]._option_string_actions)
    assert not unknown, f"{template.module}:{template.line}: `{template.text}`: no flag(s) {sorted(unknown)}"


def test_every_templated_advice_has_a_scenario_that_prints_it() -> None:
    written = {(t.module, t.text) for t in advice_templates() if t.is_templated}
    missing = written - SCENARIOS.keys()
    assert not missing, f"advice without a scenario in {__name__} (add one that prints it): {sorted(missing)}"
    assert not SCENARIOS.keys() - written, "scenarios of advice no longer written: remove them"
    assert all(name in globals() for name in SCENARIOS.values())


def _printed(template_key: tuple[str, str], message: str) -> None:
    """The message holds the advice ``template_key`` names (so that each scenario tests what it claims)."""
    template = Template(template_key[0], 0, template_key[1])
    assert any(template.matches(c) for c in advised_commands(message)), message


def _copy(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "ws"))


def test_export_advises_a_running_prediction(trained: Path, inputs: Path, tmp_path: Path, capsys) -> None:
    archive = tmp_path / "model.zip"
    result = run_cli(capsys, "export-model", archive, "-w", trained)
    assert result.status == 0, result.err
    _printed(("autoseg/cli/model_commands.py", "autoseg predict -m {out} -i INPUT -o OUTPUT"), result.out)
    values = {"INPUT": inputs, "OUTPUT": tmp_path / "pred"}
    (args,) = check_advice(result.out, trained, values)
    (command,) = advised_commands(result.out)
    argv = [str(values.get(t, t)) for t in shlex.split(command)[1:]]
    assert main(["-q", *argv]) == 0  # run as advised, end to end
    assert sorted(p.name for p in (tmp_path / "pred").glob("*.nii.gz")) == ["demo_005.nii.gz", "demo_006.nii.gz"]


@pytest.mark.parametrize(
    "argv",
    [
        ("train", "fold", "0"),
        ("find-best",),
        ("export-model", "x.zip"),
        ("explain",),
    ],
)
def test_an_empty_workspace(argv: tuple[str, ...], tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli(capsys, *argv, "-w", empty)
    assert result.status == 2
    check_advice(result.err, empty, VALUES)


def test_untrained_folds(trained: Path, tmp_path: Path, capsys) -> None:
    prepared = _copy(trained, tmp_path)
    shutil.rmtree(prepared / "results")
    for argv, folds in (
        (("export-model", tmp_path / "a.zip"), [0]),
        (("export-model", tmp_path / "b.zip", "--folds", "0", "1"), [0]),
        (("predict", "-i", tmp_path, "-o", tmp_path / "out"), [0]),
        (("predict", "-i", tmp_path, "-o", tmp_path / "out", "--folds", "1"), [1]),
    ):
        result = run_cli(capsys, *argv, "-w", prepared)
        assert result.status == 2, result.err
        (args,) = check_advice(result.err, prepared)
        assert (args.command, args.folds, args.config) == ("train", folds, "3d_fullres"), result.err


def test_a_workspace_without_its_record(prepared: Path, tmp_path: Path, capsys) -> None:
    ws = _copy(prepared, tmp_path)
    (ws / "workspace.json").unlink()
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, "--epochs", "1")
    assert result.status == 2, result.err
    (args,) = check_advice(result.err, ws, VALUES)
    assert args.command == "plan_and_preprocess" and args.dataset == VALUES["DATASET"]


def test_missing_preprocessed_cases(prepared: Path, tmp_path: Path, capsys) -> None:
    ws = _copy(prepared, tmp_path)
    next((ws / "preprocessed" / "3d_fullres").glob("*_seg.npy")).unlink()
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, "--epochs", "1")
    assert result.status == 2, result.err
    (args,) = check_advice(result.err, ws)
    assert args.command == "plan_and_preprocess" and Path(args.dataset) == Workspace.at(ws).dataset_root()


def test_find_best_without_folds(prepared: Path, tmp_path: Path, capsys) -> None:
    ws = _copy(prepared, tmp_path)
    result = run_cli(capsys, "find-best", "-w", ws)
    assert result.status == 2
    _printed(("", _FIND_BEST), result.err)
    check_advice(result.err, ws)


def _not_called(*args, **kwargs):
    raise AssertionError("the CPU was calibrated before the refusal")


def test_a_changed_dataset_advises_the_overwrite(
    prepared: Path, dataset_copy: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    ws = _copy(prepared, tmp_path)
    info = json.loads((ws / "workspace.json").read_text())
    (ws / "workspace.json").write_text(json.dumps({**info, "dataset_root": str(dataset_copy)}))
    label = next((dataset_copy / "labelsTr").glob("*.nii.gz"))
    label.unlink()
    (dataset_copy / "imagesTr" / label.name.replace(".nii.gz", "_0000.nii.gz")).unlink()
    data = json.loads((dataset_copy / "dataset.json").read_text())
    (dataset_copy / "dataset.json").write_text(json.dumps({**data, "numTraining": data["numTraining"] - 1}))
    # refused before the CPU is calibrated (calibrating here would take a minute)
    monkeypatch.setattr("autoseg.plan.calibration.cpu_throughput", _not_called)
    result = run_cli(capsys, "plan_and_preprocess", dataset_copy, "-w", ws)
    assert result.status == 2, result.err
    _printed(("", _REDO), result.err)
    check_advice(result.err, ws)


def test_an_edited_plan_advises_preprocessing_again(prepared: Path, tmp_path: Path, capsys) -> None:
    ws = _copy(prepared, tmp_path)
    set_configuration(Workspace.at(ws), "3d_fullres", spacing_mm=(3.0, 1.0, 1.0))
    result = run_cli(capsys, "train", "fold", "0", "-w", ws, "--epochs", "1")
    assert result.status == 2, result.err
    _printed(("", _REDO), result.err)
    check_advice(result.err, ws)


def test_a_plan_too_large_for_this_machine(prepared: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("autoseg.train.memory_check.available_ram_bytes", lambda: 1024)
    result = run_cli(capsys, "check-memory", "-w", prepared)
    assert result.status == 2, result.err
    (args,) = check_advice(result.err, prepared, VALUES)
    assert (args.command, args.config, args.device) == ("check-memory", "3d_fullres", "cpu")


def test_a_cascade_without_its_previous_stage(cascade_ws: Path, inputs: Path, tmp_path: Path, capsys) -> None:
    """The cascade refused, each time advising the 3d_lowres training that mends it: trained while 3d_lowres fold 1
    is untrained, then while its final validation lacks a case, then predicted while 3d_lowres fold 0 is gone."""
    ws = _copy(cascade_ws, tmp_path)
    train_cascade = ("train", "fold", "0", "-c", CASCADE, "-w", ws, "--epochs", "1", "--iterations-per-epoch", "1")
    _refused_advising_lowres(capsys, ("", _TRAIN_LOWRES), ws, train_cascade, [1])

    train(Workspace.at(ws), "3d_lowres", 1, RUN, progress=False)
    validated = next((ws / "results" / "3d_lowres" / "fold_1" / "validation").glob("*.nii.gz"))
    kept = validated.rename(tmp_path / validated.name)
    _refused_advising_lowres(capsys, ("", _RESUME_LOWRES), ws, train_cascade, [1])
    kept.rename(validated)

    train(Workspace.at(ws), CASCADE, 0, RUN, progress=False)
    (ws / "results" / "3d_lowres" / "fold_0" / "checkpoint_final.pt").unlink()
    predict_cascade = ("predict", "-i", inputs, "-o", tmp_path / "pred", "-c", CASCADE, "--folds", "0", "-w", ws)
    key = ("autoseg/predict/cascade.py", "autoseg train fold {listed} -c {stage.name} -w {workspace.root}")
    _refused_advising_lowres(capsys, key, ws, predict_cascade, [0])


def _refused_advising_lowres(capsys, key: tuple[str, str], ws: Path, argv: tuple, folds: list[int]) -> None:
    result = run_cli(capsys, *argv)
    assert result.status == 2, result.err
    _printed(key, result.err)
    for args in check_advice(result.err, ws):
        assert (args.command, args.config, args.folds) == ("train", "3d_lowres", folds), result.err


def test_a_time_budget_the_plan_was_not_sized_for(
    prepared: Path, tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`autoseg train --time-budget 2m` on a CPU plan sized to the default 1 s per iteration (on a simulated clock:
    two 2.4 s steps, then 1 s): train.log advises planning for the budget, and the plan is trained as it is."""
    ws = _copy(prepared, tmp_path)
    clock = simulated_steps(monkeypatch, [2.4, 2.4, 1.0])
    run = RunConfig(epochs=1000, iterations_per_epoch=50, validate=False, cpu_threads=1, time_budget_s=120.0)
    with caplog.at_level(logging.WARNING, logger="autoseg.train.trainer"):
        train(Workspace.at(ws), "3d_fullres", 0, run, progress=False, clock=lambda: clock.now)
    (args,) = check_advice(caplog.text, ws)
    assert (args.command, args.time_budget, args.device, args.overwrite) == ("plan_and_preprocess", 120.0, "cpu", True)
    assert Path(args.dataset) == Workspace.at(ws).dataset_root()
