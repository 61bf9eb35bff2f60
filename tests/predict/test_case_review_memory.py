"""What ``--preview`` and ``--statistics`` hold beside a label map: ``CaseReview.held_bytes`` against the peak RSS
of ``CaseReview.case``, and the term it adds to the pipeline's memory plan."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import SimpleITK as sitk

from autoseg.dataset.raw import Case
from autoseg.predict.case_review import CaseReview

MEASURE = """
import sys
from pathlib import Path
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.dataset.imageio import read_image
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case
from autoseg.predict.case_review import CaseReview

folder, preview, statistics = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
labels, geometry = read_image(folder / "labels.nii.gz", dtype=None)
review = CaseReview(folder / "out", LabelScheme.plain(3), ("CT",), preview, statistics)
reset_peak_rss()
before = process_rss_bytes()
review.case(Case("c", (folder / "c_0000.nii.gz",), None), labels, geometry)
print(peak_rss_bytes() - before, review.held_bytes(labels.shape))
"""


def test_the_review_holds_what_held_bytes_says(tmp_path: Path) -> None:
    """A 96 x 256 x 256 case whose structures fill most of it (their boxes are about the image), measured in a fresh
    process whose allocations of 128 KiB and more are mapped (freed pages leave the RSS, as large arrays' do): the
    preview alone and the statistics alone (the larger of the two, with both) are ``held_bytes`` within 10%."""
    shape = (96, 256, 256)
    labels = np.zeros(shape, dtype=np.uint8)
    labels[2:94, 4:252, 4:128], labels[2:94, 4:252, 128:252] = 1, 2
    image = np.broadcast_to(np.arange(256, dtype=np.float32), shape)  # a ramp along x: every percentile differs
    sitk.WriteImage(sitk.GetImageFromArray(labels), str(tmp_path / "labels.nii.gz"))
    sitk.WriteImage(sitk.GetImageFromArray(image), str(tmp_path / "c_0000.nii.gz"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(Path(__file__).parents[2])}
    for flags in (("1", "0"), ("0", "1")):
        run = subprocess.run(
            [sys.executable, "-c", MEASURE, str(tmp_path), *flags], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        measured, predicted = map(int, run.stdout.split()[-2:])
        assert 0.9 * predicted <= measured <= 1.1 * predicted, (flags, measured / 2**20, predicted / 2**20)


def test_the_memory_plan_counts_the_review_beside_the_written_label_map(prepared: Path, tiny_dataset: Path) -> None:
    from autoseg.core.workspace import Workspace
    from autoseg.dataset.imageio import read_geometry
    from autoseg.plan.plans import Plans
    from autoseg.predict.pipeline import LabelWrite, case_memory
    from autoseg.review.statistics import statistics_bytes

    plans = Plans.from_json(Workspace.at(prepared).plans_path)
    image = tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz"
    plan = SimpleNamespace(
        host_accumulator_bytes=0, peak_bytes=0, parameter_bytes=0, slab_depth=1, accumulator_device="cpu"
    )
    args = ([Case("demo_005", (image,), None)], plans, plans.configuration("3d_fullres"), lambda after: plan, None)
    review = CaseReview(Path("out"), plans.label_scheme, plans.channel_names, statistics=True)
    plain, reviewed = case_memory(*args), case_memory(*args, write=LabelWrite(reviewed=review.held_bytes))
    shape = read_geometry(image).shape_zyx
    assert reviewed["export"] == max(plain["export"], math.prod(shape) + statistics_bytes(shape, 1))
    assert reviewed["export"] > plain["export"]
