"""An nnU-Net v2 model imported into autoseg, side by side with nnU-Net's own predictor (issue 29): agreement of the
label maps, Dice against the ground truth, wall time and peak memory.

Generates (once, cached under ``--work``) a CT-like dataset of benchmarks/_cases.py: 12 foreground classes at
0.8x0.8x2.5 mm, ``--cases`` training cases and ``--test`` held-out ones with labels (``--predict`` of them are
predicted), of about ``--shape`` voxels.
nnU-Net v2 (``--nnunet-python``: a venv with nnunetv2 2.8.x beside torch as ours) plans and preprocesses it; its
3d_fullres plans are cut to a small network and patch (benchmarks/_nnunet_small.py) and fold 0 trains on the CPU for
``--epochs`` x ``--iterations`` (kept: a rerun with the same figures skips it). ``autoseg import-nnunet`` then writes
the model archive, and each round predicts the held-out cases in one run per tool, the tools' order alternating by
round: nnU-Net's predictor (``-device cpu``, ``-npp``/``-nps`` as given) and ``autoseg predict -m model.zip`` in each
``--runtimes`` row (default torch fp32, the issue's reference, and OpenVINO fp32 and bf16 where installed), with
the same mirroring (``--tta all``: every axis for both, as nnU-Net predicts by default; ``--tta none``: neither).
Each autoseg row first predicts one case untimed and unmirrored (a graph runtime builds and caches its
graph).

Per case: the voxels agreeing on the union of both outputs' foreground (target >= 99%), the lowest Dice between the
two outputs over the classes either finds (target >= 0.99), each tool's Dice against the ground truth (nnU-Net's
on the largest structure, the liver: >= 0.9, else train longer). Per tool, the run with the median wall time: wall
seconds (process start to exit) and the peak RSS / PSS of its whole process tree (polled every 0.1 s), beside
nnU-Net's (targets for torch fp32: at most 0.7x its time and 0.3x its RSS).

    python benchmarks/nnunet_import.py --nnunet-python /tmp/nnunet-venv/bin/python [--work DIR] [--epochs E]
        [--iterations I] [--rounds R] [--tta all|none] [--runtimes torch:fp32 openvino:bf16 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from _cases import LABELS, ORGANS, make_cases_dataset
from _common import nnunet_python, run_measured
from _nnunet_compare import (
    QUALITY_HEADER,
    RSS_RATIO_TARGET,
    TRUTH_DICE_TARGET,
    WALL_RATIO_TARGET,
    compare_case,
    quality_row,
    ratio_text,
    verdict,
)
from _nnunet_small import prepare_small_nnunet
from _predict_rows import Row, parse_row
from _predict_runs import parse_autoseg_log, predict_nnunet, run_predictor, typical_inputs
from predict import summarize

from autoseg.core.units import MiB

REFERENCE = Row("torch", "fp32")
NNUNET = "nnU-Net v2"
LARGEST = ORGANS[0][0]  # the liver: the largest structure of every case


def import_model(model_folder: Path, work: Path) -> Path:
    """``autoseg import-nnunet`` of ``model_folder`` into ``work/model.zip``, again when the checkpoint is newer."""
    archive = work / "model.zip"
    checkpoint = model_folder / "fold_0" / "checkpoint_final.pth"
    if not archive.is_file() or archive.stat().st_mtime < checkpoint.stat().st_mtime:
        cmd = [sys.executable, "-m", "autoseg", "import-nnunet", str(model_folder), "-o", str(archive)]
        r = run_measured(cmd, log_path=work / "import.log")
        print(f"autoseg import-nnunet: {r['seconds']:.1f} s: {archive}")
    return archive


def predict_archive(archive: Path, inputs: Path, tta: str, row: Row, work: Path, name: str) -> dict:
    """``autoseg predict -m archive`` of ``inputs`` in ``row``'s runtime and precision, measured in a fresh process."""
    out = work / "out" / name
    args = ["predict", "-i", str(inputs), "-o", str(out), "-m", str(archive), "--device", "cpu", "--tta", tta]
    args.append("--no-uncertainty")  # nnU-Net compares no mirror variants: the same work on both sides
    r = run_predictor("autoseg", [*args, "--verbose", *row.predict_args()], sys.executable, None, work, name)
    return {**r, **parse_autoseg_log(r["log"].read_text()), "out": out}


def run_rounds(args: argparse.Namespace, archive: Path, nnunet: tuple[str, dict, Path], inputs: Path) -> list[dict]:
    """Every tool on the held-out cases, ``args.rounds`` times, the tools' order alternating by round."""
    work, runs = Path(args.work), []
    tools: list[Row | None] = [None, *args.rows]  # None: nnU-Net
    for round_ in range(args.rounds):
        for row in tools if round_ % 2 == 0 else tools[::-1]:
            name = f"{'nnunet' if row is None else row.name.replace(' ', '_')}_{round_}"
            if row is None:
                out = work / "out" / name
                r = predict_nnunet(nnunet, inputs, out, args.tta == "all", (args.npp, args.nps), work, name)
            else:
                r = predict_archive(archive, inputs, args.tta, row, work, name)
            r.update(case="held-out", tool=NNUNET if row is None else row.tool)
            print(
                f"round {round_}, {r['tool']}: {r['seconds']:.1f} s wall, peak RSS {r['peak_rss_bytes'] / MiB:.0f} "
                f"MiB, PSS {r['peak_pss_bytes'] / MiB:.0f} MiB, {r['processes']} processes, load before "
                f"{r['load_before']:.1f}; log {r['log']}",
                flush=True,
            )
            runs.append(r)
    return runs


def speed_table(rows: list[dict], cases: int) -> str:
    """Per tool: seconds per case (each round's), peak RSS and PSS, and the ratios to nnU-Net's."""
    theirs = next(r for r in rows if r["tool"] == NNUNET)
    lines = [
        "| tool | s per case (each round) | peak RSS | peak PSS | processes | wall / nnU-Net's | RSS / nnU-Net's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = r["tool"] == REFERENCE.tool
        each = ", ".join(f"{w / cases:.1f}" for w in r["walls"])
        lines.append(
            f"| {r['tool']} | {r['seconds'] / cases:.1f} ({each}) | {r['peak_rss_bytes'] / MiB:.0f} MiB "
            f"| {r['peak_pss_bytes'] / MiB:.0f} MiB | {r['processes']} "
            f"| {ratio_text(r['seconds'], theirs['seconds'], WALL_RATIO_TARGET if target else None)} "
            f"| {ratio_text(r['peak_rss_bytes'], theirs['peak_rss_bytes'], RSS_RATIO_TARGET if target else None)} |"
        )
    return "\n".join(lines)


def quality_table(rows: list[dict], dataset: Path, labels: dict[str, int]) -> str:
    """Per case and autoseg row: agreement with nnU-Net's label map and both tools' Dice against the truth."""
    theirs = next(r for r in rows if r["tool"] == NNUNET)
    lines, nnunet_largest = [QUALITY_HEADER], []
    for truth in sorted((dataset / "labelsTs").glob("*.nii.gz")):
        if not (theirs["out"] / truth.name).is_file():
            continue
        case = truth.name.removesuffix(".nii.gz")
        for r in rows:
            if r["tool"] != NNUNET:
                q = compare_case(r["out"] / truth.name, theirs["out"] / truth.name, truth, labels)
                lines.append(quality_row(case, r["tool"].removeprefix("autoseg "), q, LARGEST))
        nnunet_largest.append(q["nnunet_dice"][LARGEST])
    worst = min(nnunet_largest)
    lines.append(
        f"\nnnU-Net's lowest Dice on the {LARGEST} (the largest structure) over the cases: {worst:.3f} "
        f"(>= {TRUTH_DICE_TARGET}) {verdict(worst >= TRUTH_DICE_TARGET)}"
        + ("" if worst >= TRUTH_DICE_TARGET else "; train longer (--epochs, --iterations)")
    )
    return "\n".join(lines)


def main() -> None:
    args = _parser().parse_args()
    args.rows = [parse_row(t) for t in args.runtimes]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AUTOSEG_CACHE_DIR", str(work / "cache"))  # graphs made by the warm-up
    python = nnunet_python(args.nnunet_python)
    if python is None:
        raise SystemExit("nnunetv2 is not importable here: pass --nnunet-python PATH (a venv with nnunetv2 2.8.x)")
    dataset = make_cases_dataset(work, args.cases, args.test, tuple(args.shape))
    model_folder, env = prepare_small_nnunet(python, dataset, work, args.epochs, args.iterations)
    archive = import_model(model_folder, work)
    count = args.predict or args.test
    inputs = typical_inputs(dataset, work, count)
    print(
        f"{len(ORGANS)} foreground classes, {count} held-out cases of about {args.shape}; nnU-Net trained "
        f"{args.epochs} x {args.iterations} iterations, -npp {args.npp} -nps {args.nps}; TTA {args.tta} for both; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    one_case = typical_inputs(dataset, work, 1)
    for row in args.rows:
        r = predict_archive(archive, one_case, "none", row, work, f"warmup_{row.name.replace(' ', '_')}")
        print(f"warm-up, {row.tool}: {r['seconds']:.1f} s", flush=True)
    rows = summarize(run_rounds(args, archive, (python, env, model_folder), inputs))
    print(speed_table(rows, count), end="\n\n")
    print(quality_table(rows, dataset, {k: v for k, v in LABELS.items() if v}), end="\n\n")
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnunet-python", default=None, help="python of a venv with nnunetv2 installed")
    parser.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "autoseg_nnunet_import_bench"),
        help="dataset, nnU-Net's folders and trained model, the archive and outputs (kept: reruns skip what is there)",
    )
    parser.add_argument("--cases", type=int, default=12, help="training cases")
    parser.add_argument("--test", type=int, default=4, help="held-out cases of the dataset")
    parser.add_argument(
        "--predict", type=int, default=None, help="held-out cases predicted in one run per tool (default: all)"
    )
    parser.add_argument(
        "--shape", type=int, nargs=3, default=(32, 96, 96), metavar=("Z", "Y", "X"), help="about each case's size"
    )
    # 150 x 50 iterations: nnU-Net's liver Dice 0.986-0.990 (the bar 0.9), 43 minutes on 2 quiet cores
    parser.add_argument("--epochs", type=int, default=150, help="nnU-Net's training epochs")
    parser.add_argument("--iterations", type=int, default=50, help="nnU-Net's training iterations per epoch")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tool, alternating; the median")
    parser.add_argument(
        "--tta", choices=("all", "none"), default="all", help="mirroring for both: every axis (all) or none"
    )
    parser.add_argument("--npp", type=int, default=3, help="nnU-Net's preprocessing processes (-npp)")
    parser.add_argument("--nps", type=int, default=3, help="nnU-Net's export processes (-nps)")
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=["torch:fp32", "openvino:fp32", "openvino:bf16"],
        metavar="ROW",
        help="autoseg's rows: RUNTIME:PRECISION (torch:fp32 is the reference the targets apply to)",
    )
    return parser


if __name__ == "__main__":
    main()
