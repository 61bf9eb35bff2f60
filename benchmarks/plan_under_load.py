"""Does a CPU plan depend on how busy the machine was while planning? (issue 16; run by hand)

Plans the demo dataset (``autoseg plan --device cpu``, in subprocesses) three times:

1. idle, with an empty measurement cache (``AUTOSEG_CACHE_DIR``): the CPU throughput is measured and cached;
2. while ``--busy`` processes (``python -c "while True: pass"``) keep the cores busy, with that cache: the plan
   must be byte-identical to 1;
3. still busy, with another empty cache: what a first measurement on busy cores gives (not cached) and how far
   that plan is from 1.

Prints each run's throughput line (where the figure came from), its wall seconds, and the patch, batch and network
width of every configuration. Other processes on the machine change the figures of 1 and 3: say so beside them.

    python benchmarks/plan_under_load.py [--busy 2] [--data-dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def plan(dataset: Path, workspace: Path, cache: Path) -> tuple[dict, str, float]:
    """``autoseg plan`` on CPU with a fixed memory budget; (plans.json as a dict, its throughput line, seconds)."""
    env = {**os.environ, "AUTOSEG_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoseg",
            "plan",
            str(dataset),
            "-w",
            str(workspace),
            "--device",
            "cpu",
            "--gpu-memory",
            "8GiB",
            "--ram",
            "8GiB",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - t0
    if result.returncode != 0:
        sys.exit(f"autoseg plan failed ({result.returncode}):\n{result.stderr[-3000:]}")
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("CPU throughput")), "(no throughput line)")
    return json.loads((workspace / "plans.json").read_text()), line, seconds


def summary(plans: dict) -> str:
    return "; ".join(
        f"{name}: patch {'x'.join(map(str, c['patch_size']))} batch {c['batch_size']} width "
        f"{c['network']['features_per_stage'][0]} {c['predicted_seconds_per_iteration']:.2f} s/it"
        for name, c in plans["configurations"].items()
    )


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per CPU)")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the demo dataset and workspaces go")
    parser.add_argument("--keep", action="store_true", help="keep the folder afterwards")
    args = parser.parse_args()

    from autoseg.demo.data import make_demo_dataset

    root = args.data_dir or Path(tempfile.mkdtemp(prefix="plan_under_load_"))
    dataset = root / "Dataset001_Demo"
    if not (dataset / "dataset.json").is_file():
        make_demo_dataset(dataset, seed=0)
    print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average; other processes count too)")
    idle, idle_line, idle_s = plan(dataset, root / "ws_idle", root / "cache_idle")
    print(f"1 idle, empty cache:        {idle_line}  [{idle_s:.0f} s]\n  {summary(idle)}")
    hogs = busy_processes(args.busy)
    try:
        time.sleep(2)
        cached, cached_line, cached_s = plan(dataset, root / "ws_busy_cached", root / "cache_idle")
        print(f"2 {args.busy} busy, cache of 1:     {cached_line}  [{cached_s:.0f} s]\n  {summary(cached)}")
        fresh, fresh_line, fresh_s = plan(dataset, root / "ws_busy_fresh", root / "cache_busy")
        print(f"3 {args.busy} busy, empty cache:  {fresh_line}  [{fresh_s:.0f} s]\n  {summary(fresh)}")
        print(f"load while busy: {os.getloadavg()[0]:.1f}")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"plans 1 and 2 identical: {idle == cached}")
    print(
        f"plans 1 and 3 identical: {idle == fresh}; throughput 3/1: "
        f"{fresh['cpu_flops_per_second'] / idle['cpu_flops_per_second']:.2f}"
    )
    cached_file = root / "cache_idle" / "cpu_throughput.json"
    if cached_file.is_file():
        details = json.loads(cached_file.read_text())["entries"][0]["details"]
        print("calibration of 1: " + ", ".join(f"{k} {v:.3g}" for k, v in details.items()))
    else:
        print("1 was not cached (the cores were busy while it measured): 2 measured again")
    if not args.keep and args.data_dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
