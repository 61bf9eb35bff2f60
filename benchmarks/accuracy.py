"""Accuracy within a CPU time budget on small structures (issue 28; run by hand).

Generates a dataset (``--dataset``: benchmarks/_small_structures.py's ``small-structures`` or ``slabs``, or the
demo's), cached under ``--work``; plans and preprocesses it on CPU for the budget (``autoseg plan_and_preprocess
--device cpu --time-budget T``, or ``--seconds-per-iteration S`` where given; planned again with ``--overwrite`` for
another target, the preprocessed cases kept); trains fold 0 with ``autoseg train --time-budget T`` from a fresh
results folder; predicts the held-out cases (``autoseg predict``) and evaluates them (``autoseg evaluate``). Prints
one markdown table: the plan's patch and seconds-per-iteration target, the iterations run, the seconds per iteration
(the step's, as the time budget measured it last, and all in: the epochs' wall time over the iterations, patch
validation included), Dice per class, the ground-truth lesions found (the lesion label's 26-connected components that
the prediction touches, counted by ``autoseg evaluate``) and each command's wall seconds. ``--write-docs`` puts the
table into docs/benchmarks.md under a heading of its own (replacing it).

    python benchmarks/accuracy.py --quick                        # tiny dataset, T = 2m: the whole path
    python benchmarks/accuracy.py --budget 30m --write-docs      # the issue's run: a quiet machine, ~45 minutes
    python benchmarks/accuracy.py --dataset slabs --budget 30m   # a dataset of different character
    python benchmarks/accuracy.py --budget 15m --seconds-per-iteration 1   # the sweep: another target than the rule's
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from _common import run_autoseg
from _small_structures import PRESETS, make_structures_dataset

CONFIG = "3d_fullres"
# (training, held-out); demo: its own
COUNTS = {"small-structures": (16, 4), "small-structures-easy": (16, 4), "slabs": (16, 4), "demo": (24, 6)}
QUICK_SHAPES = {
    "small-structures": (24, 96, 96),
    "small-structures-easy": (24, 96, 96),
    "slabs": (16, 128, 128),
    "demo": (24, 64, 64),
}
QUICK_COUNTS, QUICK_BUDGET = (4, 2), "2m"
LESIONS = ("lesions", "lesion")  # the lesion label's name in our datasets and in the demo's
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "## Accuracy within a time budget (`benchmarks/accuracy.py`)"  # --write-docs' tables go under it


def make_dataset(work: Path, dataset: str, seed: int, quick: bool) -> Path:
    """The raw dataset under ``work`` (generated once per dataset, size, counts and seed)."""
    counts = QUICK_COUNTS if quick else COUNTS[dataset]
    if dataset == "demo":
        from autoseg.demo.data import DEFAULT_SHAPE_ZYX, make_demo_dataset

        shape = QUICK_SHAPES["demo"] if quick else DEFAULT_SHAPE_ZYX
        path = work / f"Dataset028_Demo_{counts[0]}p{counts[1]}x{'x'.join(map(str, shape))}_s{seed}"
        if not (path / "dataset.json").is_file():
            make_demo_dataset(path, num_train=counts[0], num_test=counts[1], shape_zyx=shape, seed=seed)
        return path
    options = replace(PRESETS[dataset], shape_zyx=QUICK_SHAPES[dataset]) if quick else PRESETS[dataset]
    return make_structures_dataset(work, dataset, options, counts, seed)


def run_pipeline(work: Path, raw: Path, budget: str, seconds_per_iteration: float | None = None) -> dict[str, float]:
    """Plan for ``budget`` (``--time-budget``: the rule sizes the iterations; or ``seconds_per_iteration`` where given)
    and preprocess, train fold 0 within ``budget``, predict and evaluate the held-out cases; each command's wall
    seconds. A workspace planned before is planned again with ``--overwrite``: a new target rewrites the plan and keeps
    the preprocessed cases (the spacing does not change), a dataset generated again since (other options) redoes them.
    """
    workspace, predictions = work / f"ws_{raw.name}", work / f"pred_{raw.name}"
    target = ("--seconds-per-iteration", f"{seconds_per_iteration:g}") if seconds_per_iteration else ()
    plan = ("plan_and_preprocess", str(raw), "-w", str(workspace), "--device", "cpu", "-c", CONFIG)
    plan += target or ("--time-budget", budget)
    again = ("--overwrite",) if (workspace / "plans.json").is_file() else ()
    walls = {"plan_and_preprocess": run_autoseg(*plan, *again)}
    shutil.rmtree(workspace / "results", ignore_errors=True)
    shutil.rmtree(predictions, ignore_errors=True)
    train = ("train", "fold", "0", "-w", str(workspace), "-c", CONFIG, "--device", "cpu", "--time-budget", budget)
    walls["train"] = run_autoseg(*train)
    predict = ("-i", str(raw / "imagesTs"), "-o", str(predictions), "-w", str(workspace), "-c", CONFIG, "-f", "0")
    walls["predict"] = run_autoseg("predict", *predict, "--device", "cpu")
    walls["evaluate"] = run_autoseg("evaluate", str(predictions), str(raw / "labelsTs"))
    return walls


def training_figures(fold: Path) -> dict[str, float]:
    """Iterations run and seconds per iteration of a trained fold: the step's, as the time budget last measured it
    (run.json), and all in (the epochs' summed wall time, patch validation and loader waits included, over the
    iterations: metrics.jsonl), from its final checkpoint, run.json and metrics.jsonl."""
    from autoseg.train.checkpoint import load_checkpoint

    steps = load_checkpoint(fold / "checkpoint_final.pt").progress.schedule.steps_done
    rows = [json.loads(line) for line in (fold / "metrics.jsonl").read_text().splitlines() if line.strip()]
    decisions = json.loads((fold / "run.json").read_text())["time_budget"]
    return {
        "iterations": steps,
        "step_seconds": decisions[-1]["seconds_per_iteration"] if decisions else float("nan"),
        "seconds_per_iteration": sum(row["epoch_seconds"] for row in rows) / max(steps, 1),
    }


def class_weights(fold: Path) -> str:
    """The class decision weights the training fitted (``ClassWeights.describe``), or why there are none."""
    from autoseg.predict.class_weights import CLASS_WEIGHTS_FILE, ClassWeights

    path = fold / CLASS_WEIGHTS_FILE
    return ClassWeights.from_json(path).describe() if path.is_file() else "not fitted (no final validation)"


def lesions_found(mean: dict[str, dict]) -> str:
    """ "found of total" for the lesion class of a summary.json's means, "-" where the dataset has none."""
    for name in LESIONS:
        if name in mean and mean[name].get("components", -1) >= 0:
            found, total = mean[name]["components_found"], mean[name]["components"]
            return f"{found} of {total} ({found / max(total, 1):.0%})"
    return "-"


def table(run: dict) -> str:
    """The run's markdown table: one row, a column per class."""
    classes = list(run["dice"])
    head = [
        "dataset",
        "T",
        "target s/it",
        "patch",
        "iterations",
        "s/iteration: step",
        "all in",
        *(f"{c} Dice" for c in classes),
    ]
    head += ["lesions found"]
    head += [f"{step} (s)" for step in run["walls"]]
    walls = [f"{s:.0f}" for s in run["walls"].values()]
    row = [
        run["dataset"],
        run["budget"],
        f"{run['target']:.2f}",
        "x".join(map(str, run["patch"])),
        str(run["iterations"]),
    ]
    row += [f"{run['step_seconds']:.2f}", f"{run['seconds_per_iteration']:.2f}"]
    row += [*(f"{d:.3f}" for d in run["dice"].values()), run["found"], *walls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(row) + " |"]
    return "\n".join([*lines, "", f"Class decision weights fitted in training: {run['weights']}."])


def collect(work: Path, raw: Path, walls: dict[str, float], args: argparse.Namespace) -> dict:
    """What the table reports, from the workspace's plan, the fold and the evaluation's summary.json."""
    from autoseg.plan.plans import Plans

    workspace = work / f"ws_{raw.name}"
    plans = Plans.from_json(workspace / "plans.json")
    summary = json.loads((work / f"pred_{raw.name}" / "summary.json").read_text())
    return {
        "dataset": args.dataset,
        "budget": args.budget,
        "patch": plans.configurations[CONFIG].patch_size,
        "target": plans.iteration.seconds,
        **training_figures(workspace / "results" / CONFIG / "fold_0"),
        "dice": {name: float("nan") if m["dice"] is None else m["dice"] for name, m in summary["mean"].items()},
        "found": lesions_found(summary["mean"]),
        "weights": class_weights(workspace / "results" / CONFIG / "fold_0"),
        "walls": walls,
    }


def write_docs(heading: str, body: str, path: Path = DOCS, parent: str = SECTION) -> None:
    """Put ``body`` under the line ``heading`` in ``path``, replacing what was under it up to the next heading of
    the same or a higher level; where the heading is missing, add the section at the end of ``parent``'s (and
    ``parent`` at the end of the file where it is missing too)."""
    lines = path.read_text().splitlines()
    section = [heading, "", *body.strip("\n").splitlines(), ""]
    if heading in lines:
        start = lines.index(heading)
        lines[start : _section_end(lines, start)] = section
    elif parent in lines:
        end = _section_end(lines, lines.index(parent))
        lines[end:end] = section
    else:
        lines += ["", parent, "", *section]
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


def _section_end(lines: list[str], start: int) -> int:
    """The index of the first line after ``lines[start]`` (a heading) that is a heading of its level or higher,
    outside fenced code (where a line starting with # is a shell comment)."""
    level, fenced = _level(lines[start]), False
    for i in range(start + 1, len(lines)):
        fenced ^= lines[i].startswith("```")
        if not fenced and 0 < _level(lines[i]) <= level:
            return i
    return len(lines)


def _level(line: str) -> int:
    """A markdown heading's level (the number of leading #s followed by a space); 0 for any other line."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if hashes and line[hashes : hashes + 1] == " " else 0


def context(args: argparse.Namespace, raw: Path, load_before: float) -> str:
    """The line that says what ran where: commit, date, machine, load, dataset."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    kind = "smoke run (--quick) on a shared machine" if args.quick else "run"
    return textwrap.fill(
        f"`python benchmarks/accuracy.py --dataset {args.dataset} --budget {args.budget} --seed {args.seed}"
        f"{' --quick' if args.quick else ''}{_target_flag(args)}`: {kind}, {time.strftime('%Y-%m-%d')}, "
        f"commit {commit or '?'}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after; "
        f"dataset {raw.name}, {CONFIG} on CPU, fold 0, predicted on the held-out cases.",
        width=120,
        break_on_hyphens=False,
    )


def _target_flag(args: argparse.Namespace) -> str:
    return f" --seconds-per-iteration {args.seconds_per_iteration:g}" if args.seconds_per_iteration else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default=None, help="autoseg train --time-budget (default: 30m; 2m with --quick)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/autoseg-accuracy"), help="datasets and workspaces")
    parser.add_argument("--dataset", choices=sorted(COUNTS), default="small-structures")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default: 0)")
    parser.add_argument("--quick", action="store_true", help="4 + 2 small cases and T = 2m: the whole path")
    parser.add_argument(
        "--seconds-per-iteration",
        type=float,
        default=None,
        help="plan CPU iterations of this many seconds (default: the rule's for --budget: plan --time-budget)",
    )
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/benchmarks.md")
    args = parser.parse_args()
    args.budget = args.budget or (QUICK_BUDGET if args.quick else "30m")
    load_before = os.getloadavg()[0]
    raw = make_dataset(args.work, args.dataset, args.seed, args.quick)
    walls = run_pipeline(args.work, raw, args.budget, args.seconds_per_iteration)
    body = f"{context(args, raw, load_before)}\n\n{table(collect(args.work, raw, walls, args))}"
    fold = args.work / f"ws_{raw.name}" / "results" / CONFIG / "fold_0"  # the next run starts from a fresh folder
    shutil.copyfile(fold / "train.log", args.work / f"train_{raw.name}_{args.budget}{_target_flag(args).strip()}.log")
    print(body)
    if args.write_docs:
        quick = ", smoke run" if args.quick else ""
        given = f", {args.seconds_per_iteration:g} s per iteration" if args.seconds_per_iteration else ""
        write_docs(f"### Accuracy: {args.dataset}, T = {args.budget}{given}{quick}", body)


if __name__ == "__main__":
    main()
