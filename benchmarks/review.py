"""Time and peak memory of the pictures and statistics (``autoseg.review``) on one large case (run by hand).

The generated 300x512x512 case of ``_cases.make_large_case`` (int16 image, 0.8 x 0.8 x 2.5 mm, 12 organs and the
body) is the reference; the prediction is it shifted by 4 voxels along x. Each measurement runs in a fresh process
(this checkout first on the path) and prints its wall seconds and its peak RSS above the process before it (VmHWM
reset at the start), beside ``picture_bytes``:

- ``error``: ``error_picture`` as ``autoseg evaluate --images`` draws it (the two label maps read, ``read_pair``);
- ``preview``: ``preview_picture`` of the prediction (uint8, held before the measurement) as ``predict --preview``;
- ``statistics``: the image read again (``load_case``) and ``case_statistics`` as ``predict --statistics``.

    python benchmarks/review.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LARGE_SHAPE_ZYX = (300, 512, 512)
SHIFT_X = 4

MEASURE = """
import sys, time
from pathlib import Path
import numpy as np
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.dataset.imageio import read_geometry, read_image
from autoseg.dataset.raw import Case, load_case
from autoseg.evaluate.pictures import read_pair
from autoseg.review.pictures import error_picture, picture_bytes, preview_picture, read_image_slices
from autoseg.review.statistics import case_statistics

what, pred, ref, image = sys.argv[1], *map(Path, sys.argv[2:5])
geometry = read_geometry(ref)
structures = [(v,) for v in range(1, 14)]
slices = lambda point: read_image_slices(image, point, geometry)
held = read_image(pred, dtype=None)[0] if what != "error" else None
reset_peak_rss()
before, start = process_rss_bytes(), time.perf_counter()
if what == "error":
    error_picture(lambda: read_pair(pred, ref), slices, geometry, structures, list(range(1, 14)))
    estimate = picture_bytes(geometry.shape_zyx, 1, 2)
elif what == "preview":
    preview_picture(held, slices, geometry, structures, list(range(1, 14)))
    estimate = picture_bytes(geometry.shape_zyx, 2, 0)
else:
    images = load_case(Case("large", (image,), None))[0]
    case_statistics("large", held, geometry, {str(v): (v,) for (v,) in structures}, images, ("CT",))
    estimate = 0
print(f"{what}: {time.perf_counter() - start:.1f} s, peak {(peak_rss_bytes() - before) / 2**20:.0f} MiB above the "
      f"process" + (f" (picture_bytes {estimate / 2**20:.0f} MiB)" if estimate else ""))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="where the case is written (default: a temp dir)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import numpy as np
    from _cases import make_large_case

    from autoseg.dataset.imageio import read_image, write_image

    root = args.data_dir or Path(tempfile.mkdtemp(prefix="autoseg-review-"))
    folder = make_large_case(root, LARGE_SHAPE_ZYX)
    name = f"{folder.name}_label.nii.gz"
    ref, pred = root / name, root / f"shifted_{name}"
    if not pred.is_file():
        labels, geometry = read_image(ref, dtype=None)
        write_image(pred, np.roll(labels, SHIFT_X, axis=2), geometry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for what in ("error", "preview", "statistics"):
        argv = [sys.executable, "-c", MEASURE, what, str(pred), str(ref), str(folder / "large_0000.nii.gz")]
        print(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.strip())


if __name__ == "__main__":
    main()
