"""The GPU half of the memory and speed models, held against a CUDA device in one command (issue 26).

The CUDA terms of the memory model (allocator rounding, autocast copies, GradScaler, cuDNN workspaces, the CUDA
context) are reasoned, and the CUDA seconds per iteration come from a table of datasheet peaks times an assumed
efficiency (``autoseg.plan.throughput``). This script measures both on the device at hand:

1. Training: for each reference dataset (``plans/reference``), budget (``--budgets``, GiB) and architecture
   (U-Net, ResEnc), the plan autoseg derives for this GPU (its name picks the throughput row); for its 2d and
   3d_fullres configurations, ``check_plan`` (what ``autoseg check-memory`` runs: real steps on synthetic batches,
   measured against the prediction, row by row) and the seconds of ``--iterations`` timed iterations of THE
   training step (each: the plan's micro-batch times its accumulation steps) against the plan's
   ``predicted_seconds_per_iteration``. A budget larger than the device's free memory is skipped, with a note.
2. Prediction: the demo dataset planned for the GPU, fold 0 trained for a few iterations on it, its test cases
   predicted on the GPU; per case the inference plan's predicted device peak (``plan_inference``, recorded as the
   predictor calls it) against ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, and the seconds.

It prints one table (markdown, for docs/benchmarks.md) and with ``--json FILE`` writes every figure. Without
CUDA it says so and exits 0. About 3-6 minutes on one recent GPU with the defaults.

    python benchmarks/gpu_check.py [--budgets 8 24] [--datasets Task03_Liver]
                                   [--iterations 10] [--json gpu_check.json] [--skip-predict]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = ("unet", "resenc")
CONFIGURATIONS = ("2d", "3d_fullres")


@dataclass
class Row:
    """One line of the table: what ran, the memory rows' errors, and the seconds per iteration."""

    what: str
    status: str = "ok"
    memory: dict[str, tuple[int, int]] = field(default_factory=dict)  # row -> (measured, predicted) bytes
    seconds_measured: float | None = None
    seconds_predicted: float | None = None
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        from autoseg.core.units import GiB

        def err(measured: float, predicted: float) -> str:
            return f"{100 * (measured - predicted) / max(predicted, 1e-12):+.0f}%"

        memory = "; ".join(f"{k} {m / GiB:.2f}/{p / GiB:.2f} GiB ({err(m, p)})" for k, (m, p) in self.memory.items())
        if self.seconds_measured is None or self.seconds_predicted is None:
            seconds = "-"
        else:
            error = err(self.seconds_measured, self.seconds_predicted)
            seconds = f"{self.seconds_measured:.3f} / {self.seconds_predicted:.3f} s ({error})"
        return [self.what, self.status, memory or "-", seconds, "; ".join(self.notes)]


def _time_iterations(config, device, iterations: int) -> float:
    """Median seconds of one iteration (one optimizer step over the plan's accumulation steps) of ``config``'s
    training step."""
    import torch

    from autoseg.dataset.labels import LabelScheme
    from autoseg.model.optimizer import OPTIMIZERS
    from autoseg.model.step import synthetic_batches
    from autoseg.train.memory_check import configured_step

    scheme = LabelScheme.for_outputs(config.network.num_outputs)
    step = configured_step(config, device, OPTIMIZERS["sgd"], scheme)
    step.network.train()
    made = synthetic_batches(
        config.network, scheme, config.batch_size, tuple(config.patch_size), torch.Generator().manual_seed(0)
    )
    # batches made beforehand and kept on the device, as the loader's workers hand them over in training: drawing
    # them on the CPU inside the timed step added 0.07 s of a 0.15 s iteration on an H200 (session 21)
    batches = itertools.cycle([{k: v.to(device) for k, v in next(made).items()} for _ in range(3)])
    times = []
    for i in range(iterations + 2):  # two warm-up iterations: cuDNN's algorithm search, the allocator's pools
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss, _ = step(batches)  # one optimizer step: the plan's accumulation steps of micro-batches
        loss.item()  # syncs with the device
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del step
    torch.cuda.empty_cache()
    return statistics.median(times)


def training_rows(datasets: list[str], budgets: list[int], iterations: int) -> list[Row]:
    import torch

    from autoseg.core.units import GiB
    from autoseg.model.topology import ARCHITECTURES
    from autoseg.plan.budget import Budget
    from autoseg.plan.planner import plan
    from autoseg.plan.reference import REFERENCE_CPU_COUNT, REFERENCE_HOST_RAM_BYTES, load_references, to_fingerprint

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    references = load_references()
    rows = []
    for dataset in datasets:
        fingerprint = to_fingerprint(references[dataset])
        for gib in budgets:
            for architecture in ARCHITECTURES:
                budget = Budget(
                    gpu_memory_bytes=gib * GiB,
                    host_ram_bytes=REFERENCE_HOST_RAM_BYTES,
                    device="cuda",
                    cpu_count=REFERENCE_CPU_COUNT,
                    gpu_name=name,
                    architecture=ARCHITECTURES[architecture],
                )
                plans = plan(fingerprint, budget)
                for config_name in CONFIGURATIONS:
                    if config_name in plans.configurations:
                        label = f"{dataset} {gib} GiB {architecture}"
                        rows.append(_training_row(plans, config_name, label, device, iterations))
                        print(" | ".join(rows[-1].cells()), flush=True)
    return rows


def _training_row(plans, config_name: str, label: str, device, iterations: int) -> Row:
    import torch

    from autoseg.train.memory_check import check_plan

    config = plans.configuration(config_name)
    shape = "x".join(map(str, config.patch_size))
    row = Row(
        f"{label} {config_name} (patch {shape}, batch {config.batch_size}x{config.accumulation_steps}, "
        f"{config.precision}{', checkpointing' if config.checkpointing else ''})"
    )
    free, _ = torch.cuda.mem_get_info(device)
    try:
        check = check_plan(plans, config_name, device)
    except Exception as e:  # a refusal (too large for this device) or an out-of-memory: both are findings
        row.status = type(e).__name__
        row.notes.append(str(e).splitlines()[0][:200])
        torch.cuda.empty_cache()
        return row
    row.status = "ok" if check.ok else "off"
    row.memory = {r.name: (r.measured_bytes, r.predicted_bytes) for r in check.rows if r.checked}
    row.notes += list(check.notes)
    row.seconds_measured = _time_iterations(config, device, iterations)
    row.seconds_predicted = config.predicted_seconds_per_iteration
    row.notes.append(f"free before: {free / 2**30:.1f} GiB")
    return row


def prediction_rows(work: Path, budget_gib: int) -> list[Row]:
    """The demo dataset planned for this GPU, fold 0 trained briefly, its test cases predicted on it."""
    import torch

    import autoseg.predict.case as case_module
    from autoseg.core.units import GiB
    from autoseg.core.workspace import Workspace
    from autoseg.demo.data import make_demo_dataset
    from autoseg.plan.budget import Budget
    from autoseg.predict.predictor import PredictOptions, predict
    from autoseg.predict.window import WindowOptions
    from autoseg.preprocess.run import PreprocessRequest, plan_and_preprocess
    from autoseg.train.run_config import RunConfig
    from autoseg.train.trainer import train

    dataset = make_demo_dataset(work / "Dataset001_Demo", num_train=8, num_test=3, seed=0)
    ws = Workspace.at(work / "ws")
    budget = Budget(gpu_memory_bytes=budget_gib * GiB, device="cuda", gpu_name=torch.cuda.get_device_name())
    plan_and_preprocess(dataset, ws, budget, preprocessing=PreprocessRequest(), progress=False)
    config = "3d_fullres"
    train(ws, config, 0, RunConfig(epochs=2, iterations_per_epoch=25, validate=False, device="cuda"), progress=False)
    plans_made = []
    original = case_module.plan_inference

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        plans_made.append(result)
        return result

    case_module.plan_inference = recording
    rows = []
    try:
        for image in sorted((dataset / "imagesTs").glob("*_0000.nii.gz")):
            single = work / "in" / image.name
            single.parent.mkdir(exist_ok=True)
            for old in single.parent.iterdir():
                old.unlink()
            single.write_bytes(image.read_bytes())
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            predict(
                ws,
                single.parent,
                work / "out",
                config_name=config,
                window=WindowOptions(device="cuda"),
                options=PredictOptions(progress=False),
            )
            seconds = time.perf_counter() - t0
            chosen = plans_made[-1]
            row = Row(
                f"predict {image.name} ({config}, tile batch {chosen.tile_batch_size}, accumulator on "
                f"{chosen.accumulator_device})"
            )
            row.memory = {
                "allocated": (torch.cuda.max_memory_allocated(), chosen.peak_bytes),
                "reserved": (torch.cuda.max_memory_reserved(), chosen.peak_bytes),
            }
            row.notes.append(f"{seconds:.2f} s for the case (read, preprocess, predict, export)")
            rows.append(row)
            print(" | ".join(row.cells()), flush=True)
    finally:
        case_module.plan_inference = original
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 24], help="GPU budgets to plan for, GiB")
    parser.add_argument("--datasets", nargs="+", default=["Task03_Liver"], help="reference datasets (plans/reference)")
    parser.add_argument("--iterations", type=int, default=10, help="timed training iterations per configuration")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--skip-predict", action="store_true")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a machine with a GPU)")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("| what | status | memory measured/predicted (error) | s per iteration measured/predicted | notes |")
    print("|---|---|---|---|---|")
    t0 = time.perf_counter()
    rows = training_rows(args.datasets, args.budgets, args.iterations)
    if not args.skip_predict:
        with tempfile.TemporaryDirectory() as tmp:
            rows += prediction_rows(Path(tmp), min(args.budgets))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f} s; the table again:\n")
    print("| what | status | memory measured/predicted (error) | s per iteration measured/predicted | notes |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps([row.__dict__ for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
