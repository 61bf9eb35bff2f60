"""`autoseg predict --preview --statistics`: a preview picture and a statistics row per case beside its label map,
the cohort's statistics.csv and .json at the end; --part runs write what one run writes; --continue redoes a case
whose review files are missing."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from cli_checks import run_cli, snapshot
from png_reader import read_png

from autoseg.dataset.imageio import read_image


def _predict(capsys, trained: Path, inputs: Path, out: Path, *flags: str):
    return run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", trained, "--no-mirror", *flags)


@pytest.mark.slow  # the trained fixture: ~5 s once per session, then ~1 s a case
def test_preview_and_statistics_of_parts_are_those_of_one_run(capsys, trained: Path, tiny_dataset: Path, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i, image in enumerate(sorted((tiny_dataset / "imagesTs").glob("*_0000.nii.gz")) * 2):
        shutil.copy(image, inputs / f"scan_{i:03d}_0000.nii.gz")  # 4 cases
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _predict(capsys, trained, inputs, whole, "--preview", "--statistics").status == 0
    for i in (1, 2, 3):
        assert _predict(capsys, trained, inputs, parts, "--part", f"{i}/3", "--preview", "--statistics").status == 0
    assert snapshot(parts) == snapshot(whole)
    assert sorted(p for p in snapshot(whole) if not p.endswith(".nii.gz")) == [
        *(f"preview/scan_{i:03d}.png" for i in range(4)),
        "statistics.csv",
        "statistics.json",
        *(f"statistics/scan_{i:03d}.json" for i in range(4)),
    ]
    rows = list(csv.DictReader((whole / "statistics.csv").open()))
    labels, _ = read_image(whole / "scan_000.nii.gz", dtype=None)
    first = [r for r in rows if r["case"] == "scan_000"]
    assert [int(r["voxels"]) for r in first] == [int((labels == v).sum()) for v in range(1, len(first) + 1)]
    assert read_png(whole / "preview" / "scan_000.png").shape[2] == 3


@pytest.mark.slow
def test_continue_redoes_a_case_whose_preview_is_missing(capsys, trained: Path, inputs: Path, tmp_path: Path):
    out = tmp_path / "out"
    assert _predict(capsys, trained, inputs, out, "--preview").status == 0
    before = snapshot(out)
    (out / "preview" / "demo_005.png").unlink()
    (out / "demo_006.nii.gz").write_bytes(b"kept")  # not predicted again: all its outputs are there
    assert _predict(capsys, trained, inputs, out, "--preview", "--continue").status == 0
    after = snapshot(out)
    assert after["preview/demo_005.png"] == before["preview/demo_005.png"]
    assert (out / "demo_006.nii.gz").read_bytes() == b"kept"
