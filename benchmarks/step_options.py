"""Faster CPU training steps, measured (issue 28; run by hand): the training step as the trainer runs it, and the
options that might make it faster, side by side with the same network, batches and starting weights.

Each ``--variant`` runs in a fresh process (``autoseg.model.step.build_step`` on ``synthetic_batches``: 2 channels,
4 outputs, the 5-stage 16-256 features U-Net of the small-structures CPU plan, batch 2, ``--patch``), the variants
alternating run by run for ``--rounds`` rounds so that they see the same load:

- ``fp32``: the step as autoseg trains today (the reference);
- ``channels_last``: the network and each batch in ``torch.channels_last_3d``;
- ``bf16``: the step's bf16 autocast (``precision="bf16"``);
- ``compile``: ``torch.compile`` of the network (inductor's default mode; its compile time is the first steps');
- ``threads1``: one torch thread instead of ``--threads``.

Per variant: the median wall and CPU seconds of a step (the first ``SKIP`` of a run left out: kernels made,
compiled, allocated), the first step's wall seconds, and the loss curve against fp32's (the largest relative
difference of a step's loss over the run's steps; same seed, same batches): an option is adoptable only where that
stays at float rounding.

    python benchmarks/step_options.py                                  # every variant, 3 rounds, 20x80x80
    python benchmarks/step_options.py --variant fp32 --variant bf16 --rounds 2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
VARIANTS = ("fp32", "channels_last", "bf16", "compile", "threads1")
SKIP = 3  # steps left out of a run's medians
COMPILE_SKIP = 6  # torch.compile recompiles once more on the second step's shapes: left out too


def child(args: argparse.Namespace) -> None:
    """One run of one variant in this fresh process; writes its step times and losses to ``args.out``."""
    import torch

    from autoseg.dataset.labels import LabelScheme
    from autoseg.model.step import build_step, synthetic_batches
    from autoseg.model.topology import NetworkTopology

    variant = args.variant[0]
    torch.set_num_threads(1 if variant == "threads1" else args.threads)
    kernels = ((1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    strides = ((1, 1, 1), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2))
    topology = NetworkTopology(3, 2, 4, (16, 32, 64, 128, 256), kernels, strides)
    scheme = LabelScheme.from_labels({"background": 0, "organ": 1, "tubes": 2, "lesions": 3})
    torch.manual_seed(0)  # the same starting weights for every variant
    step = build_step(topology, scheme, precision="bf16" if variant == "bf16" else "fp32")
    batches = synthetic_batches(topology, scheme, 2, _patch(args.patch), torch.Generator().manual_seed(0))
    if variant == "channels_last":
        step.network.to(memory_format=torch.channels_last_3d)
        batches = ({**b, "data": b["data"].to(memory_format=torch.channels_last_3d)} for b in batches)
    if variant == "compile":
        step.network = torch.compile(step.network)
    walls, cpus, losses = [], [], []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        losses.append(step(batches)[0].item())  # .item(): the step ends as the trainer ends it
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    record = {"walls": walls, "cpus": cpus, "losses": losses, "load": os.getloadavg()[0]}
    Path(args.out).write_text(json.dumps(record))


def _patch(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def run(args: argparse.Namespace, folder: Path) -> dict[str, list[dict]]:
    """Every variant, ``args.rounds`` times, alternating; each run's record."""
    records: dict[str, list[dict]] = {v: [] for v in args.variant}
    for r in range(args.rounds):
        for variant in args.variant if r % 2 == 0 else reversed(args.variant):
            out = folder / f"{variant}_{r}.json"
            command = [sys.executable, str(HERE), "--child", "--variant", variant, "--out", str(out)]
            command += ["--patch", args.patch, "--steps", str(args.steps), "--threads", str(args.threads)]
            env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # as the autoseg command sets it
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{variant} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            records[variant].append(json.loads(out.read_text()))
            print(f"round {r}, {variant}: {statistics.median(records[variant][-1]['walls']):.2f} s a step", flush=True)
    return records


def table(records: dict[str, list[dict]]) -> str:
    """The markdown table: per variant the medians over its runs."""

    def steady(run: dict, name: str, variant: str) -> list[float]:
        values = run[name]
        return values[COMPILE_SKIP if variant == "compile" else SKIP :] or values[1:] or values

    reference = records.get("fp32")
    base = statistics.median(w for run in reference for w in steady(run, "walls", "fp32")) if reference else None
    lines = [
        "| variant | s per step (wall) | vs fp32 | CPU s per step | first step (s) | loss vs fp32: largest relative "
        "difference | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, runs in records.items():
        wall = statistics.median(w for run in runs for w in steady(run, "walls", variant))
        cpu = statistics.median(c for run in runs for c in steady(run, "cpus", variant))
        first = statistics.median(run["walls"][0] for run in runs)
        ratio = f"{wall / base:.2f}x" if base else "-"
        if reference:
            ref = reference[0]["losses"]
            diff = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], ref, strict=True))
            loss = f"{diff:.1e}"
        else:
            loss = "-"
        load = statistics.median(run["load"] for run in runs)
        lines.append(f"| {variant} | {wall:.3f} | {ratio} | {cpu:.3f} | {first:.1f} | {loss} | {load:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeat; default: every variant")
    parser.add_argument("--patch", default="20x80x80", help="ZxYxX (default: 20x80x80)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default: 12)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.variant = args.variant or list(VARIANTS)
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="autoseg-step-options-") as folder:
        records = run(args, Path(folder))
    print(f"\n{os.cpu_count()} CPUs, batch 2, patch {args.patch}, {args.steps} steps a run, {args.rounds} rounds\n")
    print(table(records))


if __name__ == "__main__":
    main()
