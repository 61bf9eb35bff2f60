"""benchmarks/accuracy.py's dataset (benchmarks/_small_structures.py): thin branching tubes, small lesions of the
asked sizes and count, labels as dataset.json says, the same bytes from the same seed; and the table's section in
docs/benchmarks.md. The lesions-found count itself is autoseg evaluate's (tests/evaluate/test_detection.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
S26 = np.ones((3, 3, 3), bool)


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """The benchmark modules importable as the scripts import them (from their own folder)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _small_structures
    import accuracy

    yield _small_structures, accuracy
    for name in ("_small_structures", "accuracy", "_cases", "_common"):
        sys.modules.pop(name, None)


def _tiny(module):
    """Small cases with room for two levels of branching."""
    return replace(module.PRESETS["small-structures"], shape_zyx=(16, 80, 80), trees=2, tree_depth=3)


def test_tubes_are_one_to_three_voxels_across(bench) -> None:
    structures, _ = bench
    options = _tiny(structures)
    for index in range(4):
        case = structures.synthesize_case(options, 0, index)
        tubes = case.label_zyx == structures.label_values(options)["tubes"]
        too_wide = [ndimage.binary_erosion(t, structure=np.ones((4, 4), bool)).any() for t in tubes]
        assert not any(too_wide), f"case {index}: a tube 4 or more voxels across on slice(s) {np.flatnonzero(too_wide)}"


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_segment_is_as_wide_as_its_level_says(bench, width: int) -> None:
    """A segment along x painted ``width`` wide covers ``width`` rows; one along y ``width`` columns."""
    structures, _ = bench
    for axis in (1, 2):
        mask = np.zeros((3, 12, 12), bool)
        points = np.zeros((20, 3)) + (1.0, 5.3, 5.3)
        points[:, axis] = np.linspace(2, 9, 20)
        structures._paint(mask, points, width)
        across = mask.any(axis=axis)[1]  # the extent across the segment
        assert across.sum() == width


def test_tubes_are_connected_trees_that_branch(bench) -> None:
    """Each tree is one 26-connected piece; at each recorded branch point three arms leave a ring around it."""
    structures, _ = bench
    options = _tiny(structures)
    branch_points = 0
    for index in range(4):
        case = structures.synthesize_case(options, 0, index)
        tubes = case.label_zyx == structures.label_values(options)["tubes"]
        _, pieces = ndimage.label(tubes, structure=S26)
        assert 1 <= pieces <= options.trees, f"case {index}: {pieces} tube pieces for {options.trees} trees"
        z, y, x = np.indices(tubes.shape)
        for bz, by, bx in case.branch_points_zyx:
            inplane = np.hypot(y - by, x - bx)
            ring = tubes & (inplane >= 4.5) & (inplane <= 5.5) & (np.abs(z - bz) <= 2)
            arms = ndimage.label(ring, structure=S26)[1]
            assert arms >= 3, f"case {index}: {arms} arm(s) leave the branch point {(bz, by, bx)}"
            branch_points += 1
    assert branch_points >= 4


def test_the_contrast_options_set_the_ct(bench) -> None:
    """Tubes at ``tube_hu`` without partial volume and noise (the texture's 6 HU aside); the CT blur takes about a
    third of their contrast over the body (the thin ones the most); the noise is ``noise_hu`` per voxel."""
    structures, _ = bench
    sharp = replace(_tiny(structures), ct_blur_vox=(0.0, 0.0, 0.0), noise_hu=0.0)
    cases = {
        name: structures.synthesize_case(options, 0, 1)
        for name, options in (("sharp", sharp), ("blurred", replace(sharp, ct_blur_vox=(0.3, 0.6, 0.6))))
    }
    tubes = cases["sharp"].label_zyx == structures.label_values(sharp)["tubes"]
    contrast = {name: c.ct_zyx[tubes].mean() - structures.BODY_HU for name, c in cases.items()}
    assert abs(contrast["sharp"] - (sharp.tube_hu - structures.BODY_HU)) < 3
    assert 0.5 < contrast["blurred"] / contrast["sharp"] < 0.8
    noisy = structures.synthesize_case(replace(sharp, noise_hu=20.0), 0, 1)
    body = cases["sharp"].label_zyx == 0
    body &= cases["sharp"].ct_zyx > -500  # inside the body, off every structure
    noise = noisy.ct_zyx[body].astype(float) - cases["sharp"].ct_zyx[body]
    assert abs(noise.std() - 20.0) < 1.0


def test_lesions_have_the_asked_count_and_diameters(bench) -> None:
    structures, _ = bench
    options = replace(_tiny(structures), lesions=(2, 4), lesion_mm=(4.0, 8.0))
    counts = set()
    for index in range(6):
        case = structures.synthesize_case(options, 0, index)
        lesions = case.label_zyx == structures.label_values(options)["lesions"]
        components, count = ndimage.label(lesions, structure=S26)
        assert 2 <= count <= 4 and count == len(case.lesion_diameters_mm), f"case {index}: {count} lesions"
        counts.add(count)
        spacing_x = case.spacing_zyx_mm[2]
        extents = []
        for box in ndimage.find_objects(components):
            extents.append((box[2].stop - box[2].start) * spacing_x)  # across x, on the centre slice's full width
        for extent, diameter in zip(sorted(extents), sorted(case.lesion_diameters_mm), strict=True):
            assert abs(extent - diameter) <= spacing_x, f"case {index}: {extent:.1f} mm across for {diameter:.1f} mm"
        assert all(4.0 - spacing_x <= e <= 8.0 + spacing_x for e in extents)
    assert len(counts) > 1  # the count is drawn per case


def test_dataset_labels_and_channels_are_as_dataset_json_says(bench, tmp_path: Path) -> None:
    structures, _ = bench
    from autoseg.dataset.imageio import read_image

    options = replace(_tiny(structures), shape_zyx=(16, 64, 64))
    dataset = structures.make_structures_dataset(tmp_path, "small-structures", options, (2, 1), seed=3)
    meta = json.loads((dataset / "dataset.json").read_text())
    assert meta["labels"] == {"background": 0, "organ": 1, "tubes": 2, "lesions": 3}
    assert meta["channel_names"] == {"0": "CT", "1": "PET"} and meta["numTest"] == 1
    assert sorted(p.name for p in (dataset / "imagesTs").iterdir()) == [
        "struct_002_0000.nii.gz",
        "struct_002_0001.nii.gz",
    ]
    label, _ = read_image(dataset / "labelsTr" / "struct_000.nii.gz")
    pet, _ = read_image(dataset / "imagesTr" / "struct_000_0001.nii.gz")
    assert set(np.unique(label).tolist()) == set(meta["labels"].values())
    lesion, organ = label == meta["labels"]["lesions"], label == meta["labels"]["organ"]
    assert pet[lesion].mean() > 2 * pet[organ].mean()  # the lesions are the PET's hot spots
    slabs = structures.make_structures_dataset(tmp_path, "slabs", structures.PRESETS["slabs"], (1, 0), seed=3)
    assert json.loads((slabs / "dataset.json").read_text())["labels"] == {"background": 0, "organ": 1, "lesions": 2}


def test_the_same_seed_gives_the_same_bytes(bench, tmp_path: Path) -> None:
    structures, _ = bench
    options = replace(_tiny(structures), shape_zyx=(16, 48, 48))
    first, again, other = (
        structures.make_structures_dataset(tmp_path / name, "small-structures", options, (2, 0), seed=seed)
        for name, seed in (("a", 5), ("b", 5), ("c", 6))
    )
    files = sorted(p.relative_to(first) for p in first.rglob("*.nii.gz"))
    assert len(files) == 6
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    assert any((first / f).read_bytes() != (other / f).read_bytes() for f in files)


def test_write_docs_replaces_its_section_and_adds_a_missing_one(bench, tmp_path: Path) -> None:
    _, accuracy = bench
    docs = tmp_path / "benchmarks.md"
    parent = accuracy.SECTION
    docs.write_text(
        f"# B\n\n{parent}\n\nabout it\n\n### Accuracy: demo, T = 2m\n\nold\n```\n# a comment\n```\n\n## Next\n"
    )
    accuracy.write_docs("### Accuracy: demo, T = 2m", "new table", docs)
    accuracy.write_docs("### Accuracy: slabs, T = 30m", "slabs table", docs)
    text = docs.read_text()
    assert "old" not in text and "# a comment" not in text and text.count("### Accuracy: demo") == 1
    assert text.index("new table") < text.index("slabs table") < text.index("## Next")
    accuracy.write_docs("### Accuracy: demo, T = 2m", "newer", tmp_path / "benchmarks.md")
    assert "new table" not in docs.read_text() and "slabs table" in docs.read_text()


def test_lesions_found_reads_the_summary_means(bench) -> None:
    _, accuracy = bench
    mean = {"organ": {"components": 4, "components_found": 4}, "lesions": {"components": 13, "components_found": 8}}
    assert accuracy.lesions_found(mean) == "8 of 13 (62%)"
    assert accuracy.lesions_found({"organ": mean["organ"]}) == "-"


def test_each_run_plans_for_its_budget_again_with_overwrite(bench, tmp_path: Path, monkeypatch) -> None:
    """Every run plans for its own budget (the rule's target) or the given seconds: a new workspace plainly, one planned
    before with ``--overwrite`` (a new target keeps the preprocessed cases; a dataset generated again since, with
    other options, is redone rather than trained on stale preprocessing)."""
    _, accuracy = bench
    raw, calls = tmp_path / "Dataset028_X", []
    workspace = tmp_path / f"ws_{raw.name}"
    monkeypatch.setattr(accuracy, "run_autoseg", lambda *args: calls.append(args) or 1.0)
    accuracy.run_pipeline(tmp_path, raw, "1m")
    assert [c[0] for c in calls] == ["plan_and_preprocess", "train", "predict", "evaluate"]
    assert calls[0][-2:] == ("--time-budget", "1m") and calls[1][-2:] == ("--time-budget", "1m")
    calls.clear()
    workspace.mkdir()
    (workspace / "plans.json").write_text("{}")
    accuracy.run_pipeline(tmp_path, raw, "1m", seconds_per_iteration=0.5)
    assert calls[0][0] == "plan_and_preprocess" and calls[0][-3:] == ("--seconds-per-iteration", "0.5", "--overwrite")
