"""Fine-tuning against training from scratch in the same time (issue 29; run by hand).

A source model is trained on one synthetic dataset of ``autoseg.demo`` (seed 0, ``--source-cases`` cases, the organ
only), then a related dataset (seed 1: other cases, and the lesion class added; ``--cases`` cases) is planned with
the source model's network (``autoseg plan_and_preprocess --like``) and its fold 0 trained twice with the same
``--time-budget`` (each of ``--budgets``): from scratch, and from the source model's weights (``--init-from``: the
encoder and decoder copied, the heads re-initialised for the new label set). All on the CPU (``--device cpu``, cases
of about 24 x 64 x 64 voxels), each command in a subprocess of this interpreter; ``--val-iterations 5`` for every
run, so that the pseudo-Dice does not take most of a minutes-long budget.

Prints the init's log line and one markdown table for docs/benchmarks.md: per run its budget, wall seconds, epochs x
iterations run, and the final validation's Dice per class and mean foreground Dice (fold 0's validation cases).

    python benchmarks/finetune.py                   # source 5m, target 2 x 1m and 2 x 3m: about 20 minutes
    python benchmarks/finetune.py --work-dir DIR --budgets 1m   # reuse DIR's datasets, source model and target plan
    python benchmarks/finetune.py --quick           # 1m each on fewer cases: the whole path, about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import run_autoseg

CONFIG = "3d_fullres"


def _train(workspace: Path, budget: str, val_iterations: int, *extra: str) -> dict:
    """``autoseg train fold 0 --time-budget`` in ``workspace`` (a fold trained before is read back: ``--work-dir``
    reuses the source model); its wall seconds, schedule, init and validation Dice."""
    fold = workspace / "results" / CONFIG / "fold_0"
    seconds = float("nan")
    if not (fold / "validation" / "summary.json").is_file():
        flags = ("--device", "cpu", "--time-budget", budget, "--val-iterations", str(val_iterations))
        seconds = run_autoseg("train", "fold", "0", "-w", str(workspace), *flags, *extra)
    run = json.loads((fold / "run.json").read_text())
    summary = json.loads((fold / "validation" / "summary.json").read_text())
    log = (fold / "train.log").read_text()
    init_line = next((ln.split(" ", 2)[2] for ln in log.splitlines() if "initialised from" in ln), "")
    return {
        "budget": budget,
        "seconds": seconds,
        "schedule": run["schedule"],
        "dice": {name: m["dice"] for name, m in summary["mean"].items()},
        "mean_dice": summary["mean_foreground_dice"],
        "init": init_line,
    }


def _dataset(root: Path, name: str, seed: int, cases: int, labels: int, shape: tuple[int, int, int]) -> Path:
    from autoseg.demo.data import make_demo_dataset

    return make_demo_dataset(
        root / name, num_train=cases, num_test=0, shape_zyx=shape, seed=seed, num_label_values=labels
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source-budget", default="5m", help="the source model's --time-budget (default 5m)")
    parser.add_argument(
        "--budgets", nargs="+", default=["1m", "3m"], help="each target run's --time-budget (default 1m and 3m)"
    )
    parser.add_argument("--source-cases", type=int, default=20, help="source training cases (default 20)")
    parser.add_argument("--cases", type=int, default=10, help="target training cases (default 10)")
    parser.add_argument("--shape", type=int, nargs=3, default=(24, 64, 64), help="nominal case shape (z y x)")
    parser.add_argument(
        "--val-iterations",
        type=int,
        default=5,
        help="pseudo-Dice patches per epoch (default 5: in minutes-long budgets the default 50 take most of an epoch)",
    )
    parser.add_argument("--quick", action="store_true", help="1m budgets, 8 + 6 cases")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the datasets and workspaces go (kept)")
    args = parser.parse_args()
    if args.quick:
        args.source_budget, args.budgets, args.source_cases, args.cases = "1m", ["1m"], 8, 6
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="autoseg-finetune-"))
    shape = tuple(args.shape)
    t0 = time.perf_counter()
    source_data = _dataset(work, "Dataset101_Organ", 0, args.source_cases, 2, shape)
    target_data = _dataset(work, "Dataset102_OrganLesion", 1, args.cases, 3, shape)
    source = work / "source"
    run_autoseg("plan_and_preprocess", str(source_data), "-w", str(source), "--device", "cpu", "-c", CONFIG)
    rows = {"source (organ), from scratch": _train(source, args.source_budget, args.val_iterations)}
    target = work / "target"
    like = ("--like", str(source))
    run_autoseg("plan_and_preprocess", str(target_data), "-w", str(target), "--device", "cpu", "-c", CONFIG, *like)
    for budget in args.budgets:
        scratch, tuned = (work / f"target_{how}_{budget}" for how in ("scratch", "init"))
        for copy in (scratch, tuned):
            if not copy.is_dir():
                shutil.copytree(target, copy)
        rows[f"target (organ + lesion), {budget}, from scratch"] = _train(scratch, budget, args.val_iterations)
        rows[f"target (organ + lesion), {budget}, --init-from source"] = _train(
            tuned, budget, args.val_iterations, "--init-from", str(source)
        )
    print(next(r["init"] for r in rows.values() if r["init"]))
    print(
        f"\nall in {time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPU(s), load {os.getloadavg()[0]:.1f}; {work}\n"
    )
    print("| run | budget | wall s | epochs x iterations | Dice organ | Dice lesion | mean foreground Dice |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        dice = r["dice"]
        lesion = f"{dice['lesion']:.3f}" if "lesion" in dice else "-"
        schedule = f"{r['schedule']['epochs']} x {r['schedule']['iterations_per_epoch']}"
        print(
            f"| {name} | {r['budget']} | {r['seconds']:.0f} | {schedule} | {dice['organ']:.3f} | {lesion} | "
            f"{r['mean_dice']:.3f} |"
        )
    plans = json.loads((target / "plans.json").read_text())["configurations"][CONFIG]
    note = next(n for n in plans["notes"] if n.startswith("network of"))
    note = note.replace(str(source), "SOURCE")
    print(f"\ntarget plan: patch {plans['patch_size']}, batch {plans['batch_size']}; {note}")


if __name__ == "__main__":
    main()
