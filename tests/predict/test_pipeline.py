"""The prediction pipeline: cases read ahead and exported behind on threads, bounded as planned, in order, with
errors where they belong; its sizing from the host-RAM budget; the preprocessing bytes it is sized with."""

from __future__ import annotations

import dataclasses
import threading
import time
import tracemalloc

import numpy as np
import pytest

from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.core.units import MiB
from autoseg.memory.host import prediction_preprocess_bytes
from autoseg.predict.pipeline import Pipeline, pipeline_peak_bytes, plan_pipeline


class _Stages:
    """Fake stages that record how many prepared items and exports are alive at once."""

    def __init__(self, nbytes: int = 0) -> None:
        self.lock = threading.Lock()
        self.alive = 0  # prepared values not yet exported
        self.most_alive = 0
        self.exporting = 0
        self.most_exporting = 0
        self.order: list[int] = []
        self.nbytes = nbytes

    def prepare(self, item: int) -> tuple[int, np.ndarray]:
        with self.lock:
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
        time.sleep(0.01)
        return item, np.ones(max(self.nbytes // 8, 1))

    def export(self, item: int) -> None:
        with self.lock:
            self.exporting += 1
            self.most_exporting = max(self.most_exporting, self.exporting)
        time.sleep(0.03)
        with self.lock:
            self.exporting -= 1
            self.alive -= 1
            self.order.append(item)


@pytest.mark.parametrize(("ahead", "behind"), [(0, 0), (1, 1), (2, 1), (1, 3)])
def test_cases_come_in_order_and_no_more_are_held_than_planned(ahead: int, behind: int) -> None:
    stages = _Stages()
    seen = []
    with Pipeline(stages.prepare, ahead, behind) as pipeline:
        for item, prepared in pipeline.prepared(list(range(9))):
            value, _ = prepared()
            assert value == item
            seen.append(item)
            pipeline.finish(lambda item=item: stages.export(item))
    assert seen == list(range(9))
    assert sorted(stages.order) == list(range(9))  # every export ran before the pipeline was left
    assert stages.most_exporting <= max(behind, 1)
    # the case being predicted, the ones read ahead and the ones waiting for their export
    assert stages.most_alive <= 1 + ahead + behind, stages.most_alive
    if ahead and behind:
        assert stages.most_alive > 1  # they really overlap


def test_a_bad_item_raises_where_it_is_taken_and_the_others_go_on() -> None:
    def prepare(item: int) -> int:
        if item == 2:
            raise ValueError("bad 2")
        return item

    got, bad = [], []
    with Pipeline(prepare, 2, 1) as pipeline:
        for item, prepared in pipeline.prepared([0, 1, 2, 3, 4]):
            try:
                got.append(prepared())
            except ValueError:
                bad.append(item)
    assert got == [0, 1, 3, 4] and bad == [2]


@pytest.mark.parametrize("behind", [0, 1, 2])
def test_an_export_error_stops_the_run(behind: int) -> None:
    written = []

    def export(item: int) -> None:
        if item == 1:
            raise OSError(28, "No space left on device", f"out/{item}.nii.gz")
        written.append(item)

    with pytest.raises(OSError, match="No space left"), Pipeline(lambda i: i, 1, behind) as pipeline:
        for item, prepared in pipeline.prepared(list(range(20))):
            prepared()
            pipeline.finish(lambda item=item: export(item))
    assert len(written) <= 1 + behind + 1  # not the whole list: the error stopped it


def _bytes(**kw: int) -> dict[str, int]:
    return {
        "runtime": 400 * MiB,
        "preprocess": 300 * MiB,
        "input": 100 * MiB,
        "predict": 200 * MiB,
        "export": 500 * MiB,
        **kw,
    }


def test_workers_are_what_the_budget_holds_beside_the_prediction() -> None:
    b = _bytes()
    base = b["runtime"] + b["predict"] + b["input"]  # 700 MiB
    pair = b["preprocess"] + b["export"]  # 800 MiB a worker in each stage
    assert plan_pipeline(b, 10, base + pair - 1).preprocess_workers == 0  # no room: serial
    assert plan_pipeline(b, 10, base + 2 * pair).export_workers == 2
    assert plan_pipeline(b, 10, base + 100 * pair).preprocess_workers <= 4  # MAX_BACKGROUND_WORKERS
    assert plan_pipeline(b, 1, base + 100 * pair).preprocess_workers == 0  # one case: nothing beside it
    given = plan_pipeline(b, 10, base, preprocess_workers=2, export_workers=0)
    assert (given.preprocess_workers, given.export_workers) == (2, 0)
    assert given.peak_bytes == base + 2 * 300 * MiB
    assert pipeline_peak_bytes(b, 0, 0) == 400 * MiB + 500 * MiB  # serial: the largest stage, export here


def test_predicted_peak_holds_against_the_process_rss_of_the_real_pipeline() -> None:
    """The stages hold real arrays of the planned sizes; the process's measured peak RSS (VmHWM) over the run
    stays under what pipeline_peak_bytes predicts from them (plus 5% for the interpreter), serial and pipelined;
    serial, it is the prediction within 15%. Pipelined, the prediction is the worst case (every worker at its
    peak at once), which a run reaches only when the stages' peaks coincide."""
    if peak_rss_bytes() is None:
        pytest.skip("no peak RSS on this system")
    # every array above glibc's largest mmap threshold (32 MiB): freed arrays go back to the system at once
    sizes = {"preprocess": 160 * MiB, "input": 64 * MiB, "predict": 96 * MiB, "export": 160 * MiB}

    def filled(nbytes: int) -> np.ndarray:
        return np.ones(nbytes // 8)

    def prepare(item: int) -> np.ndarray:
        scratch = filled(sizes["preprocess"] - sizes["input"])
        out = filled(sizes["input"])
        del scratch
        return out

    def export(probabilities: np.ndarray) -> None:
        temporaries = filled(sizes["export"] - sizes["predict"])
        time.sleep(0.05)
        del temporaries, probabilities

    for ahead, behind in ((0, 0), (1, 1), (2, 2)):
        runtime = process_rss_bytes()
        predicted = pipeline_peak_bytes({"runtime": runtime, **sizes}, ahead, behind)
        reset_peak_rss()
        with Pipeline(prepare, ahead, behind) as pipeline:
            for _, prepared in pipeline.prepared(list(range(8))):
                data = prepared()
                probabilities = filled(sizes["predict"])
                time.sleep(0.05)
                del data
                pipeline.finish(lambda p=probabilities: export(p))
                del probabilities
        measured = peak_rss_bytes()
        stages, held = predicted - runtime, measured - runtime
        assert held <= stages * 1.05, (ahead, behind, held / MiB, stages / MiB)
        assert held >= pipeline_peak_bytes({"runtime": 0, **sizes}, 0, 0) * 0.85, (ahead, behind, held / MiB)


@pytest.mark.parametrize(
    ("shape", "after", "channels"),
    [
        ((40, 120, 100), (20, 100, 90), 1),  # resampled down
        ((30, 80, 80), (30, 160, 160), 2),  # up in-plane, two channels
        ((30, 60, 60), (30, 60, 60), 1),  # unchanged
    ],
)
def test_prediction_preprocess_bytes_bounds_the_real_preprocessing(tmp_path, shape, after, channels) -> None:
    """prediction_preprocess_bytes against tracemalloc's peak of the real load_case + preprocess_case of a file
    (the result included, as the pipeline holds it): an upper bound, and within 30%."""
    from factories import tiny_plans

    from autoseg.dataset.imageio import Geometry, write_image
    from autoseg.dataset.raw import Case
    from autoseg.predict.case import prepare_case

    spacing = (2.0, 1.0, 1.0)
    geometry = Geometry(
        ndim=3,
        size_xyz=tuple(reversed(shape)),
        spacing_xyz=tuple(reversed(spacing)),
        origin_xyz=(0.0,) * 3,
        direction=(1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0),
    )
    rng = np.random.default_rng(0)
    paths = []
    for c in range(channels):
        paths.append(tmp_path / f"x_{c:04d}.nii.gz")
        write_image(paths[-1], rng.uniform(1, 2, shape).astype(np.float32), geometry)
    target = tuple(s * n / m for s, n, m in zip(spacing, shape, after, strict=True))
    plans = tiny_plans(spacing_mm=target)
    plans = dataclasses.replace(
        plans,
        channel_names=("MRI",) * channels,
        normalization=("zscore",) * channels,
        use_nonzero_mask=(True,) * channels,
        intensity_properties=plans.intensity_properties * channels,
    )
    config = plans.configuration("3d_fullres")
    tracemalloc.start()
    data, props = prepare_case(Case("x", tuple(paths), None), plans, config)
    measured = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert data.shape == (channels, *after)
    estimate = prediction_preprocess_bytes(shape, after, channels, spacing)["total"]
    assert 0.7 * estimate <= measured <= estimate, (measured / MiB, estimate / MiB)
