"""The DICOM writers' memory model (``autoseg.memory.host.dicom_seg_bytes``, ``rtstruct_bytes``) against the real
writers, measured by tracemalloc (numpy's arrays and Python's objects), and the prediction's plan counting it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from dicom_series import write_dicom_series
from extras import require_extra

from autoseg.dataset.dicom_source import SourceSeries
from autoseg.dataset.dicom_write import write_dicom_labels
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case
from autoseg.memory.host import dicom_seg_bytes, rtstruct_bytes
from autoseg.predict.pipeline import LabelWrite

UID = "1.2.826.0.1.3680043.8.498.78"


def _every_segment_on_every_slice(shape: tuple[int, int, int], num_segments: int) -> np.ndarray:
    """The plan's case: each segment a band of rows on every slice, so no SEG frame is empty."""
    labels = np.zeros(shape, np.uint8)
    for k in range(num_segments):
        labels[:, (shape[1] * k) // num_segments : (shape[1] * (k + 1)) // num_segments, 2:-2] = k + 1
    return labels


def _written_peak(path: Path, labels: np.ndarray, source: SourceSeries, scheme: LabelScheme, output: str) -> int:
    """The writer's traced peak beside ``labels``, after a first write has loaded what it uses (``libraries``)."""
    write_dicom_labels(path.with_suffix(".warm"), labels, source, scheme, output)
    tracemalloc.start()
    try:
        write_dicom_labels(path, labels, source, scheme, output)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


MEASURE = """
import ctypes
import sys
from pathlib import Path
import numpy as np
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.dataset.dicom_source import SourceSeries
from autoseg.dataset.dicom_write import check_dicom_output, write_dicom_labels
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case
from autoseg.memory.host import dicom_seg_bytes

folder, regions = Path(sys.argv[1]), sys.argv[2] == "1"
case = Case("c", (folder,), None, series_uid=sys.argv[3])
check_dicom_output([case], "dicom-seg")  # imports highdicom, as predict does before any case
source = SourceSeries.of(case)
if regions:
    scheme = LabelScheme.from_labels({"background": 0, "a": [1, 2, 3], "b": [2, 3], "c": 3}, [1, 2, 3])
else:
    scheme = LabelScheme.plain(13)
labels = np.load(folder.parent / "labels.npy")
peaks = []
for _ in range(2):  # the first loads highdicom's tables ("libraries"), the second runs with them loaded
    ctypes.CDLL(None).malloc_trim(0)  # what the first write freed leaves the RSS: the second's peak is its own
    reset_peak_rss()
    before = process_rss_bytes()
    write_dicom_labels(folder.parent / "c.dcm", labels, source, scheme, "dicom-seg")
    peaks.append(peak_rss_bytes() - before)
predicted = dicom_seg_bytes(labels.shape, len(scheme.names), regions)
print(*peaks, predicted["total"], predicted["libraries"])
"""


@pytest.mark.parametrize("regions", [False, True])
def test_the_seg_model_holds_the_measured_writer(tmp_path: Path, regions: bool) -> None:
    """Every segment on every slice (the plan's bound), written twice in a fresh process: the first write's peak RSS
    beside the label map is within ``dicom_seg_bytes``, and the second's (highdicom's tables loaded) within 30% of it
    without ``libraries`` (12 classes: the frames' bits, items and headers; 3 regions: their masks, a bound)."""
    require_extra("highdicom")
    shape = (60, 256, 256)
    write_dicom_series(tmp_path / "s", np.zeros(shape), UID)
    np.save(tmp_path / "labels.npy", _every_segment_on_every_slice(shape, 3 if regions else 12))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "s"), "1" if regions else "0", UID],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    first, second, predicted, libraries = map(int, run.stdout.split()[-4:])
    assert first <= predicted, (first / 2**20, predicted / 2**20)
    assert 0.7 * (predicted - libraries) <= second <= predicted - libraries, (second / 2**20, predicted / 2**20)


def test_the_rtstruct_model_holds_the_writer_given_its_contour_points(tmp_path: Path) -> None:
    require_extra("skimage")
    shape = (24, 96, 80)
    write_dicom_series(tmp_path / "s", np.zeros(shape), UID)
    source = SourceSeries.of(Case("c", (tmp_path / "s",), None, series_uid=UID))
    pydicom = require_extra("pydicom")
    labels = np.zeros(shape, np.uint8)
    labels[:, 10:30, 10:50] = 1
    labels[3:9, 50:90, 20:60] = 2
    measured = _written_peak(tmp_path / "c.dcm", labels, source, LabelScheme.plain(3), "rtstruct")
    written = pydicom.dcmread(tmp_path / "c.dcm")
    points = sum(int(c.NumberOfContourPoints) for roi in written.ROIContourSequence for c in roi.ContourSequence)
    predicted = rtstruct_bytes(shape, points)
    without_libraries = predicted["total"] - predicted["libraries"]  # loaded by the first write
    assert measured <= without_libraries <= 1.25 * measured, (measured / 2**20, without_libraries / 2**20)


def test_the_plan_counts_the_dicom_writer_beside_the_label_map() -> None:
    shape, scheme = (30, 64, 64), LabelScheme.plain(13)
    labels = math.prod(shape)  # uint8
    assert LabelWrite().held_bytes(shape, scheme) == 2 * labels  # the label map and SimpleITK's copy
    seg = LabelWrite(output_format="dicom-seg").held_bytes(shape, scheme)
    assert seg == labels + dicom_seg_bytes(shape, 12)["total"]
    assert LabelWrite(output_format="rtstruct").held_bytes(shape, scheme) == labels + rtstruct_bytes(shape)["total"]
    assert LabelWrite(postprocessed=True, output_format="dicom-seg").held_bytes(shape, scheme) > seg


def test_case_memory_counts_the_seg_of_a_dicom_series(prepared: Path, tmp_path: Path) -> None:
    """A DICOM series' plan (its shape from its headers) has the SEG's writer in its export term."""
    from types import SimpleNamespace

    from autoseg.core.workspace import Workspace
    from autoseg.plan.plans import Plans
    from autoseg.predict.pipeline import case_memory

    shape = (20, 40, 36)
    write_dicom_series(tmp_path / "s", np.zeros(shape), UID)
    plans = Plans.from_json(Workspace.at(prepared).plans_path)
    plan = SimpleNamespace(
        host_accumulator_bytes=0, peak_bytes=0, parameter_bytes=0, slab_depth=1, accumulator_device="cpu"
    )
    args = ([Case("s", (tmp_path / "s",), None, series_uid=UID)], plans, plans.configuration("3d_fullres"))
    nifti = case_memory(*args, lambda after: plan, None)
    seg = case_memory(*args, lambda after: plan, None, LabelWrite(output_format="dicom-seg"))
    scheme = plans.label_scheme
    assert nifti["export"] == 2 * math.prod(shape)  # the label map and SimpleITK's copy: the series' shape
    assert seg["export"] == math.prod(shape) + dicom_seg_bytes(shape, len(scheme.names))["total"]
