"""Run independent tasks in spawned worker processes, and fail at once, with names, when a worker dies.

``ProcessPoolExecutor`` notices a dead worker (e.g. one the kernel's out-of-memory killer took) and fails
the pending futures with ``BrokenProcessPool``, but cannot say which task the dead worker held. Here each
worker announces ``(key, pid)`` on a queue before it starts a task, synchronously, so the parent knows
every task in flight; the worker whose process exited by itself (not by the pool's SIGTERM to the others)
names the culprit, and ``WorkerDiedError`` carries its key and exit code.

Workers die with their parent: a SIGKILL of the main process (which runs no cleanup) would otherwise leave
them working for minutes. On Linux each worker asks the kernel for a SIGKILL when its parent dies
(``die_with_parent``: ``prctl(PR_SET_PDEATHSIG)``). The kernel sends it when the *thread* that forked the
worker exits; ``run_in_processes`` starts its workers in the calling thread (``submit`` spawns them) and
returns only after they stopped, so that thread outlives them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from autoseg.core.errors import RunError

_STARTED = None  # in a worker: the queue on which it announces (key, pid) before each task


class WorkerDiedError(RunError):
    """A worker process died (killed by the OS, usually for lack of memory).

    ``in_flight``: key -> exit code (negative: killed by that signal; None: unknown) of the task(s) whose
    worker died, or of every task in flight when that cannot be told."""

    def __init__(self, message: str, in_flight: dict[str, int | None]) -> None:
        super().__init__(message)
        self.in_flight = in_flight


def die_with_parent(parent_pid: int, death_signal: int = signal.SIGKILL) -> None:
    """In a worker process: have Linux send it ``death_signal`` (SIGKILL; SIGTERM for a child that must stop
    its own children, e.g. torchrun) when its parent (``parent_pid``) dies; exit now if the parent is already
    gone. Elsewhere (no ``prctl``) nothing: the pool and torch's watchdog notice later."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, int(death_signal), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)


def _init_worker(started: Any, parent_pid: int) -> None:
    global _STARTED
    die_with_parent(parent_pid)
    _STARTED = started


def _announce_and_run(fn: Callable[[Any], Any], key: str, task: Any) -> Any:
    if _STARTED is not None:
        _STARTED.put((key, os.getpid()))  # a SimpleQueue writes at once: the parent has it before any work
    return fn(task)


def run_in_processes(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    keys: Sequence[str],
    processes: int,
    on_result: Callable[[Any], None],
    describe_death: Callable[[dict[str, int | None]], str],
) -> list[Any]:
    """``[fn(task) for task in tasks]`` (in completion order) in ``processes`` spawned workers.

    ``fn`` and the tasks must be picklable (``fn`` a module-level function). ``on_result`` is called in
    this process as each result arrives (a progress bar). An exception in ``fn`` is re-raised here. A
    worker that dies raises ``WorkerDiedError(describe_death(in_flight))`` as soon as the pool notices
    (within a second), and the other workers are stopped.
    """
    ctx = multiprocessing.get_context("spawn")
    started = ctx.SimpleQueue()
    results: list[Any] = []
    pool = ProcessPoolExecutor(processes, mp_context=ctx, initializer=_init_worker, initargs=(started, os.getpid()))
    try:
        futures = {pool.submit(_announce_and_run, fn, k, t): k for k, t in zip(keys, tasks, strict=True)}
        for fut in as_completed(futures):
            try:
                results.append(fut.result())
            except BrokenProcessPool as e:
                done = {k for f, k in futures.items() if f.done() and f.exception() is None}
                exit_codes = _exit_codes(pool)
                in_flight = _in_flight(started, done, exit_codes)
                raise WorkerDiedError(describe_death(in_flight), in_flight) from e
            on_result(results[-1])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _exit_codes(pool: ProcessPoolExecutor, timeout_s: float = 5.0) -> dict[int, int | None]:
    """pid -> exit code of the pool's workers, once they have exited (the pool is stopping them all)."""
    processes = dict(getattr(pool, "_processes", None) or {})  # the executor's own Process objects
    deadline = time.monotonic() + timeout_s
    while True:
        # the dead one may not be reaped yet when the futures fail, and the pool's own thread joins the same
        # processes: when it reaps one first, our join sees no child and its exit code is None until that
        # thread has stored it (1 run in 50 without this loop)
        for p in processes.values():
            p.join(max(0.0, min(0.05, deadline - time.monotonic())))
        codes = {pid: p.exitcode for pid, p in processes.items()}
        if all(c is not None for c in codes.values()) or time.monotonic() >= deadline:
            return codes
        time.sleep(0.01)  # a reaped child's join returns at once: do not spin while the other thread stores its code


def _in_flight(started: Any, done: set[str], exit_codes: dict[int, int | None]) -> dict[str, int | None]:
    """Keys announced and not finished -> their worker's exit code; only the dead worker's if known."""
    running: dict[str, int] = {}
    while not started.empty():
        key, pid = started.get()
        if key not in done:
            running[key] = pid
    died = {pid: code for pid, code in exit_codes.items() if code is not None and code != -signal.SIGTERM}
    culprits = {k: died[pid] for k, pid in running.items() if pid in died}
    return culprits or {k: exit_codes.get(pid) for k, pid in running.items()}
