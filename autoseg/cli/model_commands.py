"""The commands that run a trained model: ``autoseg predict`` (``predict_cases``: the flags as ``WindowOptions``,
``PredictOptions`` and one ``PredictRequest``), ``export-model`` and ``import-nnunet`` (a model archive written from a
workspace or from an nnU-Net v2 model folder). Each returns its exit status; errors reach ``main.report_error``."""

from __future__ import annotations

import argparse
from pathlib import Path

from autoseg.cli.flag_values import resolve_device
from autoseg.core.units import MiB


def predict_cases(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.model.tile_buffers import PREDICTION_ACCUMULATOR
    from autoseg.predict.command import PredictRequest, predict_command
    from autoseg.predict.predictor import PredictOptions
    from autoseg.predict.uncertainty import UncertaintyOptions
    from autoseg.predict.window import WindowOptions

    window = WindowOptions(
        device=resolve_device(args.device),
        tta=args.tta,
        mirror=not args.no_mirror,
        tile=args.tile,
        tile_batch_size=args.tile_batch_size,
        accumulator=PREDICTION_ACCUMULATOR if args.accumulator is None else args.accumulator,
        runtime=args.runtime,
        precision=args.precision,
        verbose=args.verbose,
    )
    options = PredictOptions(
        save_probabilities=args.save_probabilities,
        skip_existing=args.skip_existing,
        fail_fast=args.fail_fast,
        series=args.series,
        part=args.part,
        preprocess_workers=args.preprocess_workers,
        export_workers=args.export_workers,
        progress=progress,
        preview=args.preview,
        statistics=args.statistics,
        output_format=args.output_format,
        uncertainty=UncertaintyOptions(
            enabled=not args.no_uncertainty, threshold=args.review_threshold, save_map=args.save_uncertainty
        ),
    )
    request = PredictRequest(
        args.input,
        args.output,
        workspace=args.workspace or ".",
        model=args.model,
        config_name=args.config,
        folds=None if args.folds is None else tuple(args.folds),
        checkpoint=args.checkpoint,
        window=window,
        options=options,
    )
    written = predict_command(request)  # -w or -m: the same prediction
    print(f"wrote {len(written)} segmentation(s) to {Path(args.output).resolve()}")
    return 0


def export_trained_model(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.predict.archive import export_model
    from autoseg.train.precision_check import ExportChecks

    ws = Workspace.at(args.workspace)
    checks = ExportChecks(run=not args.no_precision_check)
    manifest = export_model(
        ws, args.output, config_name=args.config, folds=args.folds, checkpoint=args.checkpoint, precision_checks=checks
    )
    out = Path(args.output).resolve()
    print(
        f"wrote {out} ({out.stat().st_size / MiB:.1f} MiB): configuration {' + '.join(manifest.configurations)}, "
        f"fold(s) {' '.join(map(str, manifest.folds))}, checkpoint_{manifest.checkpoint}.pt, postprocessing: "
        f"{manifest.postprocessing}{' (inference.json)' if manifest.follows_choice else ''}; predict with "
        f"`autoseg predict -m {out} -i INPUT -o OUTPUT`"
    )
    if manifest.graphs:
        print(f"ONNX graphs: {len(manifest.graphs)}, each checked against torch on tiles of a training case")
    else:
        print('no ONNX graphs: the onnx extra is not installed (`pip install "autoseg[onnx]"` adds them)')
    for outcome in checks.outcomes:
        print("\n".join(outcome.describe()))
    return 0


def import_nnunet_model(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.nnunet.importer import import_nnunet

    manifest = import_nnunet(args.model_folder, args.output, folds=args.folds, previous_stage=args.previous_stage)
    out = Path(args.output).resolve()
    print(
        f"wrote {out} ({out.stat().st_size / MiB:.1f} MiB): nnU-Net's {' + '.join(manifest.configurations)}, "
        f"fold(s) {' '.join(map(str, manifest.folds))}; predict with `autoseg predict -m {out} -i INPUT -o OUTPUT`"
    )
    return 0
