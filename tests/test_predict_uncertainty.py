"""`autoseg predict`'s per-case uncertainty through the real CLI: two folds write uncertainty.csv (one row per case,
assembled from the parts' rows), one fold writes none and says so, --save-uncertainty's map has the input's geometry
and is refused with one fold."""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import pytest
import SimpleITK as sitk
import torch
from cli_checks import assert_refused, run_cli

from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file

FOLDS = Path("results") / "3d_fullres"


@pytest.fixture(scope="module")
def two_folds(trained: Path, tmp_path_factory) -> Path:
    """The trained workspace with a second fold: fold 0's weights, perturbed (so the folds disagree somewhere)."""
    root = Path(shutil.copytree(trained, tmp_path_factory.mktemp("two_folds") / "ws"))
    shutil.copytree(root / FOLDS / "fold_0", root / FOLDS / "fold_1")
    path = root / FOLDS / "fold_1" / "checkpoint_final.pt"
    state = read_checkpoint_file(path, "")
    generator = torch.Generator().manual_seed(0)
    for value in state["network"].values():
        if value.is_floating_point():
            value += 0.5 * value.std().nan_to_num() * torch.randn(value.shape, generator=generator)
    write_checkpoint_file(path, state)
    return root


def _predict(capsys, ws: Path, inputs: Path, out: Path, *flags: str):
    return run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", ws, "--no-mirror", *flags)


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "uncertainty.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # the trained fixture: ~5 s once per session
def test_two_folds_write_one_uncertainty_row_per_case(capsys, two_folds: Path, inputs: Path, tmp_path: Path) -> None:
    result = _predict(capsys, two_folds, inputs, tmp_path / "out")
    assert result.status == 0, result.err
    rows = _rows(tmp_path / "out")
    assert [r["case"] for r in rows] == ["demo_005", "demo_006"]
    for row in rows:
        assert row["of"] == "folds" and row["members"] == "2"
        assert 0.0 <= float(row["score"]) <= 1.0
        dice = [float(v) for k, v in row.items() if k.startswith("dice_") and v]
        assert float(row["disagreement"]) == pytest.approx(1 - sum(dice) / len(dice) if dice else 0, abs=1e-5)
        assert row["score"] == (row["entropy"] or row["disagreement"])
    assert sorted(p.name for p in (tmp_path / "out" / "uncertainty").iterdir()) == ["demo_005.json", "demo_006.json"]


@pytest.mark.slow
def test_parts_assemble_the_rows_one_run_writes(capsys, two_folds: Path, inputs: Path, tmp_path: Path) -> None:
    assert _predict(capsys, two_folds, inputs, tmp_path / "one").status == 0
    for part in ("1/2", "2/2"):
        assert _predict(capsys, two_folds, inputs, tmp_path / "parts", "--part", part).status == 0
    assert (tmp_path / "parts" / "uncertainty.csv").read_text() == (tmp_path / "one" / "uncertainty.csv").read_text()


@pytest.mark.slow
def test_cases_above_the_threshold_are_listed_to_review_first(
    capsys, caplog, two_folds: Path, inputs: Path, tmp_path: Path
) -> None:
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        assert _predict(capsys, two_folds, inputs, tmp_path / "out", "--review-threshold", "-1").status == 0
    listed = [r for r in caplog.records if "review first" in r.getMessage()]
    assert len(listed) == 1
    rows = sorted(_rows(tmp_path / "out"), key=lambda r: -float(r["score"]))
    message = listed[0].getMessage()
    assert message.index(rows[0]["case"]) < message.index(rows[1]["case"])  # worst first


@pytest.mark.slow
def test_save_uncertainty_writes_a_map_in_the_input_geometry(
    capsys, two_folds: Path, inputs: Path, tmp_path: Path
) -> None:
    assert _predict(capsys, two_folds, inputs, tmp_path / "out", "--save-uncertainty").status == 0
    for image in sorted(inputs.glob("*_0000.nii.gz")):
        case = image.name.removesuffix("_0000.nii.gz")
        saved, source = sitk.ReadImage(str(tmp_path / "out" / f"{case}_uncertainty.nii.gz")), sitk.ReadImage(str(image))
        assert saved.GetSize() == source.GetSize()
        assert saved.GetSpacing() == pytest.approx(source.GetSpacing())
        assert saved.GetOrigin() == pytest.approx(source.GetOrigin())
        assert saved.GetDirection() == pytest.approx(source.GetDirection())
        assert saved.GetPixelID() == sitk.sitkUInt8


@pytest.mark.slow
def test_one_fold_writes_no_uncertainty_and_says_so(
    capsys, caplog, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    with caplog.at_level(logging.INFO, logger="autoseg"):
        assert _predict(capsys, trained, inputs, tmp_path / "out").status == 0
    assert not (tmp_path / "out" / "uncertainty.csv").exists() and not (tmp_path / "out" / "uncertainty").exists()
    said = [r for r in caplog.records if "nothing to compare" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


@pytest.mark.slow
def test_save_uncertainty_with_one_fold_is_refused_naming_more_folds(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    result = _predict(capsys, trained, inputs, tmp_path / "out", "--save-uncertainty")
    assert_refused(result, 2, "--save-uncertainty", "two or more folds")
    assert not (tmp_path / "out" / "demo_005.nii.gz").exists()


@pytest.mark.slow
def test_no_uncertainty_compares_nothing_even_with_two_folds(capsys, two_folds: Path, inputs: Path, tmp_path: Path):
    assert _predict(capsys, two_folds, inputs, tmp_path / "out", "--no-uncertainty").status == 0
    assert (tmp_path / "out" / "demo_005.nii.gz").is_file()
    assert not (tmp_path / "out" / "uncertainty.csv").exists() and not (tmp_path / "out" / "uncertainty").exists()
    refused = _predict(capsys, two_folds, inputs, tmp_path / "both", "--no-uncertainty", "--save-uncertainty")
    assert_refused(refused, 2, "--save-uncertainty does not go with --no-uncertainty")
