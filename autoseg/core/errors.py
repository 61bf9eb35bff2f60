"""autoseg's own errors: raised where a problem is found, with a message that names the file or flag, says
what is wrong and what to do. ``cli.main`` turns each into one line on stderr and an exit status.

- ``InputError`` (exit status 2): bad input the user can fix (a file, a flag, a plan, a workspace).
  It is a ``ValueError``, so ``except ValueError`` around a parser still catches it.
- ``RunError`` (exit status 1): the run failed for a reason outside the input (a worker killed for
  memory, a full disk, a peer process gone).

Anything else reaching ``cli.main`` is a bug in autoseg: it says so and where the traceback was written.
"""

from __future__ import annotations

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
