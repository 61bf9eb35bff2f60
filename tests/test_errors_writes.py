"""Writes that fail, through the real CLI: an output that is a file, a read-only folder, a full disk, a file-size
limit. Each ends with one message naming the file (exit 1; 2 for a bad -o), no traceback, the previous outputs
unchanged, no half-written or temporary file left."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
from cli_checks import assert_refused, run_cli, snapshot
from disk_limits import file_size_limit, fill, mounted_tmpfs, temporaries

TRAIN = [
    "--epochs",
    "1",
    "--iterations-per-epoch",
    "1",
    "--val-iterations",
    "1",
    "--no-validation",
    "--loader-workers",
    "0",
]


def _predict(capsys, trained: Path, inputs: Path, out: Path):
    return run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", trained, "--no-mirror")


def test_predict_output_that_is_a_file_is_refused_before_any_work(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.write_text("my notes")
    before = snapshot(tmp_path)
    assert_refused(_predict(capsys, trained, inputs, out), 2, out, "-o/--output", "not a folder")
    assert snapshot(tmp_path) == before


def test_predict_into_a_read_only_folder_is_refused_before_loading_networks(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    (ws / "results" / "3d_fullres" / "fold_0" / "checkpoint_final.pt").write_bytes(b"")  # never read: checked first
    with mounted_tmpfs(tmp_path / "ro", readonly=True) as out:
        assert_refused(_predict(capsys, ws, inputs, out), 1, out, "Read-only file system")
        assert list(out.iterdir()) == []


def test_predict_onto_a_full_disk_keeps_previous_outputs_and_leaves_nothing_half_written(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    """SimpleITK's NIfTI writer only prints "wrote only 0 of N bytes": before, a 0-byte output and exit 0."""
    first = sorted(p.name.replace("_0000", "") for p in inputs.iterdir())[0]
    with mounted_tmpfs(tmp_path / "disk", size="64k") as out:
        (out / first).write_bytes(b"the previous segmentation")
        fill(out)
        (out / "filler").write_bytes((out / "filler").read_bytes()[:-8192])  # room for the write check only
        fill(out)
        before = snapshot(out)
        assert_refused(_predict(capsys, trained, inputs, out), 1, out / first, "could not write it")
        assert snapshot(out) == before and temporaries(out) == []


def test_predict_past_the_file_size_limit_names_the_output(capsys, trained: Path, inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with file_size_limit(200):  # the tiny label maps compress to ~500 bytes
        result = _predict(capsys, trained, inputs, out)
    assert_refused(result, 1, out, "could not write it", "file-size limit")
    assert [p.name for p in out.iterdir()] == []


def test_train_past_the_file_size_limit_keeps_the_previous_checkpoints(capsys, trained: Path, tmp_path: Path) -> None:
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    fold = ws / "results" / "3d_fullres" / "fold_0"
    before = {name: digest for name, digest in snapshot(fold).items() if name.endswith(".pt")}
    with file_size_limit(4096):  # train.log and metrics.jsonl fit; the curve and the checkpoints do not
        result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
    assert_refused(result, 1, fold, "could not write it", "file-size limit")
    assert {name: digest for name, digest in snapshot(fold).items() if name.endswith(".pt")} == before
    assert temporaries(ws) == []


def test_train_log_on_a_full_disk_stops_with_its_name(capsys, caplog, trained: Path, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO)  # as the CLI's own logging.basicConfig, which pytest's handlers pre-empt
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    fold = ws / "results" / "3d_fullres" / "fold_0"
    shutil.rmtree(fold)
    with mounted_tmpfs(fold, size="64k"):
        fill(fold)
        result = run_cli(capsys, "train", "fold", "0", "-w", ws, *TRAIN)
        assert_refused(result, 1, fold / "train.log", "No space left on device")
        assert sorted(p.name for p in fold.iterdir()) == ["filler", "train.log"]


def test_preprocessing_worker_past_the_file_size_limit_names_the_case_file(
    capsys, tiny_dataset: Path, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    with file_size_limit(16 * 1024):  # plans and fingerprint fit, a case's data array (37 KiB) does not
        result = run_cli(
            capsys,
            "plan_and_preprocess",
            tiny_dataset,
            "-w",
            ws,
            "--gpu-memory",
            "8GiB",
            "--ram",
            "8GiB",
            "--device",
            "cpu",
            "--cpu-flops",
            "1e11",
            "-c",
            "3d_fullres",
            "--processes",
            "2",
        )
    assert_refused(result, 1, ws / "preprocessed" / "3d_fullres", "_data.npy", "could not write it")
    assert temporaries(ws) == []
    for array in (ws / "preprocessed" / "3d_fullres").glob("*.npy"):  # the cases that fit are whole
        np.load(array)


def test_evaluate_summary_on_a_read_only_folder_names_it(capsys, tiny_dataset: Path, tmp_path: Path) -> None:
    labels = tiny_dataset / "labelsTr"
    with mounted_tmpfs(tmp_path / "ro", readonly=True) as folder:
        result = run_cli(capsys, "evaluate", labels, labels, "-o", folder / "summary.json")
        assert_refused(result, 1, folder / "summary.json", "Read-only file system")


def test_evaluate_summary_past_the_size_limit_keeps_the_previous_one(
    capsys, tiny_dataset: Path, tmp_path: Path
) -> None:
    labels = tiny_dataset / "labelsTr"
    summary = tmp_path / "summary.json"
    summary.write_text('{"previous": true}')
    with file_size_limit(100):
        result = run_cli(capsys, "evaluate", labels, labels, "-o", summary)
    assert_refused(result, 1, summary, "could not write it")
    assert summary.read_text() == '{"previous": true}' and temporaries(tmp_path) == []
