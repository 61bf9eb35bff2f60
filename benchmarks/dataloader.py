"""Batches/s and peak memory of the training data pipeline, autoseg's and nnU-Net v2's (run by hand).

Generates (once, cached) ``--cases`` synthetic cases of about ``--shape`` voxels (z y x), preprocesses them
with ``autoseg plan_and_preprocess --precompute-augmentations K`` (cached per K) and, with
``--nnunet-python PATH`` (an interpreter of a venv with nnunetv2), with ``nnUNetv2_plan_and_preprocess``.
Both pipelines then run at the autoseg plan's 3d_fullres patch and batch size (or ``--patch`` /
``--batch``) with ``--workers`` worker processes, each in its own subprocess:

- autoseg: ``BatchLoader`` with the trainer's ``LoaderConfig`` (``autoseg.plan.training_data.loader_config``) over
  fold 0's training cases, on the fly and with ``use_precomputed``;
- nnU-Net: ``nnUNetTrainer.get_dataloaders()`` itself (its nnUNetDataLoader, default training transforms
  with deep-supervision targets, NonDetMultiThreadedAugmenter with ``nnUNet_n_proc_DA`` workers) on the plans
  with the same patch and batch size; the validation augmenter it also starts is shut down before timing.

Each times ``--batches`` batches after ``--warmup`` and polls its process tree's summed RSS and PSS every
0.1 s from the loader's start to the end (PSS shares library and page-cache pages between the processes
mapping them). The pipelines alternate for ``--rounds`` rounds, since other jobs on the machine slow
whichever runs at the time; the table gives the median.

    python benchmarks/dataloader.py [--cases 20] [--shape 100 256 256] [--workers 2] [--batches 50]
        [--warmup 10] [--rounds 2] [--copies 2] [--patch Z Y X] [--batch B]
        [--nnunet-python /path/to/venv/bin/python] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import (
    TreeMemoryPeak,
    add_child_arguments,
    make_dataset,
    nnunet_env,
    nnunet_python,
    parse_or_serve_child,
    run_measured,
    run_nnunet,
    tree_cpu_seconds,
)

from autoseg.core.units import MiB

CONFIG = "3d_fullres"


def prepare_autoseg(dataset: Path, root: Path, copies: int, processes: int, gpu_memory: str) -> Path:
    """A workspace planned for a CUDA device of ``gpu_memory`` with ``copies`` augmented copies per case."""
    workspace = root / "autoseg_loader_workspace"
    marker = workspace / f".prepared_{copies}_copies"
    if not marker.is_file():
        cmd = [
            sys.executable,
            "-m",
            "autoseg",
            "-q",
            "plan_and_preprocess",
            str(dataset),
            "-w",
            str(workspace),
            "--gpu-memory",
            gpu_memory,
            "--device",
            "cuda",
            "--processes",
            str(processes),
            "-c",
            CONFIG,
            "--precompute-augmentations",
            str(copies),
        ]
        workspace.mkdir(parents=True, exist_ok=True)
        r = run_measured(cmd, log_path=root / "autoseg_loader_preprocess.log")
        print(f"autoseg plan_and_preprocess ({copies} copies per case): {r['seconds']:.0f} s")
        marker.write_text("")
    return workspace


def prepare_nnunet(python: str, dataset: Path, root: Path, processes: int) -> Path:
    """nnU-Net's raw / preprocessed / results folders for the dataset (3d_fullres preprocessed once)."""
    work = root / "nnunet_loader"
    marker = work / ".prepared"
    if not marker.is_file():
        work.mkdir(parents=True, exist_ok=True)
        r = run_nnunet(python, dataset, work, processes, [CONFIG])
        print(f"nnUNetv2_plan_and_preprocess: {r['seconds']:.0f} s")
        marker.write_text("")
    return work


def plan_patch_and_batch(workspace: Path) -> tuple[tuple[int, ...], int]:
    config = json.loads((workspace / "plans.json").read_text())["configurations"][CONFIG]
    return tuple(config["patch_size"]), int(config["batch_size"])


def time_batches(next_batch: Callable[[], object], warmup: int, batches: int) -> dict:
    """Wall and CPU seconds (this process and its workers) of ``batches`` calls of ``next_batch`` after
    ``warmup`` calls (queues drained by then)."""
    for _ in range(warmup):
        next_batch()
    t0, cpu0 = time.perf_counter(), tree_cpu_seconds(os.getpid())
    for _ in range(batches):
        next_batch()
    seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds(os.getpid()) - cpu0
    return {
        "batches": batches,
        "seconds": seconds,
        "batches_per_s": batches / seconds,
        "cpu_s_per_batch": cpu / batches,
    }


def child_autoseg(spec: dict) -> dict:
    """autoseg's BatchLoader as the trainer builds it, at the spec's patch, batch and worker count."""
    import dataclasses

    import torch

    from autoseg.core.workspace import Workspace
    from autoseg.data.loader import BatchLoader
    from autoseg.plan.plans import Plans
    from autoseg.plan.training_data import loader_config
    from autoseg.train.trainer import fold_cases

    torch.set_num_threads(1)  # this process only receives batches
    workspace = Workspace.at(spec["workspace"])
    planned = Plans.from_json(workspace.plans_path).configurations[CONFIG]
    planned = dataclasses.replace(planned, patch_size=tuple(spec["patch"]), batch_size=spec["batch"])
    config = loader_config(planned, augment=True, use_precomputed=spec["precomputed"])
    train_ids, _ = fold_cases(workspace, CONFIG, 0)
    with TreeMemoryPeak(os.getpid(), interval_s=0.5) as memory:
        t0 = time.perf_counter()
        loader = BatchLoader(
            workspace.preprocessed(CONFIG),
            train_ids,
            config,
            seed=0,
            num_workers=spec["workers"],
            queue_depth=planned.loader_queue_depth,
        )
        first = next(loader)
        startup_s = time.perf_counter() - t0
        timing = time_batches(lambda: next(loader), spec["warmup"], spec["batches"])
        estimate = loader.host_bytes()
        loader.close()
    shapes = {k: list(v.shape) for k, v in first.items()}
    return {
        **timing,
        **memory.as_dict(),
        "startup_s": startup_s,
        "shapes": shapes,
        "cases": len(train_ids),
        "dummy_2d": config.dummy_2d,
        "read_box_max": list(config.enlarged_patch_size),
        "queue_depth": planned.loader_queue_depth,
        "estimated_bytes": estimate,
    }


def child_nnunet(spec: dict) -> dict:
    """nnUNetTrainer.get_dataloaders() on its plans with the spec's patch and batch size."""
    os.environ.update(nnunet_env(Path(spec["work"])))
    os.environ.update(nnUNet_n_proc_DA=str(spec["workers"]), nnUNet_compile="false")
    import torch
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    folder = next(Path(os.environ["nnUNet_preprocessed"]).glob("Dataset*"))
    plans = json.loads((folder / "nnUNetPlans.json").read_text())
    plans["configurations"][CONFIG].update(patch_size=list(spec["patch"]), batch_size=spec["batch"])
    plans["continue_training"] = False  # nnUNetTrainer.__init__ pops it (run_training sets it)
    dataset_json = json.loads((folder / "dataset.json").read_text())
    trainer = nnUNetTrainer(plans, CONFIG, 0, dataset_json, device=torch.device("cpu"))
    trainer._set_batch_size_and_oversample()  # what initialize() does for the loader, without the network
    t0 = time.perf_counter()
    train, val = trainer.get_dataloaders()  # starts both augmenters and draws one batch from each
    startup_s = time.perf_counter() - t0
    getattr(val, "_finish", lambda: None)()  # the benchmark times training batches only
    with TreeMemoryPeak(os.getpid(), interval_s=0.5) as memory:
        timing = time_batches(lambda: next(train), spec["warmup"], spec["batches"])
        batch = next(train)
    getattr(train, "_finish", lambda: None)()
    shapes = {"data": list(batch["data"].shape), "target": [list(t.shape) for t in batch["target"]]}
    _, _, initial_patch, _ = trainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size()
    return {
        **timing,
        **memory.as_dict(),
        "startup_s": startup_s,
        "shapes": shapes,
        "cases": len(trainer.do_split()[0]),
        "read_box_max": [int(v) for v in initial_patch],
    }


def run_child(python: str, spec: dict, log: Path) -> dict:
    """Run ``spec`` in a fresh ``python`` process; its result with the load average before it started."""
    load = os.getloadavg()[0]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps({**spec, "out": out.name})]
        run_measured(cmd, log_path=log)
        result = json.loads(Path(out.name).read_text())
    return {**result, "load_before": load}


def summarize(results: list[dict]) -> list[dict]:
    """One row per (pipeline, mode): medians over the rounds of batches/s and of CPU seconds per batch (all
    its processes), peak memory over the rounds, and both medians relative to nnU-Net on the fly (None
    without an nnU-Net run): how many times its batches/s, and its CPU seconds per batch over this row's."""
    rows: dict[tuple[str, str], dict] = {}
    for r in results:
        row = rows.setdefault(
            (r["pipeline"], r["mode"]),
            {
                "pipeline": r["pipeline"],
                "mode": r["mode"],
                "workers": r["workers"],
                "rates": [],
                "cpu": [],
                "pss": 0,
                "rss": 0,
            },
        )
        row["rates"].append(r["batches_per_s"])
        row["cpu"].append(r["cpu_s_per_batch"])
        row["pss"], row["rss"] = max(row["pss"], r["peak_pss_bytes"]), max(row["rss"], r["peak_rss_bytes"])
    for row in rows.values():
        row["median"], row["median_cpu"] = statistics.median(row["rates"]), statistics.median(row["cpu"])
    reference = rows.get(("nnU-Net v2", "on-the-fly"))
    for row in rows.values():
        row["ratio"] = None if reference is None else row["median"] / reference["median"]
        row["cpu_ratio"] = None if reference is None else reference["median_cpu"] / row["median_cpu"]
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    lines = [
        "| pipeline | mode | workers | batches/s: median (each round) | CPU s per batch | peak PSS | peak RSS "
        "| vs nnU-Net: batches/s, CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rates = ", ".join(f"{v:.2f}" for v in r["rates"])
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x, {r['cpu_ratio']:.2f}x"
        lines.append(
            f"| {r['pipeline']} | {r['mode']} | {r['workers']} | {r['median']:.2f} ({rates}) | "
            f"{r['median_cpu']:.3f} | {r['pss'] / MiB:.0f} MiB | {r['rss'] / MiB:.0f} MiB | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--shape", type=int, nargs=3, default=(100, 256, 256), metavar=("Z", "Y", "X"))
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes of both pipelines")
    parser.add_argument("--batches", type=int, default=50, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=10, help="batches drawn before the timing starts")
    parser.add_argument("--rounds", type=int, default=2, help="times each pipeline runs, alternating")
    parser.add_argument("--copies", type=int, default=2, help="precomputed augmented copies per case")
    parser.add_argument("--patch", type=int, nargs="+", default=None, help="override the plan's patch (z y x)")
    parser.add_argument("--batch", type=int, default=None, help="override the plan's batch size")
    parser.add_argument("--gpu-memory", default="8GiB", help="GPU memory autoseg plans for")
    parser.add_argument("--processes", type=int, default=2, help="preprocessing processes")
    parser.add_argument("--nnunet-python", default=None, help="python of a venv with nnunetv2 installed")
    add_child_arguments(parser, "autoseg_dataloader_bench")
    args = parse_or_serve_child(parser, "pipeline", {"autoseg": child_autoseg, "nnU-Net v2": child_nnunet})
    if args is None:
        return

    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    dataset = make_dataset(root, args.cases, tuple(args.shape))
    workspace = prepare_autoseg(dataset, root, args.copies, args.processes, args.gpu_memory)
    patch, batch = plan_patch_and_batch(workspace)
    patch, batch = tuple(args.patch or patch), args.batch or batch
    python = nnunet_python(args.nnunet_python)
    common = {"patch": patch, "batch": batch, "workers": args.workers, "warmup": args.warmup, "batches": args.batches}
    runs = [
        ("autoseg", "on-the-fly", sys.executable, {"workspace": str(workspace), "precomputed": False}),
        (
            "autoseg",
            f"precomputed ({args.copies} copies)",
            sys.executable,
            {"workspace": str(workspace), "precomputed": True},
        ),
    ]
    if python is None:
        print("nnU-Net v2: not importable here; pass --nnunet-python PATH to compare")
    else:
        runs.insert(
            1,
            ("nnU-Net v2", "on-the-fly", python, {"work": str(prepare_nnunet(python, dataset, root, args.processes))}),
        )
    print(
        f"patch {patch}, batch {batch}, {args.workers} workers, {args.warmup} + {args.batches} batches per run, "
        f"{os.cpu_count()} CPUs"
    )
    results = []
    for round_ in range(args.rounds):
        for pipeline, mode, interpreter, extra in runs if round_ % 2 == 0 else runs[::-1]:
            spec = {**common, **extra, "pipeline": pipeline}
            r = {
                **run_child(interpreter, spec, root / f"{pipeline.split()[0]}_loader.log"),
                "pipeline": pipeline,
                "mode": mode,
                "workers": args.workers,
            }
            results.append(r)
            print(
                f"round {round_}: {pipeline} {mode}: {r['batches_per_s']:.2f} batches/s, "
                f"{r['cpu_s_per_batch']:.3f} CPU s per batch, peak PSS "
                f"{r['peak_pss_bytes'] / MiB:.0f} MiB, RSS {r['peak_rss_bytes'] / MiB:.0f} MiB "
                f"({r['processes']} processes), startup {r['startup_s']:.1f} s, load before "
                f"{r['load_before']:.1f}; batch {r['shapes']}, largest read box {r['read_box_max']}"
            )
            if "estimated_bytes" in r:  # BatchLoader.host_bytes(): workers + the trainer's copy, not the trainer
                print(
                    f"  estimated loader bytes {r['estimated_bytes'] / MiB:.0f} MiB (upper bound, without the "
                    "process that consumes the batches)"
                )
    print(format_table(summarize(results)))
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")


if __name__ == "__main__":
    main()
