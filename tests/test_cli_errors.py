"""The CLI's one error path: flags refused at parse time before any work, autoseg's own errors as one message and
an exit status, OS errors naming the file, anything else reported as a bug with its traceback in a file."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from cli_checks import assert_refused, run_cli

import autoseg.cli.main as cli
from autoseg.core.errors import InputError, RunError

BAD_FLAGS = {
    "plan_and_preprocess": [
        ("--gpu-memory", "0"),
        ("--gpu-memory", "nan"),
        ("--gpu-memory", "-8GiB"),
        ("--gpu-memory", "inf"),
        ("--ram", "0"),
        ("--cpu-flops", "nan"),
        ("--cpu-flops", "0"),
        ("--cpu-flops", "-5e9"),
        ("--processes", "0"),
        ("--processes", "two"),
        ("--precompute-augmentations", "-1"),
        ("--time-budget", "0m"),
        ("--time-budget", "soon"),
        ("--seconds-per-iteration", "0"),
        ("--seconds-per-iteration", "nan"),
    ],
    "train": [
        ("--epochs", "0"),
        ("--epochs", "-1"),
        ("--epochs", "1.5"),
        ("--iterations-per-epoch", "0"),
        ("--val-iterations", "0"),
        ("--seed", "-1"),
        ("--seed", str(2**32)),
        ("--loader-workers", "-1"),
        ("--gpus", "0"),
        ("--time-budget", "0s"),
        ("--time-budget", "-1h"),
        ("--time-budget", "soon"),
    ],
    "predict": [
        ("--tile-batch-size", "0"),
        ("--tile-batch-size", "-2"),
        ("--tile-batch-size", "many"),
        ("--tta", "x"),
        ("--tta", "-1"),
        ("--preprocess-workers", "-1"),
        ("--export-workers", "two"),
        ("--tile", "huge"),
    ],
    "demo": [("--num-train", "1"), ("--epochs", "0"), ("--iterations-per-epoch", "-3")],
    "make-demo-dataset": [("--num-train", "0"), ("--num-test", "-1"), ("--seed", "-1")],
}


def _command_line(command: str, tmp_path: Path) -> list[str]:
    ws = str(tmp_path / "ws")
    return {
        "plan_and_preprocess": [command, str(tmp_path / "Dataset001_X"), "-w", ws],
        "train": [command, "fold", "0", "-w", ws],
        "predict": [command, "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "-w", ws],
        "demo": [command, "-w", ws],
        "make-demo-dataset": [command, ws],
    }[command]


@pytest.mark.parametrize(("command", "flag", "value"), [(c, f, v) for c, flags in BAD_FLAGS.items() for f, v in flags])
def test_a_bad_flag_is_refused_at_parse_time_naming_it_before_anything_is_written(
    command: str, flag: str, value: str, tmp_path: Path, capsys
) -> None:
    result = run_cli(capsys, *_command_line(command, tmp_path), flag, value)
    assert_refused(result, 2, f"argument {flag}")
    assert list(tmp_path.iterdir()) == []  # no workspace, no output folder, no dataset


def test_fold_is_checked_at_parse_time(tmp_path: Path, capsys) -> None:
    result = run_cli(capsys, "train", "fold", "1", "1", "-w", tmp_path / "ws")  # a fold twice
    assert_refused(result, 2, "fold '1 1'", "fold all")
    assert list(tmp_path.iterdir()) == []


def _failing_command(monkeypatch, error: BaseException) -> None:
    def explode(args, progress):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "explain", explode)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InputError("plans.json: bad key 'x'; remove it"), 2),
        (RunError("a worker died; rerun with fewer --processes"), 1),
    ],
)
def test_autoseg_errors_become_one_line_and_their_exit_status(error, status, monkeypatch, capsys) -> None:
    _failing_command(monkeypatch, error)
    result = run_cli(capsys, "explain")
    assert_refused(result, status, f"autoseg explain: error: {error}")
    assert result.err.strip().count("\n") == 0


def test_an_os_error_names_the_file_and_exits_1(monkeypatch, capsys) -> None:
    _failing_command(monkeypatch, OSError(errno.ENOSPC, "No space left on device", "/out/case_1.nii.gz"))
    result = run_cli(capsys, "explain")
    assert_refused(result, 1, "/out/case_1.nii.gz: No space left on device")


def test_an_unexpected_error_says_it_is_a_bug_and_where_the_traceback_is(monkeypatch, capsys) -> None:
    _failing_command(monkeypatch, TypeError("unsupported operand"))
    result = run_cli(capsys, "explain")
    assert result.status == 1
    assert "internal error: TypeError: unsupported operand" in result.err and "bug in autoseg" in result.err
    assert "Traceback" not in result.err
    path = Path(re.search(r"The traceback is in (\S+?); please report", result.err).group(1))
    assert "TypeError: unsupported operand" in path.read_text() and "explode" in path.read_text()
    path.unlink()


@pytest.mark.parametrize("argv", [["--debug", "explain"], ["explain", "--debug"]])
def test_debug_lets_the_traceback_through(argv: list[str], monkeypatch) -> None:
    _failing_command(monkeypatch, InputError("plans.json: bad key"))
    with pytest.raises(InputError, match="bad key"):
        cli.main(argv)


def test_interrupt_exits_130_without_a_traceback(monkeypatch, capsys) -> None:
    _failing_command(monkeypatch, KeyboardInterrupt())
    result = run_cli(capsys, "explain")
    assert result.status == 130 and "interrupted" in result.err and "Traceback" not in result.err


@pytest.mark.parametrize("command", ["train", "explain"])
def test_a_hand_edited_plan_no_stage_can_run_is_refused_before_training(
    command: str, prepared: Path, tmp_path: Path, capsys
) -> None:
    import json
    import shutil

    from cli_checks import snapshot

    ws = tmp_path / "ws"
    shutil.copytree(prepared, ws)
    plans = json.loads((ws / "plans.json").read_text())
    plans["configurations"]["3d_fullres"]["batch_size"] = 0
    (ws / "plans.json").write_text(json.dumps(plans))
    before = snapshot(ws)
    argv = ["train", "fold", "0", "-w", ws, "--epochs", "1"] if command == "train" else ["explain", "-w", ws]
    result = run_cli(capsys, *argv)
    assert_refused(result, 2, ws / "plans.json", "configuration '3d_fullres'", "batch_size (0)")
    assert snapshot(ws) == before and not (ws / "results").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["train", "predict"])
def test_device_cuda_without_cuda_is_refused_naming_the_flag(command: str, tmp_path: Path, capsys) -> None:
    result = run_cli(capsys, *_command_line(command, tmp_path), "--device", "cuda")
    assert_refused(result, 2, "--device cuda", "--device cpu")
    assert list(tmp_path.iterdir()) == []
