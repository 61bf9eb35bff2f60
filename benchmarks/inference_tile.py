"""Planned inference tile against the training patch: sliding-window seconds per case, tiles per case and Dice per
class on held-out cases of a trained workspace (run by hand).

Variants (``--variants``):

- ``patch``: the training patch at half-patch steps (``autoseg predict --tile patch``);
- ``planned``: each case's tile from the plan's inference tile (``tile_for_image``: no larger than the image),
  consecutive tiles overlapping by half a training patch (``--tile planned``, the default);
- ``planned-half-tile``: the same tiles at half-tile steps (the overlap rule not chosen, for comparison);
- ``planned-padded``: the plan's inference tile on every case, zero-padded where the image is smaller (the
  per-case rule not chosen, for comparison).

Each case is preprocessed once; per variant and repeat (variants alternate within a repeat, so a load change on a
shared machine hits them alike) only the sliding window is timed (preprocessing and export do not depend on the
tile; the first repeat includes the memory model's one simulation per new tile shape, ``plan_inference``, which a
process pays once per shape), then the label map is exported and written to ``OUT/<variant>/`` and evaluated
against ``--labels``.

``--make Z Y X`` first makes the workspace where it has no trained fold 0: ``autoseg.demo`` data of that nominal
shape (24 training, 6 held-out cases), planned and preprocessed on CPU, fold 0 trained ``--epochs`` x
``--iterations`` (as ``autoseg demo``: 30 x 20); ``-i``/``-l`` then default to its held-out cases.

    python benchmarks/inference_tile.py -w WORKSPACE [--make 40 128 128] [-i IMAGES -l LABELS] -o OUT
        [--repeats 2] [--tta 4] [--threads 1] [--variants patch planned planned-half-tile planned-padded]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import write_image
from autoseg.dataset.inputs import list_prediction_inputs
from autoseg.evaluate.metrics import evaluate_folder
from autoseg.memory.inference import InferenceSetting
from autoseg.memory.inference_plan import plan_inference
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tiles import overlap_step_fractions, tile_layout
from autoseg.model.window import SlidingWindow
from autoseg.plan.inference_tile import tile_for_image
from autoseg.plan.plans import Plans
from autoseg.predict.case import export_prediction, inference_budget_bytes, predict_probabilities, prepare_case
from autoseg.predict.networks import Predictor, load_trained_network
from autoseg.predict.window import WindowOptions

VARIANTS = ("patch", "planned", "planned-half-tile", "planned-padded")
RAW_NAME = "Dataset900_Demo"


def _tile(config, variant: str, image_shape_zyx: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(tile, per-axis step fractions) of a variant on one image."""
    if variant == "planned-padded":
        tile = config.inference_tile("planned")
        return tile, overlap_step_fractions(tile, config.patch_size)
    tile = tile_for_image(config, image_shape_zyx, "patch" if variant == "patch" else "planned")
    if variant == "planned-half-tile":
        return tile, (0.5,) * len(tile)
    return tile, overlap_step_fractions(tile, config.patch_size)


def _other_window(data, predictor: Predictor, variant: str) -> torch.Tensor:
    """``predict_probabilities`` with the tile and steps of a variant that is not a product setting."""
    config, scheme = predictor.config, predictor.plans.label_scheme
    tile, steps = _tile(config, variant, data.shape[1:])
    axes, variants = predictor.window.mirror_axes(config), predictor.window.num_variants(config)
    setting = InferenceSetting(
        config.network,
        tile,
        data.shape[1:],
        scheme.num_outputs,
        mirror_axes=axes,
        tta=variants,
        step_fraction=steps,
        accumulator_dtype="float16",
    )
    plan = plan_inference(setting, inference_budget_bytes("cpu"), runners=predictor.runners)
    window = SlidingWindow(
        tile,
        scheme.num_outputs,
        step_fraction=steps,
        mirror_axes=axes,
        tta=variants,
        tile_batch_size=plan.tile_batch_size,
        activation="sigmoid" if scheme.has_regions else "softmax",
    )
    return sliding_window_predict(predictor.runners, data, window)


def make_workspace(root: Path, shape_zyx: tuple[int, int, int], epochs: int, iterations: int) -> None:
    """A demo-data workspace with fold 0 trained (the steps of ``autoseg demo`` before it predicts)."""
    from autoseg.core.resources import available_ram_bytes
    from autoseg.core.units import GiB
    from autoseg.demo.data import make_demo_dataset
    from autoseg.plan.budget import Budget
    from autoseg.plan.run import plan_dataset
    from autoseg.preprocess.run import preprocess_workspace
    from autoseg.train.run_config import RunConfig
    from autoseg.train.trainer import train

    ws = Workspace.at(root)
    raw = make_demo_dataset(ws.root / "raw" / RAW_NAME, num_train=24, num_test=6, shape_zyx=shape_zyx)
    plan_dataset(
        raw, ws, Budget(gpu_memory_bytes=8 * GiB, host_ram_bytes=available_ram_bytes(), device="cpu"), progress=False
    )
    preprocess_workspace(ws, ["3d_fullres"], processes=1, progress=False)
    train(
        ws,
        "3d_fullres",
        0,
        RunConfig(epochs=epochs, iterations_per_epoch=iterations, val_iterations=5, device="cpu", validate=False),
        progress=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    ws = Workspace.at(args.workspace)
    if args.make and not ws.checkpoint(args.config, 0, "final").is_file():
        make_workspace(ws.root, tuple(args.make), args.epochs, args.iterations)
    images = args.images or ws.root / "raw" / RAW_NAME / "imagesTs"
    labels_dir = args.labels or ws.root / "raw" / RAW_NAME / "labelsTs"
    torch.set_num_threads(args.threads)
    plans = Plans.from_json(ws.plans_path)
    config = plans.configuration(args.config)
    network = load_trained_network(ws.checkpoint(args.config, 0, "final"), config, "cpu")
    cases = list_prediction_inputs(images, len(plans.channel_names), None, 3, None).cases
    prepared = {c.case_id: prepare_case(c, plans, config) for c in cases}
    out = Path(args.output)
    first_id, (first, _) = next(iter(prepared.items()))  # warm up (threads, allocator), untimed
    predict_probabilities(
        first, first_id, Predictor.of([network], plans, config, WindowOptions(mirror=False, tile="patch"))
    )
    seconds = _timed(prepared, [network], plans, config, args, out)
    rows = [
        _row(prepared, config, variant, seconds[variant], evaluate_folder(out / variant, labels_dir))
        for variant in args.variants
    ]
    _print_table(rows, prepared, config, args)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-w", "--workspace", required=True, help="a workspace with fold 0 trained")
    parser.add_argument(
        "--make",
        type=int,
        nargs=3,
        default=None,
        metavar=("Z", "Y", "X"),
        help="make the workspace first (demo data of this nominal shape) if fold 0 is not trained",
    )
    parser.add_argument("--epochs", type=int, default=30, help="with --make")
    parser.add_argument("--iterations", type=int, default=20, help="with --make: iterations per epoch")
    parser.add_argument(
        "-i", "--images", default=None, help="held-out images ({case}_0000.nii.gz); default: the --make workspace's"
    )
    parser.add_argument("-l", "--labels", default=None, help="their reference label maps")
    parser.add_argument("-o", "--output", required=True, help="folder for the predictions and results.json")
    parser.add_argument("-c", "--config", default="3d_fullres")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tta", default="4", help="as autoseg predict --tta (default 4: the CPU default)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    return parser


def _timed(prepared: dict, networks: list, plans: Plans, config, args: argparse.Namespace, out: Path) -> dict:
    """Seconds per case of each variant per repeat (variants alternate within a repeat); the first repeat's label
    maps are written to ``out/<variant>/``."""
    seconds: dict[str, list[float]] = {v: [] for v in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants:
            folder = out / variant
            folder.mkdir(parents=True, exist_ok=True)
            tile = "planned" if variant in ("planned-half-tile", "planned-padded") else variant
            predictor = Predictor.of(networks, plans, config, WindowOptions(tta=args.tta, tile=tile))
            t_variant = 0.0
            for case_id, (data, props) in prepared.items():
                t0 = time.perf_counter()
                if variant in ("planned-half-tile", "planned-padded"):
                    probabilities = _other_window(data, predictor, variant)
                else:
                    probabilities = predict_probabilities(data, case_id, predictor)
                t_variant += time.perf_counter() - t0
                if repeat == 0:
                    labels = export_prediction(probabilities, props, plans.label_scheme)
                    write_image(folder / f"{case_id}{plans.file_ending}", labels, props.geometry)
            seconds[variant].append(t_variant / len(prepared))
            print(f"repeat {repeat} {variant}: {t_variant / len(prepared):.2f} s/case", flush=True)
    return seconds


def _row(prepared: dict, config, variant: str, seconds: list[float], summary) -> dict:
    layouts = [tile_layout(d.shape[1:], *_tile(config, variant, d.shape[1:])) for d, _ in prepared.values()]
    return {
        "variant": variant,
        "tiles": sorted({"x".join(map(str, layout.patch_size)) for layout in layouts}),
        "tiles_per_case": statistics.mean(layout.num_tiles for layout in layouts),
        "voxels_per_case": statistics.mean(layout.num_tiles * math.prod(layout.patch_size) for layout in layouts),
        "seconds_per_case": seconds,
        "dice": {k: m.dice for k, m in summary.mean.items()},
        "mean_foreground_dice": summary.mean_foreground_dice,
    }


def _print_table(rows: list[dict], prepared: dict, config, args: argparse.Namespace) -> None:
    shapes = sorted({"x".join(map(str, d.shape[1:])) for d, _ in prepared.values()})
    print(
        f"\n{len(prepared)} cases ({', '.join(shapes)}), patch {config.patch_size}, tta {args.tta}, "
        f"{args.threads} thread(s)"
    )
    print(
        "| variant | tiles | tiles/case | voxels/case | s/case (repeats) | " + " | ".join(rows[0]["dice"]) + " | mean |"
    )
    for r in rows:
        secs = ", ".join(f"{s:.2f}" for s in r["seconds_per_case"])
        dice = " | ".join(f"{d:.4f}" for d in r["dice"].values())
        print(
            f"| {r['variant']} | {', '.join(r['tiles'])} | {r['tiles_per_case']:.1f} | "
            f"{r['voxels_per_case'] / 1e6:.2f} M | {secs} | {dice} | {r['mean_foreground_dice']:.4f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
