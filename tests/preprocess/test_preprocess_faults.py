"""Preprocessing under faults: process count from the RAM budget, a worker killed by the OS, a run killed
midway and rerun, temporary files of an interrupted run."""

from __future__ import annotations

import dataclasses
import logging
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from factories import GiB, tiny_plans
from killing_runner import VICTIM, die_on_victim

import autoseg.preprocess.parallel
from autoseg.core.artifacts import read_json
from autoseg.core.resources import cpu_count
from autoseg.core.spacing import compute_new_shape
from autoseg.core.workers import WorkerDiedError
from autoseg.core.workspace import Workspace, WorkspaceInfo
from autoseg.dataset.raw import RawDataset, load_dataset
from autoseg.demo.data import make_demo_dataset
from autoseg.memory.host import preprocess_worker_bytes
from autoseg.plan.fingerprint import fingerprint
from autoseg.preprocess.parallel import PreprocessOptions, case_peak_bytes, preprocess
from autoseg.preprocess.run import preprocessing_processes_for
from autoseg.preprocess.store import case_files, is_complete, list_complete_cases, properties_path


@pytest.fixture()
def dataset(tiny_dataset: Path) -> RawDataset:
    return load_dataset(tiny_dataset)


def test_case_peak_bytes_is_the_worker_formula_plus_augmentation() -> None:
    config = tiny_plans().configuration("3d_fullres")
    shape, spacing = (60, 300, 300), (2.5, 0.7, 0.7)
    after = compute_new_shape(shape, spacing, config.spacing_mm)
    plain = case_peak_bytes(shape, spacing, config, num_channels=2, num_label_values=3)
    assert plain == preprocess_worker_bytes(shape, after, 2)["total"]
    with_copies = case_peak_bytes(shape, spacing, config, num_channels=2, num_label_values=3, num_augmentations=2)
    assert with_copies >= plain


def test_a_case_s_predicted_peak_counts_its_crop_as_measured() -> None:
    """A case whose body fills an eighth of the image: the crop to its nonzero box and the resampling of that crop,
    measured with tracemalloc (numpy's allocations) above the arrays as read. The crop-aware prediction is an upper
    bound within 30% of it (26% here; the label's resampling phase is predicted 17-26% high with or without a
    crop); the prediction that takes the crop as the whole image is 9x too high."""
    import tracemalloc

    from autoseg.dataset.imageio import Geometry
    from autoseg.preprocess.preprocessor import preprocess_case

    shape, body = (40, 128, 128), (slice(10, 30), slice(32, 96), slice(32, 96))
    data = np.zeros((1, *shape), dtype=np.float32)
    data[(0, *body)] = np.random.default_rng(0).normal(100, 20, (20, 64, 64))
    seg = np.zeros((1, *shape), dtype=np.int16)
    seg[0, 15:25, 48:80, 48:80] = 1
    plans = tiny_plans(spacing_mm=(2.0, 0.6, 0.6))
    config = plans.configuration("3d_fullres")
    geometry = Geometry(
        ndim=3,
        size_xyz=shape[::-1],
        spacing_xyz=(0.8, 0.8, 2.5),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=tuple(np.eye(3).ravel()),
    )
    tracemalloc.start()
    try:
        preprocess_case(data, seg, geometry, plans, config, "case")
        measured = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    raw = data.nbytes + seg.nbytes  # alive before: the arrays as read

    def predicted(cropped: tuple[int, ...] | None) -> int:
        after = config.resampled_shape(cropped or shape, geometry.spacing_zyx)
        terms = preprocess_worker_bytes(shape, after, 1, runtime_bytes=0, cropped_zyx=cropped)
        return max(terms[k] for k in ("crop", "resample_image", "resample_seg")) - raw

    assert measured <= predicted((20, 64, 64)) <= 1.3 * measured
    assert predicted(None) > 5 * measured


def test_process_count_follows_the_fingerprint_and_budget(tiny_dataset: Path, tmp_path: Path, caplog) -> None:
    workspace = Workspace.at(tmp_path / "ws")
    workspace.root.mkdir()
    WorkspaceInfo(dataset_root=str(tiny_dataset)).to_json(workspace.info_path)
    fp = fingerprint(load_dataset(tiny_dataset), progress=False)
    fp.to_json(workspace.fingerprint_path)
    config = tiny_plans().configuration("3d_fullres")
    largest = max(
        case_peak_bytes(c.shape_zyx, c.spacing_mm, config, 1, 3, cropped_zyx=c.cropped_shape_zyx) for c in fp.cases
    )
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # what this process holds is reserved
    budget = held + 2 * largest + largest // 2  # room for 2.5 workers beside this process
    with caplog.at_level(logging.INFO, logger="autoseg"):
        n = preprocessing_processes_for(workspace, tiny_plans(host_ram_bytes=budget), "3d_fullres")
    assert n == min(2, cpu_count())
    assert f"largest case's predicted peak {largest / 2**20:.0f} MiB" in caplog.text
    small = tiny_plans(host_ram_bytes=256 * 2**20)  # less than one case needs beside this process
    assert preprocessing_processes_for(workspace, small, "3d_fullres") == 1


@pytest.mark.slow  # ~3 s: two spawned workers import numpy, scipy and SimpleITK
def test_a_killed_worker_fails_the_run_at_once_naming_the_case(
    dataset: RawDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the workers run die_on_victim for each case: spawned, they unpickle it from killing_runner
    monkeypatch.setattr(autoseg.preprocess.parallel, "run_case", die_on_victim)
    t0 = time.perf_counter()
    with pytest.raises(WorkerDiedError) as error:
        preprocess(
            dataset,
            tiny_plans(host_ram_bytes=3 * GiB),
            "3d_fullres",
            tmp_path / "out",
            PreprocessOptions(processes=2, progress=False),
        )
    assert time.perf_counter() - t0 < 30  # no hang: BrokenProcessPool is noticed within a second
    message = str(error.value)
    assert f"{VICTIM} (predicted peak " in message and "MiB, killed by signal 9)" in message
    assert "host RAM budget of 3.0 GiB" in message and "--processes" in message
    assert error.value.in_flight == {VICTIM: -signal.SIGKILL}
    assert not is_complete(tmp_path / "out", VICTIM)


_KILLABLE_RUN = """
import sys
from autoseg.dataset.raw import load_dataset
from autoseg.plan.plans import Plans
from autoseg.preprocess.parallel import PreprocessOptions, preprocess
quiet = PreprocessOptions(progress=False)
preprocess(load_dataset(sys.argv[1]), Plans.from_json(sys.argv[2]), "3d_fullres", sys.argv[3], quiet)
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow  # ~5 s: a subprocess that imports autoseg, killed after its first case
def test_a_run_killed_midway_then_rerun_writes_what_an_uninterrupted_run_writes(tmp_path: Path) -> None:
    raw = make_demo_dataset(tmp_path / "raw", num_train=5, num_test=0, shape_zyx=(32, 80, 80), seed=5)
    dataset, plans = load_dataset(raw), tiny_plans()
    plans.to_json(tmp_path / "plans.json")
    reference = preprocess(dataset, plans, "3d_fullres", tmp_path / "reference", PreprocessOptions(progress=False))

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLABLE_RUN), str(raw), str(tmp_path / "plans.json"), str(out)]
    )
    deadline = time.monotonic() + 60
    while not list_complete_cases(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)  # like the OOM killer: no cleanup runs
    proc.wait()
    complete = [c.case_id for c in dataset.cases if is_complete(out, c.case_id)]
    assert 1 <= len(complete) < len(dataset.cases), "the kill should land after the first case"

    preprocess(dataset, plans, "3d_fullres", out, PreprocessOptions(progress=False))
    assert _files(out) == _files(reference)  # byte-equal arrays and JSON; no temporary files left


def test_rerun_removes_temporaries_and_redoes_a_half_written_case(dataset: RawDataset, tmp_path: Path) -> None:
    small = dataclasses.replace(dataset, cases=dataset.cases[:2])
    out = preprocess(small, tiny_plans(), "3d_fullres", tmp_path / "out", PreprocessOptions(progress=False))
    reference = _files(out)
    victim = small.cases[1].case_id
    properties_path(out, victim).unlink()  # the kill came before the JSON ...
    np.save(case_files(out, victim).data, np.zeros(3))  # ... after a stale data file was in place
    (out / f".{victim}_seg.npy.k1ll3d.tmp.npy").write_bytes(b"half a file")  # and mid-write of another
    preprocess(small, tiny_plans(), "3d_fullres", out, PreprocessOptions(progress=False))
    assert _files(out) == reference


def test_report_holds_predicted_and_measured_peaks(dataset: RawDataset, tmp_path: Path) -> None:
    small = dataclasses.replace(dataset, cases=dataset.cases[:2])
    options = PreprocessOptions(progress=False, report_path=tmp_path / "report.json")
    preprocess(small, tiny_plans(), "3d_fullres", tmp_path / "out", options)
    report = read_json(tmp_path / "report.json")
    assert [c["case_id"] for c in report["cases"]] == [c.case_id for c in small.cases]
    for case in report["cases"]:
        assert case["predicted_peak_bytes"] > 0 and case["disk_bytes"] > 0
        if sys.platform == "linux":  # VmHWM of this (test) process while it ran the case, torch loaded
            # in-process, a case's peak is on top of what this process held (not a fresh worker's 150 MiB):
            # predicted within the 25% of the measured peak
            measured = case["measured_peak_rss_bytes"]
            assert abs(case["predicted_peak_bytes"] - measured) <= 0.25 * measured, case
