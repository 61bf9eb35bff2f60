"""Does predict's per-case uncertainty rank cases by their real Dice? (issue 30; run by hand, ~15-25 minutes on CPU.)

Generates the demo's dataset (``autoseg.demo.data``) with held-out cases of graded difficulty: held-out case ``i`` of
``n`` gets difficulty ``d = i / (n - 1)``, its contrast scaled by ``1 - CONTRAST_LOSS * d`` about its mean and
Gaussian noise of ``NOISE_GAIN * d`` times the demo's own noise added, so the folds meet images further and further
from what they were trained on. Plans and preprocesses on CPU, trains ``--folds`` folds of ``--epochs`` x
``--iterations`` each (``--budget T``: ``--time-budget T`` instead; on this dataset it fails in the budget's prediction
probe on a case smaller than the patch, docs/benchmarks.md),
predicts the held-out cases with all of them (``autoseg predict --no-mirror``: the folds are the members compared;
uncertainty.csv), evaluates
them (``autoseg.evaluate.metrics.evaluate_folder``) and prints one markdown table: per case its difficulty, mean
foreground Dice, disagreement (1 - the folds' mean pairwise Dice) and mean entropy inside the predicted foreground (the
score), then the Spearman rank correlation of each candidate score with 1 - Dice (target >= 0.5).

    python benchmarks/uncertainty.py                          # 3 folds x 60 iterations, 12 held-out cases
    python benchmarks/uncertainty.py --folds 2 --epochs 3     # quicker
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import time
from pathlib import Path

import numpy as np
from _common import run_autoseg

CONFIG = "3d_fullres"
CONTRAST_LOSS = 0.6  # the hardest case keeps 40% of its contrast
NOISE_GAIN = 5.0  # the hardest case gets 5x the demo's noise on top of its own
SHAPE_ZYX = (48, 96, 96)  # the demo's cases, larger: a patch of several tiles' worth of structure


def make_dataset(raw: Path, num_train: int, num_test: int, seed: int) -> Path:
    """The demo's dataset under ``raw`` with its held-out cases degraded (``degrade``), generated once."""
    from autoseg.demo.data import make_demo_dataset

    if (raw / ".complete").is_file():
        return raw
    make_demo_dataset(raw, num_train=num_train, num_test=num_test, shape_zyx=SHAPE_ZYX, seed=seed)
    images = sorted((raw / "imagesTs").glob("*_0000.nii.gz"))
    for i, path in enumerate(images):
        degrade(path, i / max(len(images) - 1, 1), np.random.default_rng([seed, 1000 + i]))
    (raw / ".complete").write_text("done")
    return raw


def degrade(path: Path, difficulty: float, rng: np.random.Generator) -> None:
    """Lower ``path``'s contrast and add noise as ``difficulty`` (0 to 1) says, in place (same geometry)."""
    from autoseg.dataset.imageio import read_image, write_image
    from autoseg.demo.data import NOISE_STD

    image, geometry = read_image(path)
    image = np.asarray(image, dtype=np.float32)
    mean = float(image.mean())
    image = mean + (image - mean) * (1 - CONTRAST_LOSS * difficulty)
    image += rng.standard_normal(image.shape).astype(np.float32) * NOISE_STD * NOISE_GAIN * difficulty
    write_image(path, image, geometry)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank): Pearson's correlation of the ranks."""
    from scipy.stats import rankdata

    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator else float("nan")


def run(work: Path, raw: Path, folds: int, training: list[str], checkpoint: str) -> dict[str, float]:
    """Plan, train ``folds`` folds (``training``: their length flags; a fold that has ``checkpoint_<checkpoint>.pt`` is
    not trained again), predict the held-out cases with that checkpoint of each; each command's wall seconds."""
    ws, pred = work / "ws", work / "pred"
    walls = {}
    if not (ws / "plans.json").is_file():
        walls["plan"] = run_autoseg("plan_and_preprocess", str(raw), "-w", str(ws), "--device", "cpu", "-c", CONFIG)
    for fold in range(folds):
        if not (ws / "results" / CONFIG / f"fold_{fold}" / f"checkpoint_{checkpoint}.pt").is_file():
            train = ("train", "fold", str(fold), "-w", str(ws), "-c", CONFIG, "--device", "cpu", "--no-validation")
            walls[f"train fold {fold}"] = run_autoseg(*train, *training)
    shutil.rmtree(pred, ignore_errors=True)
    fold_args = [str(f) for f in range(folds)]
    predict = ("predict", "-i", str(raw / "imagesTs"), "-o", str(pred), "-w", str(ws), "-c", CONFIG, "-f")
    walls["predict"] = run_autoseg(*predict, *fold_args, "--device", "cpu", "--no-mirror", "--checkpoint", checkpoint)
    return walls


def table(raw: Path, pred: Path) -> tuple[str, dict[str, float]]:
    """The per-case table and each candidate score's Spearman correlation with 1 - Dice."""
    from autoseg.evaluate.metrics import evaluate_folder

    summary = evaluate_folder(pred, raw / "labelsTs")
    dice = {c.case_id: float(np.nanmean([m.dice for m in c.classes.values()])) for c in summary.cases}
    with open(pred / "uncertainty.csv", newline="") as f:
        rows = {r["case"]: r for r in csv.DictReader(f)}
    cases = sorted(dice)
    n = len(cases)
    lines = [
        "| case | difficulty | Dice | 1 - pairwise Dice | entropy in foreground (score) |",
        "|---|---|---|---|---|",
    ]
    for i, case in enumerate(cases):
        r = rows[case]
        lines.append(
            f"| {case} | {i / max(n - 1, 1):.2f} | {dice[case]:.3f} | {float(r['disagreement']):.3f} | {r['entropy']} |"
        )
    error = [1 - dice[c] for c in cases]
    entropy = [float(rows[c]["entropy"] or 0) for c in cases]
    disagreement = [float(rows[c]["disagreement"]) for c in cases]
    correlations = {
        "disagreement": spearman(disagreement, error),
        "entropy": spearman(entropy, error),
        "disagreement + entropy": spearman([s + e for s, e in zip(disagreement, entropy, strict=True)], error),
    }
    return "\n".join(lines), correlations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/autoseg_bench_uncertainty"))
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--budget", default=None, help="each fold's --time-budget (default: --epochs x --iterations)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20, help="iterations per epoch")
    parser.add_argument(
        "--checkpoint", default="final", choices=["final", "latest"], help="each fold's, predicted with"
    )
    parser.add_argument("--train-cases", type=int, default=20)
    parser.add_argument("--test-cases", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    raw = make_dataset(args.work / "Dataset030_Uncertainty", args.train_cases, args.test_cases, args.seed)
    training = (
        ["--time-budget", args.budget]
        if args.budget
        else ["--epochs", str(args.epochs), "--iterations-per-epoch", str(args.iterations)]
    )
    walls = run(args.work, raw, args.folds, training, args.checkpoint)
    text, correlations = table(raw, args.work / "pred")
    print(text)
    print()
    for name, rho in correlations.items():
        print(f"Spearman({name}, 1 - Dice) = {rho:.3f}")
    print("walls: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    print(f"total {time.perf_counter() - t0:.0f} s; {args.folds} folds, each {' '.join(training)}")


if __name__ == "__main__":
    main()
