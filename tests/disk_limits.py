"""Real write failures for tests: a file-size limit (EFBIG) in this process, a small full tmpfs (ENOSPC) and a
read-only mount (EROFS). As root ``chmod`` does not stop writes, so these use the kernel's own mechanisms."""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` fail with EFBIG in this process (Python ignores SIGXFSZ) until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextmanager
def mounted_tmpfs(folder: Path, size: str = "64k", readonly: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` on ``folder`` (created), read-only if asked; unmounted at the end. Skips the test
    where it cannot mount (not root, or no mount permission in this container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Fill the file system of ``folder`` to the last block (a file named ``filler``)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def temporaries(root: Path) -> list[Path]:
    """Every temporary file ``atomic_path`` names (``.<name>.*.tmp*``) under ``root``."""
    return sorted(p for p in root.rglob(".*.tmp*") if p.is_file())
