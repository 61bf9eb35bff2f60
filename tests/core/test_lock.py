"""The lock of a workspace's part (``autoseg.core.lock``): a second holder refused naming the first, a lock left by a
killed process taken over with a warning, one still held by a killed process's forked worker refused, a record of
another host refused, nothing left behind on release, and readers that ask without waiting."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoseg.core import lock
from autoseg.core.errors import InputError
from autoseg.core.lock import LockRecord, hold, hold_all, holder, refuse_while_held, this_process

# a process that takes the lock argv[1] and prints its pid (and, with argv[2] == "fork", that of a forked child that
# shares the lock's open file and outlives it), then sleeps until killed
HOLDER = """
import os, sys, time
from pathlib import Path
from autoseg.core.lock import hold, this_process
with hold(Path(sys.argv[1]), this_process("results/3d_fullres/fold_0", "autoseg train fold 0")):
    child = os.fork() if sys.argv[2] == "fork" else -1
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), child, flush=True)
    time.sleep(60)
"""


def _start_holder(path: Path, fork: bool = False) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(lock.__file__).parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), "fork" if fork else "-"], stdout=subprocess.PIPE, env=env, text=True
    )
    _, child = map(int, process.stdout.readline().split())
    return process, child


def test_a_second_holder_is_refused_at_once_naming_the_first(tmp_path: Path) -> None:
    path = tmp_path / ".locks" / "plan.lock"
    with hold(path, this_process("the plan and preprocessed data", "autoseg plan_and_preprocess D")) as first:
        t0 = time.monotonic()
        with pytest.raises(InputError) as refused:
            with hold(path, this_process("the plan and preprocessed data", "autoseg plan D")):
                pass
        assert time.monotonic() - t0 < 1
        message = str(refused.value)
        for named in ("`autoseg plan_and_preprocess D`", f"process {os.getpid()}", socket.gethostname(), first.started):
            assert named in message
        assert str(path) in message and f"kill {os.getpid()}" in message
        assert json.loads(path.read_text())["command"] == "autoseg plan_and_preprocess D"  # the first's, unchanged


def test_a_released_lock_leaves_no_file_and_no_folder(tmp_path: Path) -> None:
    folder = tmp_path / ".locks"
    with hold_all([(folder / "a.lock", this_process("a", "x")), (folder / "b.lock", this_process("b", "x"))]):
        assert sorted(p.name for p in folder.iterdir()) == ["a.lock", "b.lock"]
    assert not folder.exists()
    with hold(folder / "a.lock", this_process("a", "x")):  # and it can be taken again
        pass


def test_hold_all_holds_none_when_one_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / ".locks" / "a.lock", tmp_path / ".locks" / "b.lock"
    with hold(b, this_process("b", "other")):
        with pytest.raises(InputError, match="`other`"):
            with hold_all([(a, this_process("a", "x")), (b, this_process("b", "x"))]):
                pass
        assert holder(a) is None and not a.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills a real process")
def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_warning(tmp_path: Path, caplog) -> None:
    path = tmp_path / ".locks" / "results.3d_fullres.fold_0.lock"
    process, _ = _start_holder(path)
    with pytest.raises(InputError, match=f"process {process.pid} "):
        with hold(path, this_process("results/3d_fullres/fold_0", "autoseg train fold 0")):
            pass
    process.kill()
    process.wait()
    assert json.loads(path.read_text())["pid"] == process.pid  # the record outlives its process
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        with hold(path, this_process("results/3d_fullres/fold_0", "autoseg train fold 0 --resume")):
            assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"process {process.pid} " in caplog.text and "taking over" in caplog.text and "gone" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills a real process")
def test_a_lock_still_held_by_a_killed_process_s_worker_is_refused_naming_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lock, "SETTLE_S", 0.3)
    path = tmp_path / ".locks" / "results.3d_fullres.fold_0.lock"
    process, child = _start_holder(path, fork=True)
    process.kill()
    process.wait()
    try:
        with pytest.raises(InputError, match=f"worker processes of .*process {process.pid} .*which is gone"):
            with hold(path, this_process("results/3d_fullres/fold_0", "x")):
                pass
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while holder(path) is not None and time.monotonic() < deadline:  # the child is reaped by init
        time.sleep(0.05)
    with hold(path, this_process("results/3d_fullres/fold_0", "x")):
        pass


def test_a_record_of_another_host_is_refused_not_taken_over(tmp_path: Path) -> None:
    path = tmp_path / ".locks" / "plan.lock"
    path.parent.mkdir()
    record = LockRecord("the plan and preprocessed data", "autoseg plan D", "node-7", 4242, "2030-01-01T00:00:00+00:00")
    path.write_text(json.dumps({"schema_version": 1, **record.__dict__}))
    with pytest.raises(InputError) as refused:
        with hold(path, this_process("the plan and preprocessed data", "autoseg plan D")):
            pass
    message = str(refused.value)
    assert "node-7" in message and "4242" in message and f"delete {path}" in message
    assert json.loads(path.read_text())["host"] == "node-7"  # kept for the user to judge


def test_readers_ask_without_waiting_and_refuse_only_what_they_must(tmp_path: Path) -> None:
    path = tmp_path / ".locks" / "plan.lock"
    assert holder(path) is None
    refuse_while_held(path, tmp_path, "predict reads it", only_replacing=True)
    with hold(path, this_process("the plan and preprocessed data", "autoseg plan D")):
        assert holder(path).command == "autoseg plan D"
        refuse_while_held(path, tmp_path, "predict reads it", only_replacing=True)  # adds, replaces nothing
        with pytest.raises(InputError, match=r"being written by `autoseg plan D`.*; train reads it\. Rerun"):
            refuse_while_held(path, tmp_path, "train reads it")
    with hold(path, this_process("the plan and preprocessed data", "autoseg plan D --overwrite", replacing=True)):
        with pytest.raises(InputError, match=f"{tmp_path}: the plan and preprocessed data is being replaced by"):
            refuse_while_held(path, tmp_path, "predict reads it", only_replacing=True)
    assert holder(path) is None
