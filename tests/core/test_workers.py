"""Worker processes die with their parent: a SIGKILL of the parent runs no cleanup, so the kernel must do it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import multiprocessing, os, sys, time
from autoseg.core.workers import die_with_parent

def child(parent_pid, arm):
    if arm:
        die_with_parent(parent_pid)
    time.sleep(60)

if __name__ == "__main__":
    p = multiprocessing.get_context("fork").Process(target=child, args=(os.getpid(), sys.argv[1] == "arm"))
    p.start()
    print(p.pid, flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("arm", [True, False])
def test_a_worker_dies_within_a_second_of_its_parent_only_when_armed(tmp_path: Path, arm: bool) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), "arm" if arm else "no"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.2)  # the child armed its death signal
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 1
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    survived = _alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    assert survived is not arm  # the unarmed control shows the check can fail


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_worker_s_exit_code_is_read_even_when_another_thread_reaps_it_first() -> None:
    """The pool's own thread joins its workers too: when it reaps the dead one first, our join finds no child
    and the exit code stays None until that thread stores it (CI once reported a killed worker without its
    signal this way). ``_exit_codes`` waits for the code instead of returning None."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    from autoseg.core.workers import _exit_codes

    process = multiprocessing.get_context("spawn").Process(target=_kill_self)
    process.start()
    _, status = os.waitpid(process.pid, 0)  # reaped here, as the pool's thread would

    def store_later() -> None:
        time.sleep(0.3)
        process._popen.returncode = os.waitstatus_to_exitcode(status)

    threading.Thread(target=store_later).start()
    assert _exit_codes(SimpleNamespace(_processes={process.pid: process})) == {process.pid: -signal.SIGKILL}
