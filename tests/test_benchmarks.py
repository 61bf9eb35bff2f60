"""The benchmark scripts still start: each imports what it uses and parses its flags (``--help``). A rename in
autoseg broke two of them once without any test noticing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")))
def test_benchmark_script_starts(script: str) -> None:
    result = subprocess.run(
        [sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
