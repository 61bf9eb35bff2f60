"""`autoseg predict` through the real CLI: a bad case is skipped and listed while the others are written,
`--continue` after a kill, a DICOM series as input, `--save-probabilities`."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from cli_checks import assert_refused, run_cli, snapshot
from dicom_series import write_dicom_series


def _predict(capsys, trained: Path, inputs: Path, out: Path, *flags: str):
    return run_cli(capsys, "predict", "-i", inputs, "-o", out, "-w", trained, "--no-mirror", *flags)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _nan(path: Path) -> None:  # NRRD keeps NaN (a float NIfTI too; read in one pass and refused)
    image = sitk.ReadImage(str(path), sitk.sitkFloat32)
    array = sitk.GetArrayFromImage(image)
    array[3, 4, 5] = np.nan
    out = sitk.GetImageFromArray(array)
    out.CopyInformation(image)
    sitk.WriteImage(out, str(path))


BAD_CASES = {  # what is done to demo_900's input -> the file the message must name
    "truncated": lambda f: (_truncate(f / "demo_900_0000.nii.gz"), f / "demo_900_0000.nii.gz")[1],
    "nan": lambda f: (_nan(f / "demo_900_0000.nii.gz"), f / "demo_900_0000.nii.gz")[1],
    "extra-channel": lambda f: (
        shutil.copy(f / "demo_900_0000.nii.gz", f / "demo_900_0001.nii.gz"),
        f / "demo_900_0001.nii.gz",
    )[1],
    "2d": lambda f: (
        sitk.WriteImage(sitk.ReadImage(str(f / "demo_900_0000.nii.gz"))[:, :, 3], str(f / "demo_900_0000.nii.gz")),
        f / "demo_900_0000.nii.gz",
    )[1],
}


@pytest.mark.slow  # the trained fixture: ~5 s once per session, then ~1 s a case
@pytest.mark.parametrize("name", list(BAD_CASES))
def test_a_bad_case_is_listed_at_the_end_and_the_others_are_written(
    name: str, capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    shutil.copy(inputs / "demo_005_0000.nii.gz", inputs / "demo_900_0000.nii.gz")
    named = BAD_CASES[name](inputs)
    out = tmp_path / "out"
    result = _predict(capsys, trained, inputs, out)
    assert_refused(result, 2, named, "1 of 3 case(s) not predicted", "demo_900:")
    assert result.err.count(str(named)) == 1  # listed once, at the end
    assert sorted(snapshot(out)) == ["demo_005.nii.gz", "demo_006.nii.gz"]  # nothing of demo_900, no temporary

    fail_fast = _predict(capsys, trained, inputs, tmp_path / "ff", "--fail-fast")
    assert_refused(fail_fast, 2, named)
    if name != "nan":  # found in the headers: before anything is predicted
        assert snapshot(tmp_path / "ff") == {}


def test_a_missing_input_is_refused_at_once(capsys, trained: Path, tmp_path: Path) -> None:
    assert_refused(_predict(capsys, trained, tmp_path / "nothing", tmp_path / "out"), 2, tmp_path / "nothing")


@pytest.mark.slow
def test_save_probabilities_matches_the_labels_in_the_input_geometry(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _predict(capsys, trained, inputs, out, "--save-probabilities").status == 0
    assert sorted(snapshot(out)) == ["demo_005.nii.gz", "demo_005.npz", "demo_006.nii.gz", "demo_006.npz"]
    for case in ("demo_005", "demo_006"):
        labels = sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{case}.nii.gz")))
        with np.load(out / f"{case}.npz") as saved:
            probabilities, names = saved["probabilities"], saved["names"]
            assert str(saved["activation"]) == "softmax"
        assert probabilities.dtype == np.float16 and probabilities.shape == (3, *labels.shape)
        assert names.tolist() == ["background", "organ", "lesion"]
        np.testing.assert_allclose(probabilities.astype(np.float32).sum(0), 1.0, atol=5e-3)
        top = np.sort(probabilities.astype(np.float32), axis=0)
        clear = top[-1] - top[-2] > 2e-3  # not a float16 tie
        np.testing.assert_array_equal(probabilities.argmax(0)[clear], labels[clear])
        assert clear.mean() > 0.99


@pytest.mark.slow
def test_dicom_series_folder_is_predicted_in_its_geometry(
    capsys, trained: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    voxels = sitk.GetArrayFromImage(sitk.ReadImage(str(tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz")))
    series = tmp_path / "patient_7"
    written = write_dicom_series(series, np.round(voxels * 100), "1.2.826.0.1.7.1", origin_xyz=(5.0, -3.0, 40.0))
    out = tmp_path / "out"
    assert _predict(capsys, trained, series, out).status == 0
    labels = sitk.ReadImage(str(out / "patient_7.nii.gz"))
    assert labels.GetSize() == written.GetSize()
    np.testing.assert_allclose(labels.GetSpacing(), written.GetSpacing(), atol=1e-4)
    np.testing.assert_allclose(labels.GetOrigin(), written.GetOrigin(), atol=1e-4)

    write_dicom_series(series, np.round(voxels * 50), "1.2.826.0.1.7.2")
    assert_refused(
        _predict(capsys, trained, series, tmp_path / "o2"), 2, "1.2.826.0.1.7.1", "1.2.826.0.1.7.2", "--series"
    )
    assert _predict(capsys, trained, series, out, "--series", "1.2.826.0.1.7.2").status == 0
    assert (out / "1.2.826.0.1.7.2.nii.gz").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_continue_after_a_kill_finishes_without_redoing_finished_cases(
    capsys, trained: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    from processes import kill_when, one_cpu, start

    inputs = tmp_path / "in"
    inputs.mkdir()
    image = tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz"
    for i in range(8):
        shutil.copy(image, inputs / f"scan_{i:03d}_0000.nii.gz")
    out, reference = tmp_path / "out", tmp_path / "reference"
    flags = ("--save-probabilities", "--runtime", "torch")  # one runtime in every run: they are compared
    with one_cpu():
        assert _predict(capsys, trained, inputs, reference, *flags).status == 0

    process = start("predict", "-i", inputs, "-o", out, "-w", trained, "--no-mirror", *flags)
    kill_when(process, lambda pids: len(list(out.glob("scan_*.nii.gz"))) >= 2)
    labelled = {p.name[: -len(".nii.gz")] for p in out.glob("scan_*.nii.gz")}  # done: its label map is written
    finished = {
        p.name: p.stat().st_mtime_ns for case in labelled for p in (out / f"{case}.nii.gz", out / f"{case}.npz")
    }
    assert 2 <= len(labelled) < 8
    with one_cpu():
        result = _predict(capsys, trained, inputs, out, "--continue", *flags)
    assert result.status == 0 and f"wrote {8 - len(labelled)} segmentation(s)" in result.out
    assert snapshot(out) == snapshot(reference) and len(snapshot(out)) == 16
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == finished  # not written again
    assert not any(name.startswith(".") for name in os.listdir(out))


def _labels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: sitk.GetArrayFromImage(sitk.ReadImage(str(p))) for p in sorted(folder.glob("*.nii.gz"))}


@pytest.mark.slow
def test_tta_and_tile_batch_choices_change_speed_not_labels(
    capsys, caplog, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    """--tta none equals --no-mirror byte for byte; the automatic tile batch (printed with --verbose) gives the
    labels of one tile at a time except at most 0.1% of voxels; --tta 2 uses 2 variants."""

    def run(name: str, *flags: str):
        result = run_cli(capsys, "predict", "-i", inputs, "-o", tmp_path / name, "-w", trained, *flags)
        assert result.status == 0, result.err
        return result

    run("no_mirror", "--no-mirror")
    run("tta_none", "--tta", "none", "--tile-batch-size", "1")
    assert snapshot(tmp_path / "no_mirror") == snapshot(tmp_path / "tta_none")
    run("one_tile", "--tta", "2", "--tile-batch-size", "1")
    caplog.set_level("INFO", logger="autoseg")
    run("auto", "--tta", "2", "--verbose")
    assert "(2 mirror variant(s) per tile), accumulator float16 on cpu; predicted peak" in caplog.text
    assert "tile batch 4" in caplog.text  # the CPU cap: the tiny network fits many
    for name, labels in _labels(tmp_path / "one_tile").items():
        differ = np.count_nonzero(labels != _labels(tmp_path / "auto")[name])
        assert differ <= 0.001 * labels.size, f"{name}: {differ} voxels differ"


def test_the_accumulator_dtype_is_a_choice_and_predict_keeps_its_tile_simulations(
    capsys, caplog, monkeypatch: pytest.MonkeyPatch, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    """--accumulator float32 gives the default float16's labels except at most 0.1% of voxels; an unknown dtype is
    refused before any work; the tile simulations go to the cache folder (AUTOSEG_CACHE_DIR), as the planning
    commands' do."""
    monkeypatch.setenv("AUTOSEG_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level("INFO", logger="autoseg")
    for dtype in ("float16", "float32"):
        result = run_cli(
            capsys,
            "predict",
            "-i",
            inputs,
            "-o",
            tmp_path / dtype,
            "-w",
            trained,
            "--tta",
            "2",
            "--accumulator",
            dtype,
            "--verbose",
            "--runtime",
            "torch",  # the torch runner's tile simulations
        )
        assert result.status == 0, result.err
        assert f"accumulator {dtype} on cpu" in caplog.text
    for name, labels in _labels(tmp_path / "float32").items():
        assert np.count_nonzero(labels != _labels(tmp_path / "float16")[name]) <= 0.001 * labels.size
    assert list((tmp_path / "cache").rglob("inference_simulation*"))
    refused = run_cli(
        capsys, "predict", "-i", inputs, "-o", tmp_path / "bad", "-w", trained, "--accumulator", "float64"
    )
    assert refused.status != 0 and "--accumulator 'float64'" in refused.err and "float16, float32" in refused.err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


@pytest.mark.slow
def test_background_workers_change_nothing_in_the_outputs(
    capsys, caplog, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    """Cases read ahead and exported behind on threads give the serial run's files byte for byte; --verbose prints
    the pipeline's plan and the predicted against the measured host peak."""
    for i in range(3):  # 5 cases: the pipeline fills and drains
        shutil.copy(inputs / "demo_005_0000.nii.gz", inputs / f"demo_90{i}_0000.nii.gz")
    caplog.set_level("INFO", logger="autoseg")
    serial = _predict(
        capsys,
        trained,
        inputs,
        tmp_path / "serial",
        "--preprocess-workers",
        "0",
        "--export-workers",
        "0",
        "--save-probabilities",
        "--runtime",
        "torch",  # auto may choose again on a busy machine: the same runtime in both runs
    )
    assert serial.status == 0, serial.err
    piped = _predict(
        capsys,
        trained,
        inputs,
        tmp_path / "piped",
        "--preprocess-workers",
        "2",
        "--export-workers",
        "2",
        "--save-probabilities",
        "--runtime",
        "torch",
        "--verbose",
    )
    assert piped.status == 0, piped.err
    assert "pipeline: 2 case(s) read ahead, 2 exported behind (threads)" in caplog.text
    assert "host peak: predicted" in caplog.text
    assert len(snapshot(tmp_path / "piped")) == 10
    assert snapshot(tmp_path / "piped") == snapshot(tmp_path / "serial")


def test_a_tta_count_beyond_the_networks_variants_is_refused_before_any_work(
    capsys, trained: Path, inputs: Path, tmp_path: Path
) -> None:
    result = run_cli(capsys, "predict", "-i", inputs, "-o", tmp_path / "out", "-w", trained, "--tta", "9")
    assert_refused(result, 2, "--tta '9'", "8 variants")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tile_patch_predicts_with_the_training_patch_and_planned_with_the_plans_tile(
    capsys, caplog, trained: Path, inputs: Path, tmp_path: Path
):
    """--tile planned (the default) uses plans.json's inference_patch_size, fitted to each image; --tile patch the
    training patch, byte for byte what a plan whose tile is the patch predicts. --verbose names each case's tile."""
    from factories import set_configuration

    from autoseg.core.workspace import Workspace

    before = _predict(capsys, trained, inputs, tmp_path / "before")
    assert before.status == 0, before.err
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    set_configuration(Workspace.at(ws), "3d_fullres", inference_patch_size=(12, 24, 24))  # the patch is 8x16x16
    caplog.set_level("INFO", logger="autoseg")
    for name, flags in (("planned", ()), ("patch", ("--tile", "patch"))):
        result = _predict(capsys, ws, inputs, tmp_path / name, "--verbose", *flags)
        assert result.status == 0, result.err
        assert f"tile 8x16x16 ({name})" in caplog.text or name == "planned"
    assert "(planned), " in caplog.text and "tile 8x16x24 (planned), 2 tile(s)" in caplog.text
    assert snapshot(tmp_path / "patch") == snapshot(tmp_path / "before") != snapshot(tmp_path / "planned")


@pytest.mark.slow
def test_parts_write_together_what_one_run_writes(capsys, trained: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    """Three --part runs into one folder (a bad case among the inputs, listed by its part only) write the bytes one
    run writes; a part with no case writes nothing and succeeds."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i, image in enumerate(sorted((tiny_dataset / "imagesTs").glob("*_0000.nii.gz")) * 3):
        shutil.copy(image, inputs / f"scan_{i:03d}_0000.nii.gz")  # 6 cases
    _truncate(inputs / "scan_004_0000.nii.gz")  # in part 3 of 3 (cases 5-6)
    flags = ("--save-probabilities", "--runtime", "torch")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _predict(capsys, trained, inputs, whole, *flags).status == 2
    statuses = [_predict(capsys, trained, inputs, parts, "--part", f"{i}/3", *flags) for i in (1, 2, 3)]
    assert [r.status for r in statuses] == [0, 0, 2] and "scan_004" in statuses[2].err
    assert "scan_004" not in statuses[0].err + statuses[1].err
    assert snapshot(parts) == snapshot(whole) and len(snapshot(whole)) == 10  # 5 label maps and their .npz
    empty = _predict(
        capsys, trained, inputs, tmp_path / "none", "--part", "1/7", *flags
    )  # 6 cases: part 1 of 7 is none
    assert empty.status == 0 and snapshot(tmp_path / "none") == {}


@pytest.mark.parametrize("part", ["0/3", "4/3", "3", "a/b", "2/-1"])
def test_a_part_outside_one_to_n_is_refused(capsys, part: str, tmp_path: Path) -> None:
    result = run_cli(capsys, "predict", "-i", tmp_path, "-o", tmp_path / "out", "--part", part)
    assert_refused(result, 2, "--part", "1 <= I <= N")
