"""Running the real CLI in-process and checking how it refuses: the exit status, a message that names the
file or argument, no traceback, and nothing written or changed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from autoseg.cli.main import main


@dataclass(frozen=True)
class CliResult:
    status: int
    out: str
    err: str


def run_cli(capsys, *argv: str | Path) -> CliResult:
    """``autoseg -q ARGV`` in this process (argparse's own exits included)."""
    capsys.readouterr()
    try:
        status = main(["-q", *map(str, argv)])
    except SystemExit as e:  # argparse refusing a flag
        status = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return CliResult(status, captured.out, captured.err)


def assert_refused(result: CliResult, status: int, *names: str | Path) -> None:
    """Exit ``status``, no traceback, and a stderr message that names each of ``names``."""
    assert result.status == status, f"exit status {result.status}, expected {status}; stderr:\n{result.err}"
    assert "Traceback" not in result.err and "internal error" not in result.err, result.err
    for name in names:
        assert str(name) in result.err, f"{name!r} not named in:\n{result.err}"


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> content hash of every file under ``root`` (empty when it does not exist)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
