"""One predictor run of benchmarks/predict.py: autoseg's or nnU-Net v2's, in a fresh process under
benchmarks/_forward_timer.py, with its wall time, process-tree memory, forward seconds and (autoseg) what its
``--verbose`` log says: the pipeline, the inference plans, the predicted host peak and ``auto``'s choice."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from _common import run_measured
from _predict_models import CONFIG
from _predict_rows import parse_choice

from autoseg.core.units import MiB

HERE = Path(__file__).resolve().parent


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
    return {**r, **parse_autoseg_log(r["log"].read_text()), "out": out}


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
    return {**run_predictor("nnunet", args, python, env, work, name), "out": out}


_MIB = r"([0-9.]+) MiB"


def parse_autoseg_log(text: str) -> dict:
    """From ``autoseg predict --verbose``: the pipeline line, the inference plans, and the predicted peaks:
    the pipeline's whole-process "predicted host peak" and its own "measured" one, else the largest plan's."""
    found: dict = {"plans": re.findall(r"case \S+, input .*", text)}
    pipeline = re.search(r"pipeline: (.*)", text)
    found["pipeline"] = pipeline.group(1) if pipeline else None
    found["choice"] = parse_choice(text)
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
