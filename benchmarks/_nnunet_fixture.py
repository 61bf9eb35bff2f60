"""Regenerate tests/fixtures/nnunet_model: tiny nnU-Net v2 trained models and nnU-Net's own predictions of two
small cases, the fixture `autoseg import-nnunet`'s tests read without nnunetv2.

    python benchmarks/_nnunet_fixture.py --nnunet-python /tmp/nnunet-venv/bin/python [--iterations 40] \
        [--models plain resenc cascade]

Model sets (benchmarks/_nnunet_fixture_run.py): ``plain`` (PlainConvUNet 2d and 3d_fullres, folders ``2d`` and
``3d_fullres``), ``resenc`` (ResidualEncoderUNet 3d_fullres, ``resenc_3d_fullres``), ``cascade`` (3d_lowres and
3d_cascade_fullres, fold ``all``, folders ``3d_lowres`` and ``3d_cascade_fullres``); each set replaces only its
own folders.

The dataset is autoseg's demo (benchmarks' generators, ``autoseg.demo.data``: anisotropic, jittered spacings, so
resampling and nnU-Net's separate z axis are exercised) with two channels named "CT" and "MRI" (the same image:
nnU-Net plans CTNormalization for the first and ZScoreNormalization with its nonzero mask for the second).
nnU-Net plans, preprocesses, trains fold 0 of each configuration for one short epoch and predicts the test cases
(benchmarks/_nnunet_fixture_run.py, in its venv). Kept: each model folder's plans.json, dataset.json,
dataset_fingerprint.json and fold_0/checkpoint_final.pth as nnU-Net wrote them, the test images, nnU-Net's
segmentations and its probabilities as float16 (``<case>.npz``, key ``probabilities``, (K, Z, Y, X)), and the
network's logits on a seeded input (``network_check.npz``: ``input``, ``logits``) and nnU-Net's preprocessing of
each test case (``<case>_preprocessed.npz``, key ``data``, float32 (C, Z, Y, X)).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import nnunet_env

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "tests" / "fixtures" / "nnunet_model"
DATASET_ID = 978
MODEL_FILES = ("plans.json", "dataset.json", "dataset_fingerprint.json")
KEPT_AS = {"resenc": {"3d_fullres": "resenc_3d_fullres"}}  # a set's configuration -> its fixture folder


def make_dataset(raw: Path) -> Path:
    """Five training and two test cases of the demo with the image as both channels."""
    from autoseg.demo.data import make_demo_dataset

    dataset = make_demo_dataset(raw / f"Dataset{DATASET_ID}_Tiny", num_train=5, num_test=2, shape_zyx=(16, 32, 32))
    for image in sorted(dataset.glob("images*/*_0000.nii.gz")):
        shutil.copyfile(image, image.with_name(image.name.replace("_0000", "_0001")))
    meta = json.loads((dataset / "dataset.json").read_text())
    meta["channel_names"] = {"0": "CT", "1": "MRI"}
    (dataset / "dataset.json").write_text(json.dumps(meta, indent=2))
    return dataset


def keep(model_folder: Path, predictions: Path, out: Path) -> None:
    """The model's files and float16 probabilities into ``out`` (the fixture's folder of this configuration)."""
    shutil.rmtree(out, ignore_errors=True)
    names = [
        *MODEL_FILES,
        *(str(p.relative_to(model_folder)) for p in model_folder.glob("fold_*/checkpoint_final.pth")),
    ]
    for name in names:
        (out / model_folder.name / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_folder / name, out / model_folder.name / name)
    for seg in sorted(predictions.glob("*.nii.gz")):
        case = seg.name.removesuffix(".nii.gz")
        (out / "predictions").mkdir(exist_ok=True)
        shutil.copyfile(seg, out / "predictions" / seg.name)
        with np.load(predictions / f"{case}.npz") as npz:
            probabilities = npz["probabilities"].astype(np.float16)
        np.savez_compressed(out / "predictions" / f"{case}.npz", probabilities=probabilities)
    shutil.copyfile(predictions / "network_check.npz", out / "network_check.npz")
    for preprocessed in sorted(predictions.glob("*_preprocessed.npy")):  # float32 (C, Z, Y, X)
        np.savez_compressed(out / "predictions" / preprocessed.with_suffix(".npz").name, data=np.load(preprocessed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnunet-python", required=True, help="a Python with nnunetv2 installed")
    parser.add_argument("--iterations", type=int, default=40, help="training iterations of the one epoch")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--models", nargs="+", default=["plain"], choices=["plain", "resenc", "cascade"])
    args = parser.parse_args()
    for models in args.models:
        make_set(args, models)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out}: {total / 1024:.0f} KiB")


def make_set(args: argparse.Namespace, models: str) -> None:
    """Train and predict the model set ``models`` with nnU-Net and keep it under ``args.out``."""
    with tempfile.TemporaryDirectory(prefix="nnunet-fixture-") as tmp:
        work = Path(tmp)
        env = {**os.environ, **nnunet_env(work), "nnUNet_compile": "false", "nnUNet_n_proc_DA": "1"}
        env["nnUNet_def_n_proc"] = "1"  # the lowres trainer's final validation exports in one process
        env["PYTHONPATH"] = str(HERE)
        for folder in nnunet_env(work).values():
            Path(folder).mkdir(parents=True)
        dataset = make_dataset(Path(env["nnUNet_raw"]))
        cmd = [args.nnunet_python, str(HERE / "_nnunet_fixture_run.py"), str(DATASET_ID), str(args.iterations)]
        run = subprocess.run(
            [*cmd, str(dataset / "imagesTs"), str(work / "predictions"), models],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            sys.exit(f"nnU-Net failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        for line in run.stdout.splitlines():
            if line.startswith("MODEL_FOLDER "):
                _, config, folder = line.split(" ", 2)
                kept = KEPT_AS.get(models, {}).get(config, config)
                keep(Path(folder), work / "predictions" / config, args.out / kept)
        for name in ("imagesTs", "labelsTs"):
            shutil.rmtree(args.out / name, ignore_errors=True)
            shutil.copytree(dataset / name, args.out / name)


if __name__ == "__main__":
    main()
