"""Does ``autoseg train --time-budget T`` end within T? (issue 16; run by hand)

Makes the demo dataset (``autoseg make-demo-dataset``), plans and preprocesses it on CPU (``autoseg
plan_and_preprocess --device cpu``, once per data dir), then for each budget runs ``autoseg train fold 0
--time-budget T`` in a subprocess, from a fresh results folder, and measures the process's wall time (its start,
imports and setup included, as a user's clock would). ``--busy N`` starts N busy-looping processes that share the
CPU, ``--busy-after S`` seconds after the training starts (0: from the start): the rate changes under the run.

Prints per run: the budget, the measured wall seconds, their ratio (the goal: 0.85-1.05), the plan in force at
the end, the final validation (cases, ``--tta``, estimated and measured seconds) and every decision's log line.

    python benchmarks/time_budget.py [--budget 12m 30m] [--busy 1 --busy-after 120] [--cases 24] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIG = "3d_fullres"


def autoseg(*args: str) -> None:
    """Run ``python -m autoseg ARGS``; exit with its stderr's tail when it fails."""
    result = subprocess.run([sys.executable, "-m", "autoseg", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"autoseg {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")


def prepare(data_dir: Path, cases: int) -> Path:
    """The demo dataset (``cases`` training cases), planned and preprocessed on CPU; returns the workspace (made
    once per ``data_dir``)."""
    dataset, workspace = data_dir / "Dataset001_Demo", data_dir / "ws"
    if not (workspace / "plans.json").is_file():
        t0 = time.perf_counter()
        autoseg("make-demo-dataset", str(dataset), "--num-train", str(cases), "--num-test", "0")
        autoseg("plan_and_preprocess", str(dataset), "-w", str(workspace), "--device", "cpu", "-c", CONFIG)
        print(f"demo dataset planned and preprocessed in {time.perf_counter() - t0:.0f} s: {workspace}")
    return workspace


def busy_later(n: int, after_s: float, started: list[subprocess.Popen]) -> threading.Timer:
    """Start ``n`` busy-looping processes after ``after_s`` seconds (appended to ``started``)."""

    def start() -> None:
        started.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n))

    timer = threading.Timer(after_s, start)
    timer.start()
    return timer


def train(workspace: Path, budget: str, busy: int, busy_after_s: float) -> float:
    """``autoseg train fold 0 --time-budget BUDGET`` from a fresh results folder; its wall seconds."""
    shutil.rmtree(workspace / "results", ignore_errors=True)
    others: list[subprocess.Popen] = []
    timer = busy_later(busy, busy_after_s, others) if busy else None
    t0 = time.perf_counter()
    try:
        autoseg("train", "fold", "0", "-w", str(workspace), "-c", CONFIG, "--device", "cpu", "--time-budget", budget)
        return time.perf_counter() - t0
    finally:
        if timer is not None:
            timer.cancel()
        for p in others:
            p.kill()
            p.wait()


def report(workspace: Path, budget_s: float, wall_s: float) -> None:
    """The run's figures from run.json and train.log."""
    fold = workspace / "results" / CONFIG / "fold_0"
    run = json.loads((fold / "run.json").read_text())
    final = run.get("final_validation", {})
    log = (fold / "train.log").read_text()
    measured = re.search(r"final validation took ([0-9.]+) s", log)
    print(
        f"budget {budget_s:.0f} s | wall {wall_s:.1f} s | ratio {wall_s / budget_s:.3f} | "
        f"{run['schedule']['epochs']} epochs x {run['schedule']['iterations_per_epoch']} iterations | final "
        f"validation: {len(final.get('cases', []))} case(s), tta {final.get('tta')}, estimated "
        f"{final.get('estimated_seconds', float('nan')):.1f} s, took {measured.group(1) if measured else '?'} s"
    )
    for line in log.splitlines():
        if "time budget" in line:
            print("   ", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", nargs="+", default=["12m"], help="--time-budget values to run (default: 12m)")
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes sharing the CPU (default: 0)")
    parser.add_argument(
        "--busy-after",
        type=float,
        default=0.0,
        metavar="S",
        help="start them this many seconds into each run (default: 0, from the start)",
    )
    parser.add_argument("--cases", type=int, default=24, help="demo training cases (default: 24, the demo's)")
    parser.add_argument("--data-dir", type=Path, default=None, help="dataset + workspace (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()

    from autoseg.train.schedule import parse_duration

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="autoseg-time-budget-"))
    try:
        workspace = prepare(data_dir, args.cases)
        for budget in args.budget:
            wall_s = train(workspace, budget, args.busy, args.busy_after)
            report(workspace, parse_duration(budget), wall_s)
    finally:
        if args.data_dir is None and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
