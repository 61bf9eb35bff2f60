"""autoseg's own errors: raised where a problem is found, with a message that names the file or flag, says
what is wrong and what to do. ``cli.main`` turns each into one line on stderr and an exit status.

- ``InputError`` (exit status 2): bad input the user can fix (a file, a flag, a plan, a workspace).
  It is a ``ValueError``, so ``except ValueError`` around a parser still catches it.
- ``RunError`` (exit status 1): the run failed for a reason outside the input (a worker killed for
  memory, a full disk, a peer process gone).

Anything else reaching ``cli.main`` is a bug in autoseg: it says so and where the traceback was written.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


class AutosegError(Exception):
    """An anticipated error; ``exit_status`` is what ``autoseg`` exits with."""

    exit_status = EXIT_FAILURE


class InputError(AutosegError, ValueError):
    """Bad input the user can fix: the message names the file or argument and what to change."""

    exit_status = EXIT_BAD_INPUT


class RunError(AutosegError, RuntimeError):
    """The run failed for a reason outside the input (killed worker, full disk, lost peer)."""

    exit_status = EXIT_FAILURE


def describe(error: BaseException) -> tuple[str, int] | None:
    """The message and exit status of an anticipated error: autoseg's own, or the operating system's (a full
    disk, a read-only folder, no memory), whose message says what to do. None: a bug."""
    if isinstance(error, AutosegError):
        return str(error), error.exit_status
    if isinstance(error, OSError) and error.errno is not None:
        where = f"{error.filename}: " if error.filename else ""
        return (
            f"{where}{error.strerror} (errno {error.errno}); nothing unfinished was kept. Free space, fix the "
            "permissions or choose another folder, then rerun"
        ), EXIT_FAILURE
    if isinstance(error, MemoryError):
        return (
            "out of host memory; give a smaller --ram budget to plan_and_preprocess or close other programs, then rerun"
        ), EXIT_FAILURE
    return None


def write_traceback(prefix: str, error: BaseException) -> Path | str:
    """Write ``error``'s traceback to a new file in the temporary folder, for a bug report; its path."""
    name = f"{prefix.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.traceback.txt"
    path = Path(tempfile.gettempdir()) / name
    try:
        path.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return "(not written: the temporary folder is not writable)"
    return path
