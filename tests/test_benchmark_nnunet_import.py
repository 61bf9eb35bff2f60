"""benchmarks/nnunet_import.py's comparison of autoseg's and nnU-Net's label maps (benchmarks/_nnunet_compare.py):
agreement on the union of the foregrounds, Dice between the outputs and against the truth, and the verdicts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
LABELS = {"liver": 1, "spleen": 2, "adrenal": 3}


@pytest.fixture
def compare(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/_nnunet_compare.py, importable as the scripts import it (from their own folder)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _nnunet_compare

    yield _nnunet_compare
    sys.modules.pop("_nnunet_compare", None)


def _write(path: Path, labels: np.ndarray) -> Path:
    from autoseg.dataset.imageio import Geometry, write_image

    geometry = Geometry(3, labels.shape[::-1], (0.8, 0.8, 2.5), (0.0, 0.0, 0.0), (1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0))
    write_image(path, labels.astype(np.uint8), geometry)
    return path


def test_union_agreement_counts_only_voxels_either_output_calls_foreground(compare) -> None:
    a = np.array([[[0, 0, 1, 1, 2, 0]]])
    b = np.array([[[0, 0, 1, 2, 0, 0]]])
    # union: positions 2, 3, 4; the same label at 2 only; the agreeing background (0, 1, 5) does not count
    assert compare.union_agreement(a, b) == (1, 3)
    assert compare.union_agreement(np.zeros((2, 2, 2)), np.zeros((2, 2, 2))) == (0, 0)
    with pytest.raises(ValueError, match=r"shapes \(1, 1, 6\) and \(1, 1, 5\)"):
        compare.union_agreement(a, b[..., :5])


def test_compare_case_gives_pair_and_truth_dice_per_class(compare, tmp_path: Path) -> None:
    truth = np.zeros((2, 4, 4), np.uint8)
    truth[:, :2] = 1  # 16 liver voxels
    truth[:, 3, :2] = 2  # 4 spleen voxels
    ours = truth.copy()
    ours[0, 0, 0] = 0  # one liver voxel lost
    theirs = truth.copy()
    theirs[:, 3, :2] = 0  # no spleen
    q = compare.compare_case(
        _write(tmp_path / "ours.nii.gz", ours),
        _write(tmp_path / "theirs.nii.gz", theirs),
        _write(tmp_path / "truth.nii.gz", truth),
        LABELS,
    )
    assert (q["agree"], q["union"]) == (15, 20)  # 15 liver voxels agree; 1 liver and 4 spleen voxels do not
    assert q["pair_dice"]["liver"] == pytest.approx(2 * 15 / (15 + 16))
    assert q["pair_dice"]["spleen"] == 0.0
    assert math.isnan(q["pair_dice"]["adrenal"])  # absent from both
    assert q["autoseg_dice"]["spleen"] == 1.0 and q["nnunet_dice"]["liver"] == 1.0
    assert compare.lowest(q["pair_dice"]) == ("spleen", 0.0)
    assert compare.lowest({"adrenal": math.nan}) is None


def test_quality_row_and_ratios_say_pass_or_fail_against_the_issue_targets(compare) -> None:
    good = {"liver": 0.995, "spleen": 1.0, "adrenal": math.nan}
    q = {"agree": 995, "union": 1000, "pair_dice": good, "autoseg_dice": good, "nnunet_dice": good}
    row = compare.quality_row("case_1", "torch fp32", q, "liver")
    assert "99.50% of 1000 pass" in row and "0.9950 (liver) pass" in row
    assert "| 0.995 / 0.998 | 0.995 / 0.998 |" in row  # largest / mean over the classes found
    q = {**q, "agree": 989, "pair_dice": {**good, "spleen": 0.98}}
    row = compare.quality_row("case_1", "torch fp32", q, "liver")
    assert "98.90% of 1000 FAIL" in row and "0.9800 (spleen) FAIL" in row
    assert compare.ratio_text(2.0, 10.0, 0.3) == "0.20 (<= 0.3) pass"
    assert compare.ratio_text(8.0, 10.0, 0.7) == "0.80 (<= 0.7) FAIL"
    assert compare.ratio_text(8.0, 10.0, None) == "0.80"
