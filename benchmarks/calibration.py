"""Is the CPU calibration the same idle and beside busy processes, and do its plans run as predicted? (issue 26; run
by hand on a quiet machine)

Calibrates this machine's CPU rates (``autoseg.plan.calibration.calibrate_cpu_throughput``, in this process)
``--runs`` times in each of three conditions: idle; beside a process spinning on one core (``while True: pass``);
beside one busy half of every 0.1 s. Each calibration is kept (it would be cached) or not (the plan gets the
fallback). Each calibration's rates plan a two-channel CT/PET-like demo dataset for the CPU (1 s per iteration;
``autoseg.plan.planner.plan``); then, with the busy processes gone, THE training step of every distinct
3d_fullres and 2d configuration is timed (``iteration_speed.measure``: one warm-up, best and median of
``--repeats``) beside its predicted seconds per iteration (goal: within 20%).

Prints one line per calibration as it goes, then a table per calibration (condition, kept, attempts, rates,
configurations, predicted and measured seconds) and per condition the spread of the kept rates (max / min - 1) and
how many calibrations planned the same as the first idle one.

    python benchmarks/calibration.py [--runs 5] [--shape 48 160 160] [--repeats 5] [--data-dir DIR] [--quick]
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

from iteration_speed import cpu_budget, measure

SPIN = "while True: pass"
# busy for the first half of every 0.1 s, asleep for the second
HALF_BUSY = (
    "import time\n"
    "while True:\n"
    "    t = time.perf_counter() + 0.05\n"
    "    while time.perf_counter() < t: pass\n"
    "    time.sleep(0.05)"
)
CONDITIONS = (("idle", None), ("one spinning process", SPIN), ("one process busy half of each 0.1 s", HALF_BUSY))
CONFIGURATIONS = ("3d_fullres", "2d")


def two_channel_dataset(root: Path, cases: int, shape_zyx: tuple[int, int, int]) -> Path:
    """The demo dataset with a second channel (a copy of the first), named CT and PET like a PET/CT dataset."""
    from autoseg.demo.data import make_demo_dataset

    dataset = root / "Dataset001_PetCt"
    if not (dataset / "dataset.json").is_file():
        make_demo_dataset(dataset, num_train=cases, num_test=0, shape_zyx=shape_zyx, seed=0)
        for image in sorted((dataset / "imagesTr").glob("*_0000.nii.gz")):
            shutil.copyfile(image, image.with_name(image.name.replace("_0000.", "_0001.")))
        meta = json.loads((dataset / "dataset.json").read_text())
        meta["channel_names"] = {"0": "CT", "1": "PET"}
        (dataset / "dataset.json").write_text(json.dumps(meta, indent=2))
    return dataset


def calibrate(runs: int, repeats: int, attempts: int | None) -> list[tuple[str, object, float]]:
    """(condition, ``Measurement``, seconds) of ``runs`` calibrations in each of ``CONDITIONS`` (``attempts`` each at
    most; None: the calibration's own ``MAX_ATTEMPTS``)."""
    from autoseg.plan.calibration import calibrate_cpu_throughput
    from autoseg.plan.throughput import StepRates

    results = []
    for condition, code in CONDITIONS:
        load = None if code is None else subprocess.Popen([sys.executable, "-c", code])
        try:
            time.sleep(0 if load is None else 2)
            for run in range(runs):
                t0 = time.perf_counter()
                measured = calibrate_cpu_throughput(repeats=repeats, attempts=attempts)
                seconds = time.perf_counter() - t0
                results.append((condition, measured, seconds))
                print(
                    f"{condition}, {run + 1}: {'kept' if measured.keep else 'not kept'} after "
                    f"{measured.details['attempt']:g} attempt(s), "
                    f"{StepRates(**measured.value).describe()} [{seconds:.0f} s]; load {os.getloadavg()[0]:.1f}"
                    + ("" if measured.keep else f"\n    {measured.why_not_kept}"),
                    flush=True,
                )
        finally:
            if load is not None:
                load.kill()
                load.wait()
    return results


def plan_for(fp, rates):
    """The CPU plan of ``fp`` at ``rates`` (8 GiB of RAM, 1 s per iteration)."""
    from autoseg.plan.planner import plan

    budget = cpu_budget(rates)
    return plan(fp, budget)


def decisions(plans) -> dict:
    """What a plan decides per configuration (patch, batch, accumulation, network), without its notes (which quote
    the rates)."""
    return {
        name: (tuple(c.patch_size), c.batch_size, c.accumulation_steps, c.network)
        for name, c in plans.configurations.items()
    }


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values) - 1:.0%}" if values else "-"


def report(results, plans, timings) -> None:
    """The per-calibration table and the per-condition summary (markdown)."""
    from autoseg.plan.throughput import StepRates

    print(
        "\n| condition | kept | attempts | rates | configuration | patch | batch | predicted s | measured best / "
        "median s | median vs predicted |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for (condition, measured, _), plans_ in zip(results, plans):
        for name in CONFIGURATIONS:
            c = plans_.configurations.get(name)
            if c is None:
                continue
            best, median = timings[(c.network, tuple(c.patch_size), c.batch_size, c.accumulation_steps)]
            predicted = c.predicted_seconds_per_iteration
            print(
                f"| {condition} | {'yes' if measured.keep else 'no'} | {measured.details['attempt']:g} | "
                f"{StepRates(**measured.value).describe()} | {name} | {'x'.join(map(str, c.patch_size))} | "
                f"{c.batch_size} x {c.accumulation_steps} | {predicted:.3f} | {best:.3f} / {median:.3f} | "
                f"{100 * (median / predicted - 1):+.0f}% |"
            )
    first_idle = decisions(plans[0])
    print("\n| condition | kept | spread of kept GFLOP/s | spread of kept elements/s | same plan as idle run 1 |")
    print("|---|---|---|---|---|")
    for condition, _ in CONDITIONS:
        mine = [(m, p) for (c, m, _), p in zip(results, plans) if c == condition]
        kept = [m.value for m, _ in mine if m.keep]
        print(
            f"| {condition} | {len(kept)} of {len(mine)} | {spread([k['flops_per_second'] for k in kept])} | "
            f"{spread([k['elements_per_second'] for k in kept if k['elements_per_second']])} | "
            f"{sum(decisions(p) == first_idle for _, p in mine)} of {len(mine)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="calibrations per condition")
    parser.add_argument("--shape", type=int, nargs=3, default=[48, 160, 160], metavar=("Z", "Y", "X"))
    parser.add_argument("--cases", type=int, default=4, help="training cases of the generated dataset")
    parser.add_argument("--repeats", type=int, default=5, help="timed iterations per configuration")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the dataset goes (default: a temp folder)")
    parser.add_argument(
        "--quick", action="store_true", help="a check of the script: one calibration per condition, small data"
    )
    args = parser.parse_args()
    calibration_repeats, attempts = 5, None
    if args.quick:
        args.runs, args.shape, args.cases, args.repeats = 1, [16, 48, 48], 2, 1
        calibration_repeats, attempts = 2, 1

    from autoseg.core.machine import passive_openmp_waiting, use_cpu_threads

    passive_openmp_waiting(os.environ)  # before torch is imported, as the autoseg command does
    from autoseg.dataset.raw import load_dataset
    from autoseg.plan.fingerprint import fingerprint
    from autoseg.plan.throughput import StepRates

    use_cpu_threads(None, "the calibrations and timed steps")
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="calibration_"))
    try:
        dataset = two_channel_dataset(root, args.cases, tuple(args.shape))
        fp = fingerprint(load_dataset(dataset), progress=False, processes=1)
        print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
        results = calibrate(args.runs, calibration_repeats, attempts)
        plans, by_rates, timings = [], {}, {}
        for _, measured, _ in results:
            key = tuple(measured.value.values())
            if key not in by_rates:
                by_rates[key] = plan_for(fp, StepRates(**measured.value))
            plans.append(by_rates[key])
        for plans_ in by_rates.values():
            for name in CONFIGURATIONS:
                c = plans_.configurations.get(name)
                key = None if c is None else (c.network, tuple(c.patch_size), c.batch_size, c.accumulation_steps)
                if c is not None and key not in timings:
                    timings[key] = measure(c, args.repeats)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        report(results, plans, timings)
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
