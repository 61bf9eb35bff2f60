"""Seconds per case, peak memory and forward-pass share of `autoseg predict`, beside nnU-Net v2's predictor.

Generates (once, cached under ``--work``) a CT-like dataset with 12 foreground classes at 0.8x0.8x2.5 mm
(``--cases`` training cases plus held-out ones of about ``--shape`` voxels, benchmarks/_cases.py) and one
large case of ``--large`` voxels with the same classes in the same proportions. It plans, preprocesses and
briefly trains fold 0 (default 1 x 2 iterations) with autoseg (planned for an 8 GiB GPU by default, the
network nnU-Net would plan, trained on the CPU: ``--epochs`` x ``--iterations``), and with ``--nnunet-python
PATH`` (an interpreter of a venv with nnunetv2) nnU-Net's 3d_fullres the same way. Each tool then predicts, on
the CPU, the ``--typical`` held-out cases in one run and the large case in another, each run in a fresh
process under benchmarks/_forward_timer.py, which times the network's outermost forward calls. Printed per
run:

- seconds per case: the run's wall time (process start to exit: imports, model loading, every stage)
  divided by its cases;
- peak RSS and PSS of the whole process tree (polled every 0.1 s; PSS shares library pages between
  nnU-Net's worker processes instead of counting them once per process);
- forward share: the summed forward seconds over the wall time; the rest is "overhead" (autoseg's
  thread-count probe, a few tile forwards on zeros before the first case, is overhead, shown apart);
- autoseg's predicted peak, from its ``--verbose`` log: the pipeline's "predicted host peak" (the
  whole process), else the largest inference plan's "predicted peak", beside the measured peak RSS;
- targets (issue 14): overhead <= 15% of the wall time (typical), <= 25% (large); autoseg's peak RSS on
  the large case <= 1/4 of nnU-Net's; predicted peak within 15% of the measured one.

Test-time mirroring is off for both (``--tta none`` / ``--disable_tta``) unless ``--tta``; nnU-Net runs
with ``-npp 3 -nps 3`` (its defaults) unless ``--npp/--nps``. ``--quick``: a 64x256x256 large case, one
typical case: about 20 minutes for the predictions of both tools on this 2-core
machine, plus about 45 for the first run's preprocessing and training (cached after). ``--autoseg-args``
adds flags to ``autoseg predict`` (e.g. "--tile-batch-size 1").

    python benchmarks/predict.py [--quick] [--nnunet-python /tmp/nnunet-venv/bin/python] [--work DIR]
        [--large Z Y X] [--typical N] [--epochs E] [--iterations I] [--tta] [--npp N] [--nps N] [--rounds R]
        [--autoseg-plan gpu8|cpu] [--autoseg-args "..."]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from _cases import ORGANS, make_cases_dataset, make_large_case
from _common import nnunet_env, nnunet_python, run_measured, run_nnunet

from autoseg.core.units import MiB

HERE = Path(__file__).resolve().parent
CONFIG = "3d_fullres"
FULL_LARGE, QUICK_LARGE = (300, 512, 512), (64, 256, 256)
OVERHEAD_TARGET = {"typical": 0.15, "large": 0.25}
PREDICTION_TOLERANCE = 0.15
RSS_RATIO_TARGET = 0.25


def prepare_autoseg(dataset: Path, work: Path, plan_device: str, epochs: int, iterations: int) -> Path:
    """A workspace planned (for ``plan_device``) and preprocessed once, fold 0 trained for ``epochs`` x
    ``iterations`` (trained again when those change)."""
    ws = work / f"autoseg_{plan_device}"
    if not (ws / ".preprocessed").is_file():
        target = ["--device", "cuda", "--gpu-memory", "8GiB"] if plan_device == "gpu8" else ["--device", "cpu"]
        r = run_measured(
            [
                sys.executable,
                "-m",
                "autoseg",
                "plan_and_preprocess",
                str(dataset),
                "-w",
                str(ws),
                "-c",
                CONFIG,
                "--processes",
                "2",
                "--overwrite",
                *target,
            ],
            log_path=work / "autoseg_plan.log",
        )
        print(f"autoseg plan_and_preprocess ({plan_device}): {r['seconds']:.0f} s")
        (ws / ".preprocessed").write_text("")
    marker = ws / f".trained_{epochs}x{iterations}"
    if not marker.is_file():
        for old in ws.glob(".trained_*"):
            old.unlink()
        shutil.rmtree(ws / "results", ignore_errors=True)
        r = run_measured(
            [
                sys.executable,
                "-m",
                "autoseg",
                "train",
                "0",
                "-w",
                str(ws),
                "-c",
                CONFIG,
                "--device",
                "cpu",
                "--epochs",
                str(epochs),
                "--iterations-per-epoch",
                str(iterations),
                "--val-iterations",
                "1",
                "--no-validation",
            ],
            log_path=work / "autoseg_train.log",
        )
        print(f"autoseg train fold 0, {epochs} x {iterations} iterations on the CPU: {r['seconds']:.0f} s")
        marker.write_text("")
    return ws


def prepare_nnunet(python: str, dataset: Path, work: Path, epochs: int, iterations: int) -> tuple[Path, dict]:
    """nnU-Net's folders under ``work/nnunet``, 3d_fullres preprocessed once and fold 0 trained for ``epochs``
    x ``iterations`` (benchmarks/_nnunet_train.py); the trained model folder and the environment to run in."""
    root = work / "nnunet"
    env = {**os.environ, **nnunet_env(root), "nnUNet_compile": "false", "nnUNet_n_proc_DA": "2"}
    if not (root / ".preprocessed").is_file():
        root.mkdir(parents=True, exist_ok=True)
        r = run_nnunet(python, dataset, root, 2, [CONFIG])
        print(f"nnUNetv2_plan_and_preprocess: {r['seconds']:.0f} s")
        (root / ".preprocessed").write_text("")
    results = Path(env["nnUNet_results"])
    marker = root / f".trained_{epochs}x{iterations}"
    if not marker.is_file():
        for old in root.glob(".trained_*"):
            old.unlink()
        shutil.rmtree(results, ignore_errors=True)
        results.mkdir(parents=True)
        r = run_measured(
            [python, str(HERE / "_nnunet_train.py"), str(epochs), str(iterations)],
            env=env,
            log_path=work / "nnunet_train.log",
        )
        print(f"nnU-Net train fold 0, {epochs} x {iterations} iterations on the CPU: {r['seconds']:.0f} s")
        marker.write_text("")
    return next(results.glob(f"Dataset*/nnUNetTrainer__nnUNetPlans__{CONFIG}")), env


def typical_inputs(dataset: Path, work: Path, count: int) -> Path:
    """A folder linking the first ``count`` held-out cases (nnU-Net's inference layout)."""
    folder = work / f"typical_{count}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    images = sorted((dataset / "imagesTs").glob("*_0000.nii.gz"))[:count]
    if len(images) < count:
        raise SystemExit(f"{dataset / 'imagesTs'} holds {len(images)} cases; --typical asks for {count}")
    for image in images:
        (folder / image.name).symlink_to(image)
    return folder


def run_predictor(tool: str, cmd_args: list[str], python: str, env: dict | None, work: Path, name: str) -> dict:
    """One predictor run in a fresh process under _forward_timer.py: run_measured's wall time and tree memory,
    the timer's forward seconds, and the log."""
    timer = work / f"{name}.timer.json"
    timer.unlink(missing_ok=True)
    log = work / f"{name}.log"
    load = os.getloadavg()[0]
    r = run_measured([python, str(HERE / "_forward_timer.py"), str(timer), tool, *cmd_args], env=env, log_path=log)
    return {**r, **json.loads(timer.read_text()), "load_before": load, "log": log}


def predict_autoseg(ws: Path, inputs: Path, out: Path, tta: bool, extra: list[str], work: Path, name: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    args = [
        "predict",
        "-i",
        str(inputs),
        "-o",
        str(out),
        "-w",
        str(ws),
        "-c",
        CONFIG,
        "-f",
        "0",
        "--device",
        "cpu",
        "--tta",
        "all" if tta else "none",
        "--verbose",
        *extra,
    ]
    r = run_predictor("autoseg", args, sys.executable, None, work, name)
    return {**r, **parse_autoseg_log(r["log"].read_text())}


def predict_nnunet(
    nnunet: tuple[str, dict, Path], inputs: Path, out: Path, tta: bool, workers: tuple[int, int], work: Path, name: str
) -> dict:
    """nnU-Net v2's predictor (``nnunet``: its python, environment and trained model) on ``inputs`` with ``workers``
    (-npp, -nps) processes."""
    python, env, model = nnunet
    npp, nps = workers
    shutil.rmtree(out, ignore_errors=True)
    args = [
        "-i",
        str(inputs),
        "-o",
        str(out),
        "-m",
        str(model),
        "-f",
        "0",
        "-device",
        "cpu",
        "-npp",
        str(npp),
        "-nps",
        str(nps),
        "--disable_progress_bar",
        *([] if tta else ["--disable_tta"]),
    ]
    return run_predictor("nnunet", args, python, env, work, name)


_MIB = r"([0-9.]+) MiB"


def parse_autoseg_log(text: str) -> dict:
    """From ``autoseg predict --verbose``: the pipeline line, the inference plans, and the predicted peaks:
    the pipeline's whole-process "predicted host peak" and its own "measured" one, else the largest plan's."""
    found: dict = {"plans": re.findall(r"case \S+, input .*", text)}
    pipeline = re.search(r"pipeline: (.*)", text)
    found["pipeline"] = pipeline.group(1) if pipeline else None
    host = re.search(rf"predicted host peak {_MIB}", text)
    plan_peaks = [float(v) for v in re.findall(rf"; predicted peak {_MIB}", text)]
    if host:
        found["predicted_bytes"], found["predicted_source"] = float(host.group(1)) * MiB, "pipeline host peak"
    elif plan_peaks:
        found["predicted_bytes"], found["predicted_source"] = max(plan_peaks) * MiB, "inference plan peak"
    self_measured = re.search(rf"host peak: predicted {_MIB}, measured {_MIB}", text)
    if self_measured:
        found["self_measured_bytes"] = float(self_measured.group(2)) * MiB
    return found


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
        "| case | tool | cases x voxels | s per case | first forward at | probe forwards | forward share "
        "| overhead (target) | peak RSS | peak PSS | processes | predicted peak | predicted / RSS (target "
        "0.85-1.15) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        overhead, target = 1 - r["forward_share"], OVERHEAD_TARGET[r["case"]]
        verdict = "" if r["tool"] != "autoseg" else (" pass" if overhead <= target else " FAIL")
        predicted, ratio = "-", "-"
        if r.get("predicted_bytes"):
            q = r["predicted_bytes"] / r["peak_rss_bytes"]
            predicted = f"{r['predicted_bytes'] / MiB:.0f} MiB"
            ratio = f"{q:.2f} {'pass' if abs(q - 1) <= PREDICTION_TOLERANCE else 'FAIL'}"
        first = "-" if r["first_forward_s"] is None else f"{r['first_forward_s']:.1f} s"
        each = ", ".join(f"{w / r['cases']:.1f}" for w in r["walls"])
        walls = "" if len(r["walls"]) == 1 else f" ({each})"
        lines.append(
            f"| {r['case']} | {r['tool']} | {r['cases']} x {r['voxels'] / 1e6:.1f} M | "
            f"{r['seconds'] / r['cases']:.1f}{walls} | {first} | {r['probe_s']:.1f} s | "
            f"{r['forward_share']:.0%} | "
            f"{overhead:.0%} (<= {target:.0%}){verdict} | {r['peak_rss_bytes'] / MiB:.0f} MiB | "
            f"{r['peak_pss_bytes'] / MiB:.0f} MiB | {r['processes']} | {predicted} | {ratio} |"
        )
    return "\n".join(lines)


def print_checks(rows: list[dict], large_voxels: int, full_voxels: int) -> None:
    by = {(r["case"], r["tool"]): r for r in rows}
    ours, theirs = by.get(("large", "autoseg")), by.get(("large", "nnU-Net v2"))
    if ours and theirs:
        q = ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]
        print(
            f"large case, autoseg / nnU-Net peak RSS {q:.2f} (target <= {RSS_RATIO_TARGET}: "
            f"{'pass' if q <= RSS_RATIO_TARGET else 'FAIL'}); PSS "
            f"{ours['peak_pss_bytes'] / theirs['peak_pss_bytes']:.2f}; wall time "
            f"{ours['seconds'] / theirs['seconds']:.2f}"
        )
    for r in rows:
        if r.get("self_measured_bytes"):
            print(
                f"{r['case']}: autoseg's own log: predicted host peak {r['predicted_bytes'] / MiB:.0f} MiB, "
                f"measured {r['self_measured_bytes'] / MiB:.0f} MiB (its peak RSS since the first case)"
            )
    if large_voxels < full_voxels:
        for tool in ("autoseg", "nnU-Net v2"):
            r = by.get(("large", tool))
            if r:
                per_voxel = (r["seconds"] - (r["first_forward_s"] or 0)) / large_voxels
                print(
                    f"{tool}: {per_voxel * 1e6:.1f} s per million voxels after the first forward pass on the large "
                    f"case; a {full_voxels / 1e6:.0f} M-voxel case would take about "
                    f"{(r['first_forward_s'] or 0) + per_voxel * full_voxels:.0f} s at that rate"
                )


def main() -> None:
    args = _parser().parse_args()
    large_shape = tuple(args.large or (QUICK_LARGE if args.quick else FULL_LARGE))
    typical = args.typical or (1 if args.quick else 3)
    iterations = args.iterations

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dataset = make_cases_dataset(work, args.cases, max(4, typical), tuple(args.shape))
    large = make_large_case(work, large_shape)
    ws = prepare_autoseg(dataset, work, args.autoseg_plan, args.epochs, iterations)
    python = nnunet_python(args.nnunet_python)
    nnunet = None if python is None else prepare_nnunet(python, dataset, work, args.epochs, iterations)
    typical_folder = typical_inputs(dataset, work, typical)
    voxels = {"typical": _voxels(typical_folder), "large": _voxels(large)}
    cases = {
        k: v for k, v in {"typical": (typical_folder, typical), "large": (large, 1)}.items() if args.only in (None, k)
    }
    print(
        f"{len(ORGANS)} foreground classes; typical: {typical} held-out case(s), "
        f"{voxels['typical'] / 1e6:.1f} M voxels in all; large: {'x'.join(map(str, large_shape))}; "
        f"TTA {'all' if args.tta else 'none'}; nnU-Net -npp {args.npp} -nps {args.nps}; autoseg planned for "
        f"{args.autoseg_plan}, both trained {args.epochs} x {iterations} iterations; {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if python is None:
        print("nnU-Net v2: not importable here; pass --nnunet-python PATH to compare")
    model = None if nnunet is None else (python, nnunet[1], nnunet[0])
    runs = _run_rounds(args, cases, ws, model, voxels, work)
    rows = summarize(runs)
    print(format_table(rows))
    print_checks(rows, voxels["large"], FULL_LARGE[0] * FULL_LARGE[1] * FULL_LARGE[2])
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")


def _run_rounds(
    args: argparse.Namespace,
    cases: dict[str, tuple[Path, int]],
    ws: Path,
    nnunet: tuple[str, dict, Path] | None,
    voxels: dict[str, int],
    work: Path,
) -> list[dict]:
    """Every tool on every case, ``args.rounds`` times, the tools' order alternating by round."""
    runs = []
    for round_ in range(args.rounds):
        for case, (inputs, count) in cases.items():
            tools = ["autoseg"] + ([] if nnunet is None else ["nnU-Net v2"])
            for tool in tools if round_ % 2 == 0 else tools[::-1]:
                name = f"{'autoseg' if tool == 'autoseg' else 'nnunet'}_{case}_{round_}"
                out = work / "out" / name
                if tool == "autoseg":
                    r = predict_autoseg(ws, inputs, out, args.tta, shlex.split(args.autoseg_args), work, name)
                else:
                    r = predict_nnunet(nnunet, inputs, out, args.tta, (args.npp, args.nps), work, name)
                r.update(case=case, tool=tool, cases=count, voxels=voxels[case])
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
    parser.add_argument("--epochs", type=int, default=1, help="training epochs of both tools")
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
    if r["tool"] == "autoseg":
        print(f"  pipeline: {r['pipeline']}\n  plan: " + "\n  plan: ".join(r["plans"][:2]))


def _voxels(folder: Path) -> int:
    from autoseg.dataset.imageio import read_geometry

    return sum(math.prod(read_geometry(p).size_xyz) for p in folder.glob("*_0000.nii.gz"))


if __name__ == "__main__":
    main()
