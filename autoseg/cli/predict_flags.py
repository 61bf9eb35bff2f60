"""The flags of ``autoseg predict`` and ``export-model``."""

from __future__ import annotations

import argparse

from autoseg.cli.flag_values import add_workspace, fold_name, parse_part, tile_batch_value, tta_value, workers_value
from autoseg.core.extras import RUNTIMES
from autoseg.dataset.dicom_write import OUTPUT_FORMATS


def add_predict_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="segment new scans with the trained folds")
    p.add_argument(
        "-i",
        "--input",
        required=True,
        help="a folder of {case}_0000.ext files (nnU-Net's layout), one image file, or a folder holding "
        "one DICOM series (its output is named after the folder, .nii.gz, in the series' geometry, or DICOM: "
        "--output-format)",
    )
    p.add_argument("-o", "--output", required=True, help="output folder")
    _add_model_flags(p)
    _add_window_flags(p)
    _add_run_flags(p)
    _add_output_flags(p)
    _add_review_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Which model predicts: a workspace or a model archive, its configuration, folds and checkpoint."""
    model = p.add_mutually_exclusive_group()  # default None: `-m A.zip -w .` is refused too
    model.add_argument("-w", "--workspace", default=None, help="workspace folder (default: current directory)")
    model.add_argument(
        "-m",
        "--model",
        default=None,
        metavar="ARCHIVE.zip",
        help="a model archive from `autoseg export-model`, instead of a workspace: checked, unpacked "
        "to a temporary folder removed afterwards; its configuration, folds and checkpoint",
    )
    p.add_argument("-c", "--config", default=None)
    p.add_argument("-f", "--folds", nargs="+", default=None, help="folds to ensemble (default: all trained)")
    p.add_argument(
        "--checkpoint",
        default=None,
        choices=["final", "best", "latest"],
        help="which checkpoint of each fold (default: final; not with -m: the archive holds one)",
    )


def _add_window_flags(p: argparse.ArgumentParser) -> None:
    """How the sliding window runs (``autoseg.predict.window.WindowOptions``)."""
    p.add_argument(
        "--tta",
        type=tta_value,
        default=None,
        metavar="all|none|N",
        help="mirror test-time augmentation: every mirror variant (all: 8 in 3D, 4 in 2D), none, or the "
        "first N (identity, each axis, then pairs). Default: all on CUDA, 4 on CPU (what more variants cost "
        "and gain: docs/prediction.md)",
    )
    p.add_argument("--no-mirror", action="store_true", help="the same as --tta none")
    p.add_argument(
        "--tile-batch-size",
        type=tile_batch_value,
        default=None,
        metavar="auto|N",
        help="(tile, mirror variant) inputs per forward pass: auto (the default) takes the largest the "
        "memory model predicts to fit, at most 4 on CPU; N caps it at N",
    )
    p.add_argument(
        "--accumulator",
        default=None,
        metavar="float16|float32",
        help="the dtype of the sliding window's running mean of logits (its largest buffer: classes x "
        "a tile's depth x the image's plane): float16 (the default: half the bytes; a label differs from "
        "float32's only where two classes nearly tie, docs/prediction.md) or float32",
    )
    p.add_argument(
        "--runtime",
        choices=["auto", *RUNTIMES],
        default="torch",
        help="what runs the folds' tiles: torch (the default), auto (on the CPU, the fastest of the installed "
        "runtimes and precisions, timed once per machine and model; on CUDA torch), or on the CPU each fold's ONNX "
        "graph (the model archive's, else made from the checkpoint once and kept in the cache folder) run by "
        'onnxruntime (`pip install "autoseg[onnx]"`) or openvino (`pip install "autoseg[openvino]"`); the sliding '
        "window, TTA and export are the same",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default=None,
        help="the precision the folds compute in (default: the plan's on CUDA, fp32 on the CPU): auto (on the CPU "
        "fp32, or bf16 where the CPU has native bf16, the model's stored agreement check passed and it is faster), "
        "fp32, bf16 (on CUDA, or a CPU with native bf16: AVX-512 BF16 or AMX), fp16 (CUDA)",
    )
    p.add_argument(
        "--tile",
        choices=["planned", "patch"],
        default="planned",
        help="the sliding window's tile: planned (the default: plans.json's inference_patch_size, up to "
        "the median image and twice the training patch per axis where memory allows; consecutive "
        "tiles overlap by half a training patch) or patch (the training patch, at half-patch steps)",
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How the cases are read and predicted (``autoseg.predict.predictor.PredictOptions``), and where."""
    p.add_argument(
        "--preprocess-workers",
        type=workers_value,
        default=None,
        metavar="auto|N",
        help="cases read and preprocessed ahead on background threads while one is predicted (nnU-Net's "
        "-npp); auto (the default): as many as the host RAM holds beside the prediction, at most 4 "
        "and the CPU count; 0: each case is read when its turn comes",
    )
    p.add_argument(
        "--export-workers",
        type=workers_value,
        default=None,
        metavar="auto|N",
        help="cases exported (resampled back, written) behind on background threads (nnU-Net's -nps); "
        "auto (the default) sized like --preprocess-workers; 0: each case is written before the next",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the pipeline (workers, each stage's bytes, predicted host peak, and the measured one at "
        "the end) and each case's inference plan: tile batch, accumulator device and dtype, peak",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument(
        "--series",
        default=None,
        metavar="UID",
        help="the DICOM series to predict (its SeriesInstanceUID) when the -i folder holds several; the "
        "output is then named {UID}.nii.gz",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What is written, which cases are left out (already written, another part's) and when a run stops."""
    p.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="nifti",
        help="the label map as nifti (the default: the input's own format, .nii.gz for a DICOM series), or, for a "
        "DICOM series, as a DICOM Segmentation ({case}.dcm) or an RT Structure Set ({case}_rtstruct.dcm) "
        "referencing the series, one segment per dataset.json label (needs the dicom extra: "
        'pip install "autoseg[dicom]")',
    )
    p.add_argument(
        "--save-probabilities",
        action="store_true",
        help="also write {case}.npz beside each label map: 'probabilities' float16 (K, Z, Y, X) in the "
        "input's own grid (softmax of each class, or sigmoid of each region), 'names' (the K "
        "outputs) and 'activation', what averaging models or folds needs (np.load reads it). "
        "float16: half the size of float32, precise to 1e-3",
    )
    p.add_argument(
        "--continue",
        dest="skip_existing",
        action="store_true",
        help="skip cases whose outputs already exist (with --save-probabilities: both files). Every "
        "output is written under a temporary name and renamed when complete, so an existing one is "
        "complete: rerun a killed or failed run with --continue to finish it",
    )
    p.add_argument(
        "--part",
        type=parse_part,
        default=None,
        metavar="I/N",
        help="predict only part I of N near-equal parts of the inputs (consecutive case ids in sorted order): N "
        "processes or machines, one part each (e.g. a SLURM array), write together what one run writes, into the "
        "same -o; with --continue a part resumes where it stopped",
    )
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first case with bad input (default: skip it, predict the others, list the "
        "failed cases at the end and exit with status 2)",
    )


def _add_review_flags(p: argparse.ArgumentParser) -> None:
    """What predict writes beside each label map for a person to check (``autoseg.predict.case_review``,
    ``autoseg.predict.uncertainty``)."""
    from autoseg.predict.uncertainty import REVIEW_THRESHOLD

    p.add_argument(
        "--review-threshold",
        type=float,
        default=REVIEW_THRESHOLD,
        metavar="SCORE",
        help="with two or more folds (or mirror variants), log the cases whose uncertainty score (uncertainty.csv: "
        "the mean normalized entropy of the averaged probabilities in the predicted foreground, 0 to 1) is above "
        f"SCORE to review first, worst first (default {REVIEW_THRESHOLD})",
    )
    p.add_argument(
        "--no-uncertainty",
        action="store_true",
        help="do not compare the folds (or mirror variants): no uncertainty.csv, no cases listed to review first",
    )
    p.add_argument(
        "--save-uncertainty",
        action="store_true",
        help="also write {case}_uncertainty.nii.gz: each voxel's entropy of the averaged probabilities, uint8 "
        "(255: the largest), in the input's geometry; needs two or more folds or mirror variants",
    )
    p.add_argument(
        "--preview",
        action="store_true",
        help="also write preview/{case}.png: axial, coronal and sagittal slices through the largest predicted "
        "structure, the label map filled over the first image channel (docs/prediction.md, Previews)",
    )
    p.add_argument(
        "--statistics",
        action="store_true",
        help="also write statistics/{case}.json, then statistics.csv and statistics.json of every case in the "
        "output folder: per structure voxels, volume in mL, connected components and each channel's mean, std, "
        "5th and 95th percentile inside it (docs/prediction.md, Statistics)",
    )


def add_export_model_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-model",
        help="write a trained model (plan, fingerprint, fold checkpoints, manifest) "
        "to one zip for `autoseg predict -m` on another machine",
    )
    p.add_argument("output", metavar="OUT.zip", help="archive to write (written under a temporary name, then renamed)")
    add_workspace(p)
    p.add_argument(
        "-c",
        "--config",
        default=None,
        help="configuration (default: the workspace's inference.json, autoseg find-best's choice with its "
        "postprocessing; without one 3d_fullres if planned, else the first)",
    )
    p.add_argument(
        "-f",
        "--folds",
        nargs="+",
        type=fold_name,
        default=None,
        help="folds to include, e.g. 0 1 2 or all (default: inference.json's, else every fold trained "
        "with the checkpoint)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        choices=["final", "best"],
        help="which checkpoint of each fold (default: inference.json's, else final)",
    )


def add_import_nnunet_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-nnunet",
        help="write an nnU-Net v2 trained model (PlainConvUNet or ResidualEncoderUNet; 2d, 3d_fullres, 3d_lowres or "
        "the cascade) as an autoseg model archive for `autoseg predict -m`",
    )
    p.add_argument(
        "model_folder",
        metavar="MODEL_FOLDER",
        help="nnU-Net's <Trainer>__<Plans>__<configuration> folder: plans.json, dataset.json, "
        "dataset_fingerprint.json, fold_N/checkpoint_final.pth",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUT.zip", help="archive to write")
    p.add_argument(
        "-f",
        "--folds",
        nargs="+",
        type=fold_name,
        default=None,
        help="folds to import, e.g. 0 1 2 or all (default: every fold with a checkpoint_final.pth)",
    )
    p.add_argument(
        "--previous-stage",
        metavar="FOLDER",
        default=None,
        help="for a 3d_cascade_fullres model: its 3d_lowres model folder (same folds), packed beside it; predict "
        "runs it first and gives its label map to the cascade",
    )
