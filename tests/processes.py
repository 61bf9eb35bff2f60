"""Real processes for kill tests: start the CLI in a subprocess on one CPU, SIGKILL it when ready, and check
that none of its descendants outlives it (read from /proc, Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ONE_CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


@contextmanager
def one_cpu() -> Iterator[None]:
    """This process on one CPU for the block (as the subprocesses run)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ONE_CPU})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start(*argv: str | Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autoseg.cli", "-q", *map(str, argv)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.sched_setaffinity(0, {ONE_CPU}),
    )


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def kill_when(process: subprocess.Popen, ready: Callable[[list[int]], bool], timeout_s: float = 60) -> list[int]:
    """SIGKILL ``process`` once ``ready(its descendants)``; assert it was still running then, and that none of
        its descendants is alive 2 s later (without a death signal torch's loader workers lived 5 s, the
    preprocessing workers until done). Returns the descendants it had."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"finished before the kill:\n{process.stderr.read().decode()}"
        workers = descendants(process.pid)
        if ready(workers):
            break
        assert time.monotonic() < deadline, "never ready to kill"
        time.sleep(0.01)
    process.kill()
    process.wait()
    process.stderr.close()
    deadline = time.monotonic() + 2
    while (survivors := [pid for pid in workers if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in survivors:  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"{len(survivors)} of {len(workers)} worker(s) outlived the killed main process"
    return workers
