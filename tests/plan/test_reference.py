from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from autoseg.core.artifacts import to_dict
from autoseg.core.units import GiB
from autoseg.plan.plans import Plans
from autoseg.plan.reference import (
    PLANS_ROOT,
    REFERENCE_BUDGETS_GIB,
    ReferenceDataset,
    derive,
    derived_path,
    load_references,
    main,
    reference_budget,
    to_fingerprint,
)


@pytest.fixture(scope="module")
def references() -> dict[str, ReferenceDataset]:
    return load_references()


def test_reference_fingerprints_cite_a_source_for_every_figure(references: dict[str, ReferenceDataset]) -> None:
    assert {"Task01_BrainTumour", "Task03_Liver", "Task04_Hippocampus", "Task05_Prostate", "Task07_Pancreas"} <= set(
        references
    )
    for name, ref in references.items():
        assert ref.dataset_name == name
        cited = " ".join(ref.source)
        for figure in (
            "median_shape_zyx",
            "median_spacing_mm",
            "num_training_cases",
            "labels",
            "channel_names",
            "foreground_intensity",
        ):
            assert figure in cited, (name, figure)
        assert len(ref.foreground_intensity) == len(ref.channel_names)
        assert sorted(ref.labels.values()) == list(range(len(ref.labels)))


def test_published_figures(references: dict[str, ReferenceDataset]) -> None:
    liver = references["Task03_Liver"]
    assert liver.median_shape_zyx == (482, 512, 512) and liver.num_training_cases == 131
    assert references["Task04_Hippocampus"].median_shape_zyx == (36, 50, 35)
    assert references["Task01_BrainTumour"].channel_names == ("FLAIR", "T1w", "t1gd", "T2w")


def test_to_fingerprint_gives_identical_median_cases(references: dict[str, ReferenceDataset]) -> None:
    ref = references["Task05_Prostate"]
    fp = to_fingerprint(ref)
    assert len(fp.cases) == 32 and len({c.case_id for c in fp.cases}) == 32
    assert {c.cropped_shape_zyx for c in fp.cases} == {(20, 320, 319)}
    assert {c.spacing_mm for c in fp.cases} == {(3.5999999, 0.625, 0.625)}
    assert fp.channel_names == ("T2", "ADC") and fp.image_dim == 3
    brain = to_fingerprint(references["Task01_BrainTumour"]).cases[0]
    ratio = math.prod(brain.cropped_shape_zyx) / math.prod(brain.shape_zyx)
    assert ratio == pytest.approx(0.36, rel=0.05)  # the uncropped shape follows the crop ratio


def test_derived_plans_are_checked_in_for_every_budget(references: dict[str, ReferenceDataset]) -> None:
    for name in references:
        for gib in REFERENCE_BUDGETS_GIB:
            plans = Plans.from_json(derived_path(PLANS_ROOT, name, gib))
            assert plans.gpu_memory_bytes == gib * GiB and plans.dataset_name == name
            assert plans.host_ram_bytes == reference_budget(gib).host_ram_bytes
            full = plans.configuration("3d_fullres")
            assert full.memory["predicted_peak_bytes"] <= gib * GiB * 0.95
            assert full.predicted_seconds_per_iteration > 0 and full.flops_per_iteration > 0


@pytest.mark.slow
def test_derived_plans_match_the_planner(references: dict[str, ReferenceDataset]) -> None:
    """Re-derives every reference plan (a few minutes: one set of simulations per network)."""
    for name, ref in references.items():
        for gib in REFERENCE_BUDGETS_GIB:
            stored = Plans.from_json(derived_path(PLANS_ROOT, name, gib))
            assert to_dict(derive(ref, gib)) == to_dict(stored), f"{name} {gib} GiB: python -m autoseg.plan.reference"


@pytest.mark.slow
def test_check_mode_reports_a_missing_or_changed_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hippo = load_references()["Task04_Hippocampus"]
    fields = {name: getattr(hippo, name) for name in hippo.__dataclass_fields__}
    ReferenceDataset(**{**fields, "num_training_cases": 4}).to_json(tmp_path / "reference" / "Tiny.json")
    assert main(["--check", "--root", str(tmp_path), "--budgets", "8"]) == 1
    assert "differs" in capsys.readouterr().err
    assert main(["--root", str(tmp_path), "--budgets", "8"]) == 0
    assert main(["--check", "--root", str(tmp_path), "--budgets", "8"]) == 0
    path = tmp_path / "derived" / "Tiny_8GiB.json"
    plans = Plans.from_json(path)
    full = plans.configuration("3d_fullres")
    changed = replace(
        plans, configurations={**plans.configurations, "3d_fullres": full.with_(batch_size=full.batch_size + 1)}
    )
    changed.to_json(path)
    assert main(["--check", "--root", str(tmp_path), "--budgets", "8"]) == 1
