"""`autoseg demo` as a user runs it: the whole pipeline on CPU reaches the promised Dice (about 5 min)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoseg.demo.run import DEMO_TARGET_DICE


@pytest.mark.slow
def test_demo_reaches_target_dice(tmp_path):
    # A subprocess, as from the shell: torch picks its own thread count there (the unit tests pin one).
    result = subprocess.run(
        [sys.executable, "-m", "autoseg", "-q", "demo", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "predictions" / "summary.json").read_text())
    assert summary["mean_foreground_dice"] >= DEMO_TARGET_DICE
    assert len(summary["cases"]) == 6
    assert "PASS" in result.stdout
    fold = tmp_path / "results" / "3d_fullres" / "fold_0"
    for name in ("checkpoint_final.pt", "checkpoint_best.pt", "metrics.jsonl", "progress.png", "train.log"):
        assert (fold / name).is_file(), name
