"""Seconds per case, peak memory, forward share and label quality of `autoseg predict` in every runtime, beside
nnU-Net v2's predictor.

Generates (once, cached under ``--work``) a CT-like dataset with 12 foreground classes at 0.8x0.8x2.5 mm
(``--cases`` training cases plus held-out ones of about ``--shape`` voxels, benchmarks/_cases.py) and one
large case of ``--large`` voxels with the same classes in the same proportions. It plans, preprocesses and
trains fold 0 with autoseg (planned for an 8 GiB GPU by default, the network nnU-Net would plan, trained on the
CPU for ``--train-budget`` (autoseg's ``--time-budget``: a model whose Dice means something), or ``--epochs`` x
``--iterations``), and with ``--nnunet-python PATH`` (an interpreter of a venv with nnunetv2) nnU-Net's 3d_fullres
briefly (``--epochs`` x ``--iterations``: its rows are for time and memory), benchmarks/_predict_models.py.

autoseg runs once per row (benchmarks/_predict_rows.py; ``--runtimes``, default: ``auto`` and every installed
runtime in each precision this CPU computes: torch fp32 and bf16, onnxruntime fp32, openvino fp32 and bf16, bf16
only on a CPU with native bf16), all with the same TTA, tile, threads and cases. Each row first predicts one typical
case untimed (the warm-up: a graph runtime's graph is made and cached, ``auto`` times its candidates), then every
tool predicts the ``--typical`` held-out cases in one run and the large case in another, each run a fresh process
under benchmarks/_forward_timer.py (autoseg: every tile runner call timed; nnU-Net: its outermost module forwards),
the tools' order alternating by round. Per (case, tool), the run with the median wall time:

- seconds per case: the run's wall time (process start to exit: imports, model loading, every stage)
  divided by its cases; "start-up": the wall time before the first tile call on a case (interpreter, imports,
  model loading, the runtime's build, ``auto``'s timing when not kept, the first case's reading), paid once per
  process; "s per case after start-up": the rest divided by the cases, what each further case of a cohort costs;
- peak RSS and PSS of the whole process tree (polled every 0.1 s; PSS shares library pages between
  nnU-Net's worker processes instead of counting them once per process);
- forward share: the summed forward seconds over the wall time; the rest is "overhead" (``auto``'s timing of its
  candidates, tile batches before the first case, is overhead, shown apart as "probe forwards");
- autoseg's predicted peak, from its ``--verbose`` log: the pipeline's "predicted host peak" (the
  whole process), else the largest inference plan's "predicted peak", beside the measured peak RSS;
- Dice per class against the ground truth (autoseg.evaluate), voxel agreement with torch fp32's label maps, and
  what ``auto`` chose (its choice line);
- targets (issue 14): overhead <= 15% of the wall time (typical), <= 25% (large); (issue 27) ``auto`` <= 0.3x and
  the best fp32-only runtime <= 0.6x torch fp32's seconds per typical case after start-up (the whole run's ratio,
  start-up included, printed beside), every class's Dice within 0.002 of torch
  fp32's, fp32 rows agreeing with torch fp32 on >= 99.9% of voxels, every row's large-case peak RSS <= 1/4 of
  nnU-Net's, predicted peak within 15% of the measured one.

Test-time mirroring is off for both (``--tta none`` / ``--disable_tta``) unless ``--tta``; nnU-Net runs
with ``-npp 3 -nps 3`` (its defaults) unless ``--npp/--nps``. ``--quick``: a 64x256x256 large case, one
typical case. ``--autoseg-args`` adds flags to every ``autoseg predict`` (e.g. "--tile-batch-size 1"). autoseg's
per-machine cache (graphs, ``auto``'s timings, tile simulations) is ``$AUTOSEG_CACHE_DIR``, else ``--work``/cache.

    python benchmarks/predict.py [--quick] [--nnunet-python /tmp/nnunet-venv/bin/python] [--work DIR]
        [--large Z Y X] [--typical N] [--train-budget 20m] [--epochs E] [--iterations I] [--tta] [--npp N]
        [--nps N] [--rounds R] [--runtimes auto torch:fp32 ...] [--autoseg-plan gpu8|cpu] [--autoseg-args "..."]
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import tempfile
from pathlib import Path

from _cases import LABELS, ORGANS, make_cases_dataset, make_large_case
from _common import nnunet_python
from _predict_models import Training, prepare_autoseg, prepare_nnunet
from _predict_rows import (
    PREDICTION_TOLERANCE,
    Row,
    add_quality,
    default_rows,
    format_quality,
    parse_row,
    runtime_checks,
    seconds_per_case,
    startup_seconds,
)
from _predict_runs import predict_autoseg, predict_nnunet, typical_inputs

from autoseg.core.units import MiB

FULL_LARGE, QUICK_LARGE = (300, 512, 512), (64, 256, 256)
OVERHEAD_TARGET = {"typical": 0.15, "large": 0.25}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (case, tool): the run with the median wall time over the rounds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["case"], r["tool"]), []).append(r)
    rows = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["seconds"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["walls"] = [r["seconds"] for r in group]
        row["forward_share"] = row["forward_s"] / row["seconds"]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| case | tool | cases x voxels | s per case | start-up | s per case after start-up | probe forwards "
        "| forward share "
        "| overhead (target) | peak RSS | peak PSS | processes | predicted peak | predicted / RSS (target "
        "0.85-1.15) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        overhead, target = 1 - r["forward_share"], OVERHEAD_TARGET[r["case"]]
        verdict = "" if not r["tool"].startswith("autoseg") else (" pass" if overhead <= target else " FAIL")
        predicted, ratio = "-", "-"
        if r.get("predicted_bytes"):
            q = r["predicted_bytes"] / r["peak_rss_bytes"]
            predicted = f"{r['predicted_bytes'] / MiB:.0f} MiB"
            ratio = f"{q:.2f} {'pass' if abs(q - 1) <= PREDICTION_TOLERANCE else 'FAIL'}"
        each = ", ".join(f"{w / r['cases']:.1f}" for w in r["walls"])
        walls = "" if len(r["walls"]) == 1 else f" ({each})"
        lines.append(
            f"| {r['case']} | {r['tool']} | {r['cases']} x {r['voxels'] / 1e6:.1f} M | "
            f"{r['seconds'] / r['cases']:.1f}{walls} | {startup_seconds(r):.1f} s | {seconds_per_case(r):.2f} | "
            f"{r['probe_s']:.1f} s | "
            f"{r['forward_share']:.0%} | "
            f"{overhead:.0%} (<= {target:.0%}){verdict} | {r['peak_rss_bytes'] / MiB:.0f} MiB | "
            f"{r['peak_pss_bytes'] / MiB:.0f} MiB | {r['processes']} | {predicted} | {ratio} |"
        )
    return "\n".join(lines)


def print_checks(rows: list[dict], large_voxels: int, full_voxels: int) -> None:
    for line in runtime_checks(rows):
        print(line)
    for r in rows:
        if r.get("self_measured_bytes"):
            print(
                f"{r['case']}: {r['tool']}'s own log: predicted host peak {r['predicted_bytes'] / MiB:.0f} MiB, "
                f"measured {r['self_measured_bytes'] / MiB:.0f} MiB (its peak RSS since the first case)"
            )
    if large_voxels < full_voxels:
        for r in rows:
            if r["case"] == "large":
                per_voxel = (r["seconds"] - (r["first_forward_s"] or 0)) / large_voxels
                print(
                    f"{r['tool']}: {per_voxel * 1e6:.1f} s per million voxels after the first forward pass on the "
                    f"large case; a {full_voxels / 1e6:.0f} M-voxel case would take about "
                    f"{(r['first_forward_s'] or 0) + per_voxel * full_voxels:.0f} s at that rate"
                )


def main() -> None:
    args = _parser().parse_args()
    large_shape = tuple(args.large or (QUICK_LARGE if args.quick else FULL_LARGE))
    typical = args.typical or (1 if args.quick else 3)
    training = Training(args.epochs, args.iterations, args.train_budget)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AUTOSEG_CACHE_DIR", str(work / "cache"))  # graphs, auto's timings, tile simulations
    rows, notes = _rows(args.runtimes)

    dataset = make_cases_dataset(work, args.cases, max(4, typical), tuple(args.shape))
    large = make_large_case(work, large_shape)
    ws = prepare_autoseg(dataset, work, args.autoseg_plan, training)
    python = nnunet_python(args.nnunet_python)
    nnunet = None if python is None else prepare_nnunet(python, dataset, work, args.epochs, args.iterations)
    typical_folder = typical_inputs(dataset, work, typical)
    voxels = {"typical": _voxels(typical_folder), "large": _voxels(large)}
    cases = {
        k: v for k, v in {"typical": (typical_folder, typical), "large": (large, 1)}.items() if args.only in (None, k)
    }
    print(
        f"{len(ORGANS)} foreground classes; typical: {typical} held-out case(s), "
        f"{voxels['typical'] / 1e6:.1f} M voxels in all; large: {'x'.join(map(str, large_shape))}; "
        f"TTA {'all' if args.tta else 'none'}; nnU-Net -npp {args.npp} -nps {args.nps}, trained {args.epochs} x "
        f"{args.iterations} iterations; autoseg planned for {args.autoseg_plan}, trained {training.tag}; rows: "
        f"{', '.join(r.name for r in rows)}; cache {os.environ['AUTOSEG_CACHE_DIR']}; {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    for note in notes + ([] if python else ["nnU-Net v2: not importable here; pass --nnunet-python PATH to compare"]):
        print(note)
    model = None if nnunet is None else (python, nnunet[1], nnunet[0])
    _warm_up(args, rows, ws, typical_inputs(dataset, work, 1), work)
    summary = summarize(_run_rounds(args, cases, ws, model, voxels, work, rows))
    add_quality(summary, _references(dataset, typical_folder, large), {k: v for k, v in LABELS.items() if v})
    print(format_table(summary), end="\n\n")
    print(format_quality(summary, [name for name, *_ in ORGANS]), end="\n\n")
    print_checks(summary, voxels["large"], FULL_LARGE[0] * FULL_LARGE[1] * FULL_LARGE[2])
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")


def _rows(runtimes: list[str] | None) -> tuple[list[Row], list[str]]:
    """The rows ``--runtimes`` names, else the default ones, and notes on what is left out."""
    if not runtimes:
        return default_rows()
    rows = [parse_row(t) for t in runtimes]
    reference = [] if Row("torch", "fp32") in rows else ["torch fp32 is not among --runtimes: no row is compared to it"]
    return rows, reference


def _references(dataset: Path, typical_folder: Path, large: Path) -> dict[str, dict[str, Path]]:
    """Each case's ground-truth label map, by case kind and id (the held-out labels; the large case's beside it)."""
    typical = {
        image.name[: -len("_0000.nii.gz")]: dataset / "labelsTs" / image.name.replace("_0000", "")
        for image in typical_folder.glob("*_0000.nii.gz")
    }
    return {"typical": typical, "large": {"large": large.parent / f"{large.name}_label.nii.gz"}}


def _warm_up(args: argparse.Namespace, rows: list[Row], ws: Path, one_case: Path, work: Path) -> None:
    """Each row predicts one typical case, untimed: a graph runtime's graph is made and kept in the cache, and
    ``auto`` times its candidates, as on a machine where the model was used before."""
    for row in rows:
        name = f"warmup_{row.name.replace(' ', '_')}"
        extra = row.predict_args() + shlex.split(args.autoseg_args)
        r = predict_autoseg(ws, one_case, work / "out" / name, args.tta, extra, work, name)
        choice = f"; chose {r['choice']}" if r.get("choice") else ""
        print(f"warm-up, {row.tool}: {r['seconds']:.1f} s (probes {r['probe_s']:.1f} s){choice}")


def _run_rounds(
    args: argparse.Namespace,
    cases: dict[str, tuple[Path, int]],
    ws: Path,
    nnunet: tuple[str, dict, Path] | None,
    voxels: dict[str, int],
    work: Path,
    rows: list[Row],
) -> list[dict]:
    """Every tool on every case, ``args.rounds`` times, the tools' order alternating by round."""
    runs = []
    tools: list[Row | None] = [*rows] + ([] if nnunet is None else [None])  # None: nnU-Net
    for round_ in range(args.rounds):
        for case, (inputs, count) in cases.items():
            for row in tools if round_ % 2 == 0 else tools[::-1]:
                name = f"{'nnunet' if row is None else row.name.replace(' ', '_')}_{case}_{round_}"
                out = work / "out" / name
                if row is None:
                    r = predict_nnunet(nnunet, inputs, out, args.tta, (args.npp, args.nps), work, name)
                else:
                    extra = row.predict_args() + shlex.split(args.autoseg_args)
                    r = predict_autoseg(ws, inputs, out, args.tta, extra, work, name)
                r.update(case=case, tool="nnU-Net v2" if row is None else row.tool, cases=count, voxels=voxels[case])
                runs.append(r)
                _print_run(round_, r)
    return runs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"large case {'x'.join(map(str, QUICK_LARGE))}, 1 typical case (a check of the whole "
        "script, not the issue's figures)",
    )
    parser.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "autoseg_predict_bench"),
        help="datasets, workspaces, trained models and outputs (kept: reruns skip what is there)",
    )
    parser.add_argument("--cases", type=int, default=16, help="training cases")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        default=(48, 160, 160),
        metavar=("Z", "Y", "X"),
        help="size of the training and typical cases (each varies by up to 8%% per axis)",
    )
    parser.add_argument(
        "--large",
        type=int,
        nargs=3,
        default=None,
        metavar=("Z", "Y", "X"),
        help=f"the large case (default {'x'.join(map(str, FULL_LARGE))})",
    )
    parser.add_argument("--typical", type=int, default=None, help="held-out cases predicted in one run (default 3)")
    parser.add_argument(
        "--train-budget",
        default=None,
        metavar="DURATION",
        help="train autoseg's fold 0 for this long (autoseg train --time-budget, e.g. 20m: a model whose Dice "
        "means something) instead of --epochs x --iterations",
    )
    parser.add_argument(
        "--epochs", type=int, default=1, help="training epochs of nnU-Net, and of autoseg without --train-budget"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=2,
        help="training iterations per epoch (default 2: the timings need the planned network, not a "
        "good one; the quick run's models are then reused by the full run)",
    )
    parser.add_argument(
        "--autoseg-plan",
        choices=("gpu8", "cpu"),
        default="gpu8",
        help="plan autoseg for an 8 GiB GPU (the network nnU-Net plans; default) or for the CPU "
        "(a far smaller network and patch)",
    )
    parser.add_argument("--tta", action="store_true", help="mirror test-time augmentation on for both (all variants)")
    parser.add_argument("--npp", type=int, default=3, help="nnU-Net's preprocessing processes (-npp)")
    parser.add_argument("--nps", type=int, default=3, help="nnU-Net's export processes (-nps)")
    parser.add_argument("--only", choices=("typical", "large"), default=None, help="predict only this case")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tool and case, alternating; the median")
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=None,
        metavar="ROW",
        help="autoseg's rows: auto and/or RUNTIME:PRECISION (e.g. torch:fp32 openvino:bf16); default: auto and every "
        "installed runtime in each precision this CPU computes. Rows are compared with torch:fp32 where it runs",
    )
    parser.add_argument("--autoseg-args", default="", help='more flags for autoseg predict, e.g. "--tile-batch-size 1"')
    parser.add_argument("--nnunet-python", default=None, help="python of a venv with nnunetv2 installed")
    return parser


def _print_run(round_: int, r: dict) -> None:
    print(
        f"round {round_}, {r['case']}, {r['tool']}: {r['seconds']:.1f} s wall, forward {r['forward_s']:.1f} s in "
        f"{r['forward_calls']} calls (probes {r['probe_s']:.1f} s), peak RSS "
        f"{r['peak_rss_bytes'] / MiB:.0f} MiB, PSS {r['peak_pss_bytes'] / MiB:.0f} MiB, load before "
        f"{r['load_before']:.1f}; log {r['log']}"
    )
    if r["tool"].startswith("autoseg"):
        if r.get("choice"):
            print(f"  chose {r['choice']}")
        print(f"  pipeline: {r['pipeline']}\n  plan: " + "\n  plan: ".join(r["plans"][:2]))


def _voxels(folder: Path) -> int:
    from autoseg.dataset.imageio import read_geometry

    return sum(math.prod(read_geometry(p).size_xyz) for p in folder.glob("*_0000.nii.gz"))


if __name__ == "__main__":
    main()
