"""Predicted vs measured seconds per training iteration of CPU plans (issue 16; run by hand on a quiet machine).

Plans the demo dataset, and a demo dataset of larger images (``--large``), for the CPU (``autoseg.plan``, in this
process) at several seconds-per-iteration targets, so the planner picks several patch sizes, networks and
batches, in 3D and 2D; for each distinct configuration it prints the plan's ``predicted_seconds_per_iteration``
(the step's FLOPs and feature-map elements at the CPU rates the plan used, ``plan.throughput.StepRates``) beside the
measured seconds of THE training step (``autoseg.plan.calibration.training_step_closure``: forward, loss,
backward, optimizer) with the plan's network, patch and micro-batch, times its accumulation steps: one warm-up,
then the best and the median of ``--repeats`` runs with every CPU. The loader is not in it (on CPU the plan has
no loader workers; the trainer's data wait is logged per epoch). Other processes on the machine inflate the
measured seconds: the script prints the load average before and after.

    python benchmarks/iteration_speed.py [--targets 0.25 0.5 1 2] [--repeats 5] [--cpu-flops F] [--large Z Y X]
                                         [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def cpu_budget(rates, seconds_per_iteration: float = 1.0):
    """A CPU plan's budget at ``rates`` (``StepRates``): 8 GiB of RAM, ``seconds_per_iteration`` per iteration."""
    from autoseg.core.units import GiB
    from autoseg.plan.budget import Budget
    from autoseg.plan.iteration_target import iteration_target

    return Budget(
        gpu_memory_bytes=8 * GiB,
        host_ram_bytes=8 * GiB,
        device="cpu",
        cpu_flops_per_second=rates.flops_per_second,
        cpu_elements_per_second=rates.elements_per_second,
        cpu_mapped_bytes_per_second=rates.mapped_bytes_per_second,
        iteration=iteration_target(seconds=seconds_per_iteration),
    )


def measure(config, repeats: int) -> tuple[float, float]:
    """(best, median) wall seconds of one iteration of ``config``: its micro-batch step times its accumulation."""
    from autoseg.plan.calibration import training_step_closure

    step = training_step_closure(config.network, tuple(config.patch_size), config.batch_size)
    step()  # warm-up: allocations, oneDNN's kernel choice
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(config.accumulation_steps):
            step()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1.0, 2.0],
        help="the planner's seconds per iteration on CPU (Budget.cpu_seconds_per_iteration)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed iterations per configuration")
    parser.add_argument(
        "--cpu-flops",
        type=float,
        default=None,
        help="plan with this FLOP rate alone (default: both rates measured now, best of 3)",
    )
    parser.add_argument(
        "--large",
        type=int,
        nargs=3,
        default=[48, 160, 160],
        metavar=("Z", "Y", "X"),
        help="image size of the second demo dataset (larger patches; 0 0 0: none)",
    )
    parser.add_argument("--quick", action="store_true", help="one target, 2 repeats: a check of the script")
    args = parser.parse_args()
    if args.quick:
        args.targets, args.repeats = args.targets[:1], 2

    from autoseg.core.machine import passive_openmp_waiting, use_cpu_threads

    passive_openmp_waiting(os.environ)  # before torch is imported, as the autoseg command does
    from autoseg.dataset.raw import load_dataset
    from autoseg.demo.data import make_demo_dataset
    from autoseg.plan.calibration import calibrate_cpu_throughput
    from autoseg.plan.fingerprint import fingerprint
    from autoseg.plan.planner import plan
    from autoseg.plan.throughput import StepRates

    use_cpu_threads(None, "the timed steps")
    rates = StepRates(args.cpu_flops) if args.cpu_flops else StepRates(**calibrate_cpu_throughput().value)
    print(
        f"CPU throughput {rates.describe()} ({'--cpu-flops' if args.cpu_flops else 'measured now'}); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    shapes = [None] + ([tuple(args.large)] if all(args.large) else [])
    with tempfile.TemporaryDirectory() as tmp:
        fingerprints = []
        for shape in shapes:
            extra = {} if shape is None else {"shape_zyx": shape, "num_train": 6, "num_test": 0}
            folder = make_demo_dataset(Path(tmp) / f"Dataset00{len(fingerprints) + 1}_Demo", **extra)
            fingerprints.append((shape, fingerprint(load_dataset(folder), progress=False, processes=1)))
    rows, seen = [], set()
    for shape, fp in fingerprints:
        for target in args.targets:
            budget = cpu_budget(rates, target)
            for name, config in plan(fp, budget).configurations.items():
                key = (config.network, tuple(config.patch_size), config.batch_size, config.accumulation_steps)
                if name == "3d_lowres" or key in seen:
                    continue
                seen.add(key)
                best, median = measure(config, args.repeats)
                predicted = config.predicted_seconds_per_iteration
                dataset = "demo" if shape is None else "x".join(map(str, shape))
                rows.append((dataset, target, name, config, predicted, best, median))
                print(
                    f"{dataset} target {target:g} s  {name:10s} patch {'x'.join(map(str, config.patch_size)):>10s} "
                    f"batch {config.batch_size} x {config.accumulation_steps}  width "
                    f"{config.network.features_per_stage[0]}  predicted {predicted:.3f} s  measured best "
                    f"{best:.3f} / median {median:.3f} s  ({100 * (median / predicted - 1):+.0f}%)",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        "\n| dataset | target s | configuration | patch | batch x accumulation | width | predicted s "
        "| measured best / median s | median vs predicted |\n|---|---|---|---|---|---|---|---|---|"
    )
    for dataset, target, name, c, predicted, best, median in rows:
        print(
            f"| {dataset} | {target:g} | {name} | {'x'.join(map(str, c.patch_size))} | "
            f"{c.batch_size} x {c.accumulation_steps} "
            f"| {c.network.features_per_stage[0]} | {predicted:.3f} | {best:.3f} / {median:.3f} | "
            f"{100 * (median / predicted - 1):+.0f}% |"
        )


if __name__ == "__main__":
    main()
