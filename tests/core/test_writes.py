"""Writes that fail (file-size limit, full disk, read-only folder) or come out short: ``WriteError`` names the
file, the previous version stays, no temporary file is left; appends never leave half a line."""

from __future__ import annotations

import gzip
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
from disk_limits import file_size_limit, fill, mounted_tmpfs, temporaries

from autoseg.core.artifacts import (
    LogFile,
    WriteError,
    append_line,
    atomic_path,
    atomic_save_npy,
    check_writable_folder,
    remove_stale_temporaries,
    write_json,
)
from autoseg.core.errors import InputError, RunError


def test_a_write_past_the_file_size_limit_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "case.npy"
    atomic_save_npy(target, np.zeros(4))
    before = target.read_bytes()
    with pytest.raises(WriteError, match="case.npy: could not write it .*file-size limit of 4096 bytes") as info:
        with file_size_limit(4096):
            atomic_save_npy(target, np.zeros(10_000))
    assert isinstance(info.value, RunError) and info.value.path == target
    assert target.read_bytes() == before and temporaries(tmp_path) == []


def test_a_write_error_raised_in_a_worker_process_arrives_whole() -> None:
    error = pickle.loads(pickle.dumps(WriteError("/ws/case_data.npy", "File too large")))
    assert isinstance(error, WriteError) and error.path == Path("/ws/case_data.npy") and "File too large" in str(error)


def test_a_short_gzip_that_its_writer_did_not_report_is_refused(tmp_path: Path) -> None:
    """SimpleITK's NIfTI writer prints "wrote only N of M bytes" and returns: the rename must not happen."""
    target = tmp_path / "seg.nii.gz"
    target.write_bytes(b"old")
    whole = gzip.compress(np.random.default_rng(0).bytes(50_000))
    with pytest.raises(WriteError, match="seg.nii.gz: .*gzip stream is incomplete"):
        with atomic_path(target, suffix=".nii.gz") as tmp:
            tmp.write_bytes(whole[: len(whole) // 2])
    assert target.read_bytes() == b"old" and temporaries(tmp_path) == []


def test_a_file_cut_at_the_size_limit_without_an_error_is_refused(tmp_path: Path) -> None:
    """A writer that ignores a short write leaves a file exactly as large as the limit."""
    target = tmp_path / "image.nii"
    with pytest.raises(WriteError, match="image.nii: .*file-size limit of 2000 bytes"):
        with file_size_limit(2000), atomic_path(target, suffix=".nii") as tmp:
            with open(tmp, "wb", buffering=0) as f:
                f.write(b"x" * 2000)  # the limit itself: the kernel refuses only the next byte
    assert not target.exists() and temporaries(tmp_path) == []


def test_a_full_disk_is_refused_even_if_the_writer_says_nothing(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "disk") as disk:
        target = disk / "seg.nii"
        with pytest.raises(WriteError, match="seg.nii: .*no space left"):
            with atomic_path(target, suffix=".nii") as tmp:
                tmp.write_bytes(b"header")
                fill(disk)
        assert not target.exists() and temporaries(disk) == []


def test_a_read_only_folder_names_the_file(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", readonly=True) as folder:
        with pytest.raises(WriteError, match="plans.json: could not write it .*Read-only file system"):
            write_json(folder / "plans.json", {"a": 1})
        with pytest.raises(WriteError, match="Read-only file system"):
            check_writable_folder(folder, "-o/--output")


def test_check_writable_folder_creates_it_and_refuses_a_file(tmp_path: Path) -> None:
    assert check_writable_folder(tmp_path / "a" / "b", "-o").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe file is gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="-o .*file is a file, not a folder"):
        check_writable_folder(tmp_path / "file", "-o")


def test_a_failed_append_leaves_no_half_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    append_line(log, '{"epoch": 0}')
    with pytest.raises(WriteError, match="metrics.jsonl"), file_size_limit(40):
        append_line(log, '{"epoch": 1, "loss": 0.123456789012345678}')
    assert log.read_text() == '{"epoch": 0}\n'


def test_a_log_file_that_cannot_be_written_stops_the_run_without_a_traceback(tmp_path: Path, capsys) -> None:
    logger = logging.getLogger("autoseg.test_writes")
    handler = LogFile(tmp_path / "train.log")
    logger.addHandler(handler)
    try:
        with pytest.raises(WriteError, match="train.log"), file_size_limit(10):
            logger.warning("a line longer than ten bytes")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "Traceback" not in capsys.readouterr().err


def test_stale_temporaries_of_named_outputs_only(tmp_path: Path) -> None:
    for name in (".a.nii.gz.x1.tmp.nii.gz", ".b.nii.gz.x2.tmp.nii.gz", ".users.tmp", "a.nii.gz"):
        (tmp_path / name).write_text("x")
    assert [p.name for p in remove_stale_temporaries(tmp_path, ["a.nii.gz"])] == [".a.nii.gz.x1.tmp.nii.gz"]
    assert sorted(p.name for p in remove_stale_temporaries(tmp_path)) == [".b.nii.gz.x2.tmp.nii.gz", ".users.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["a.nii.gz"]
