"""One writer per part of a workspace: the lock file, its record, taking and releasing it, and asking who holds it.

A command that writes a part (the plan and preprocessed data, one fold's results, inference.json) holds that part's
lock for its lifetime (``hold``); the paths are ``Workspace``'s (``plan_lock``, ``fold_lock``, ``inference_lock``).
A lock is a file under ``<workspace>/.locks/`` locked with ``flock``: the kernel releases it when its process ends,
however it ends (kill -9 included), so whether a holder still runs is never guessed from a process id. The file
holds a ``LockRecord`` (JSON: host, process id, command, start time, the part) for the messages:

- a second writer refuses at once (``InputError``, exit status 2) naming the holder, the lock file and what to do;
- a file whose lock is free but whose record names a process of this host was left by a process that is gone
  (killed): the next writer takes it over with a warning. A record of another host is refused instead: a file
  system shared between hosts may not carry locks across them, so autoseg cannot tell whether that process runs;
- a released lock's file is deleted (and ``.locks/`` when it is empty), so a workspace at rest holds none.

Readers never wait: ``holder`` says who holds a lock now, and ``refuse_while_held`` refuses naming them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from autoseg.core.artifacts import Artifact, ArtifactError, to_dict
from autoseg.core.errors import InputError

log = logging.getLogger("autoseg")

# how long a writer waits for a lock that is free in all but name: its record still being written by the process
# that just took it, or held by the forked workers of a holder that is gone, which end within a second or two
SETTLE_S = 5.0
POLL_S = 0.05
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class LockRecord(Artifact):
    """What a lock file says about its holder. ``started``: ISO 8601 local time with its offset. ``replacing``: the
    holder replaces what readers read (``plan_and_preprocess --overwrite``), so they refuse while it runs."""

    SCHEMA_VERSION = 1
    KIND = "lock"

    part: str  # what it writes, relative to the workspace: "results/3d_fullres/fold_0"
    command: str
    host: str
    pid: int
    started: str
    replacing: bool = False

    def describe(self) -> str:
        return f"`{self.command}` (process {self.pid} on host {self.host}, started {self.started})"


def this_process(part: str, command: str, replacing: bool = False) -> LockRecord:
    """The record of this process holding ``part``; ``command`` "" is this process's command line."""
    return LockRecord(
        part=part,
        command=command or shlex.join(sys.argv),
        host=socket.gethostname(),
        pid=os.getpid(),
        started=datetime.now().astimezone().isoformat(timespec="seconds"),
        replacing=replacing,
    )


@contextmanager
def hold(path: Path, record: LockRecord) -> Iterator[LockRecord]:
    """Hold the lock ``path`` for the block, as ``record`` says (``this_process``). Raises ``InputError`` at once
    when another process holds it; takes over, with a warning, a lock left by a process of this host that is gone."""
    fd = _acquire(path)
    try:
        _take_over(path, fd, record)
    except BaseException:
        _release(path, fd, delete=False)
        raise
    try:
        yield record
    finally:
        _release(path, fd, delete=True)


@contextmanager
def hold_all(locks: Sequence[tuple[Path, LockRecord]]) -> Iterator[None]:
    """Hold every lock of ``locks`` (each path once) for the block; none is held if one is refused."""
    with ExitStack() as stack:
        for path in dict.fromkeys(p for p, _ in locks):
            stack.enter_context(hold(path, next(r for p, r in locks if p == path)))
        yield


def holder(path: Path) -> LockRecord | None:
    """Who holds the lock ``path`` now (None: nobody). Never waits for the lock; waits at most ``SETTLE_S`` for the
    record of a holder that has just taken it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _settled_record(fd) or _unknown_holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_while_held(path: Path, workspace: Path, doing: str, only_replacing: bool = False) -> None:
    """Raise ``InputError`` naming the holder of ``path`` when one runs (``only_replacing``: one that replaces what
    readers read). ``doing``: what refuses, e.g. "autoseg predict reads the plan and the trained folds"."""
    record = holder(path)
    if record is None or (only_replacing and not record.replacing):
        return
    raise InputError(
        f"{workspace}: {record.part} is being {'replaced' if record.replacing else 'written'} by {record.describe()}, "
        f"which holds {path}; {doing}. Rerun when it has finished (or stop it: {_stop_hint(record, path)})"
    )


def _acquire(path: Path) -> int:
    """A file descriptor of ``path`` holding its exclusive flock; ``InputError`` when another process holds it."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = _open(path)
        if fd is None:  # .locks/ was removed by a release in between: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = _read_record(fd)
            os.close(fd)
            if (held is not None and _running(held)) or time.monotonic() > deadline:
                raise InputError(_held_message(path, held)) from None
            time.sleep(POLL_S)
            continue
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder deleted it while releasing: the lock is the file now at ``path``


def _open(path: Path) -> int | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _take_over(path: Path, fd: int, record: LockRecord) -> None:
    """Write ``record`` into the held lock file; what it held before was left by a process that is gone."""
    previous, raw = _read_record(fd), os.pread(fd, MAX_RECORD_BYTES, 0)
    if previous is not None and previous.host != record.host:
        raise InputError(
            f"{path} names {previous.describe()}, which was writing {previous.part} from another host; autoseg "
            f"cannot tell from {record.host} whether it still runs. If it does not, delete {path} and rerun"
        )
    data = (json.dumps({"schema_version": LockRecord.SCHEMA_VERSION, **to_dict(record)}, indent=2) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    if previous is not None:
        log.warning(
            "%s: taking over the lock on %s from %s, which is gone (killed?); what it left unfinished is redone or "
            "refused as usual",
            path,
            previous.part,
            previous.describe(),
        )
    elif raw.strip():
        log.warning("%s: taking over a lock whose record cannot be read (its process is gone)", path)


def _release(path: Path, fd: int, delete: bool) -> None:
    try:
        if delete:
            path.unlink(missing_ok=True)  # before unlocking: a waiter that then gets this file sees it is gone
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    if delete:
        try:
            path.parent.rmdir()
        except OSError as e:  # another lock is in it, or it is gone already
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise


def _read_record(fd: int) -> LockRecord | None:
    """The record in the lock file (None: empty, being written, or not a record)."""
    raw = os.pread(fd, MAX_RECORD_BYTES, 0)
    try:
        return LockRecord.from_payload(json.loads(raw), "lock file")
    except (ValueError, ArtifactError):
        return None


def _settled_record(fd: int) -> LockRecord | None:
    deadline = time.monotonic() + SETTLE_S
    while (record := _read_record(fd)) is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return record


def _unknown_holder(path: Path) -> LockRecord:
    """A holder whose record cannot be read (not written by autoseg, or damaged): pid 0, named by ``fuser``."""
    return LockRecord(part=f"the part {path.name} guards", command="unknown", host="unknown", pid=0, started="unknown")


def _stop_hint(record: LockRecord, path: Path) -> str:
    return f"kill {record.pid}" if record.pid else f"`fuser {path}` names it"


def _running(record: LockRecord) -> bool:
    """Whether the process ``record`` names may run: any process of another host, an existing one of this host."""
    if record.host != socket.gethostname():
        return True
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _held_message(path: Path, held: LockRecord | None) -> str:
    if held is None:
        held = _unknown_holder(path)
    if held.pid and not _running(held):
        return (
            f"{held.part} is locked by the worker processes of {held.describe()}, which is gone; its lock file is "
            f"{path}. Wait for them to end, or stop them (`fuser {path}` names them), then rerun"
        )
    return (
        f"{held.part} is being written by {held.describe()}; its lock file is {path}. Wait for it to finish, or stop "
        f"it ({_stop_hint(held, path)}), then rerun: a lock whose process is gone is taken over by the next command"
    )
