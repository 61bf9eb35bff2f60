"""Time and peak memory of `autoseg evaluate` with and without the surface metrics (HD95, NSD) (run by hand).

Three folders of references, each evaluated against the same labels shifted by 2 voxels along x:

- ``demo``: the demo dataset's training labels (``--demo-cases`` cases of about 32x80x80 voxels);
- ``small_organ``: one 300x512x512 case (0.8 x 0.8 x 2.5 mm) holding a kidney-sized ellipsoid (~80k voxels);
- ``small_organ_and_body``: the same case with a body-sized second class around it (~40 M voxels), the worst
  case for the surface metrics (their bounding box is most of the image).

Each evaluation runs in a fresh process (``python -m autoseg evaluate``, this checkout first on the path);
wall seconds, CPU seconds and peak RSS come from ``os.wait4`` (the kernel's own maximum, not a poll). Then, in
this process, the surface metrics of each class of the large case alone: CPU seconds, the peak of the buffers
numpy allocates (tracemalloc) and ``surface_metrics_bytes``' estimate. ``--compare-edt`` also times the same
distances from ``scipy.ndimage.distance_transform_edt(sampling=spacing)`` (the alternative to the k-d tree).

    python benchmarks/evaluate.py [--data-dir DIR] [--demo-cases 24] [--repeats 3] [--compare-edt]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from autoseg.core.units import MiB
from autoseg.dataset.imageio import Geometry, read_image, write_image
from autoseg.evaluate.surface import case_surface_metrics, surface_distances, surface_metrics_bytes

REPO = Path(__file__).resolve().parents[1]
LARGE_SHAPE_ZYX = (300, 512, 512)
LARGE_SPACING_XYZ = (0.8, 0.8, 2.5)
SHIFT_X = 2


def _ellipsoid_into(label: np.ndarray, value: int, centre: tuple[float, ...], semi_axes: tuple[float, ...]) -> None:
    """Paint ``value`` where the ellipsoid is, slice by slice (no volume-sized float temporary)."""
    y, x = np.ogrid[: label.shape[1], : label.shape[2]]
    for z in range(label.shape[0]):
        dz = ((z - centre[0]) / semi_axes[0]) ** 2
        if dz < 1:
            inside = dz + ((y - centre[1]) / semi_axes[1]) ** 2 + ((x - centre[2]) / semi_axes[2]) ** 2 < 1
            label[z][inside & (label[z] == 0)] = value


def _write_pair(folder: Path, label: np.ndarray, geometry: Geometry) -> None:
    write_image(folder / "gt" / "case.nii.gz", label, geometry)
    write_image(folder / "pred" / "case.nii.gz", np.roll(label, SHIFT_X, axis=-1), geometry)


def make_large(root: Path) -> dict[str, Path]:
    geometry = Geometry(3, tuple(reversed(LARGE_SHAPE_ZYX)), LARGE_SPACING_XYZ, (0.0,) * 3, (1, 0, 0, 0, 1, 0, 0, 0, 1))
    label = np.zeros(LARGE_SHAPE_ZYX, dtype=np.uint8)
    _ellipsoid_into(label, 1, (150, 300, 330), (12, 45, 35))  # kidney-sized: ~80k voxels, 130 ml
    folders = {"small_organ": root / "small_organ", "small_organ_and_body": root / "small_organ_and_body"}
    _write_pair(folders["small_organ"], label, geometry)
    _ellipsoid_into(label, 2, (150, 256, 256), (140, 220, 240))  # body-sized class around it
    _write_pair(folders["small_organ_and_body"], label, geometry)
    return folders


def make_demo(root: Path, cases: int) -> Path:
    from autoseg.demo.data import make_demo_dataset

    dataset = make_demo_dataset(root / "demo_dataset", num_train=cases, num_test=0)
    folder = root / "demo"
    for ref in sorted((dataset / "labelsTr").glob("*.nii.gz")):
        label, geometry = read_image(ref, dtype=np.uint8)
        write_image(folder / "gt" / ref.name, label, geometry)
        write_image(folder / "pred" / ref.name, np.roll(label, SHIFT_X, axis=-1), geometry)
    return folder


def run_evaluate(folder: Path, surface: bool) -> dict[str, float]:
    """One `autoseg evaluate` in a fresh process: wall s, CPU s (user + system), peak RSS bytes."""
    cmd = [
        sys.executable,
        "-m",
        "autoseg",
        "-q",
        "evaluate",
        str(folder / "pred"),
        str(folder / "gt"),
        "-o",
        str(folder / "summary.json"),
        *([] if surface else ["--no-surface"]),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    output = proc.stdout.read() if proc.stdout else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return {
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "table": output,
    }


def surface_alone(folder: Path, repeats: int) -> None:
    """Per class of the case in ``folder``: CPU s (median), traced peak MiB and the estimate, HD95 and NSD."""
    pred, geometry = read_image(folder / "pred" / "case.nii.gz", dtype=np.int16)
    ref, _ = read_image(folder / "gt" / "case.nii.gz", dtype=np.int16)
    spacing_mm = tuple(reversed(geometry.spacing_xyz))
    for value in (1, 2):
        seconds = []
        for _ in range(repeats):
            t0 = time.process_time()
            case_surface_metrics(pred, ref, {"c": value}, spacing_mm, 2.0)
            seconds.append(time.process_time() - t0)
        tracemalloc.start()
        metrics = case_surface_metrics(pred, ref, {"c": value}, spacing_mm, 2.0)["c"]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        z, y, x = np.nonzero((pred == value) | (ref == value))
        box = int(np.prod([np.ptp(a) + 1 for a in (z, y, x)]))
        box_slices = tuple(slice(a.min(), a.max() + 1) for a in (z, y, x))
        to_ref, to_pred = surface_distances(pred[box_slices] == value, ref[box_slices] == value, spacing_mm)
        estimate = surface_metrics_bytes(int(box), len(to_ref) + len(to_pred))
        print(
            f"class {value}: box {box / 1e6:.2f} M voxels, {len(to_ref) + len(to_pred)} surface voxels; "
            f"{np.median(seconds):.2f} CPU s, traced peak {peak / MiB:.0f} MiB (estimate {estimate / MiB:.0f}); "
            f"HD95 {metrics.hd95_mm:.2f} mm, NSD {metrics.nsd:.4f}"
        )


def compare_edt(folder: Path, value: int) -> None:
    """The surface distances of class ``value`` both ways by k-d tree (autoseg's) and by Euclidean distance
    transform of each surface's complement: CPU s, traced peak MiB, largest difference."""
    from scipy import ndimage

    pred, geometry = read_image(folder / "pred" / "case.nii.gz", dtype=np.int16)
    ref, _ = read_image(folder / "gt" / "case.nii.gz", dtype=np.int16)
    box = ndimage.find_objects(np.where((pred == value) | (ref == value), 1, 0).astype(np.uint8))[0]
    pred_mask, ref_mask = pred[box] == value, ref[box] == value
    spacing_mm = tuple(reversed(geometry.spacing_xyz))
    del pred, ref

    def by_edt() -> tuple[np.ndarray, np.ndarray]:
        pred_surface = pred_mask & ~ndimage.binary_erosion(pred_mask)  # the definition, as MONAI computes it
        ref_surface = ref_mask & ~ndimage.binary_erosion(ref_mask)
        to_ref = ndimage.distance_transform_edt(~ref_surface, sampling=spacing_mm)[pred_surface]
        to_pred = ndimage.distance_transform_edt(~pred_surface, sampling=spacing_mm)[ref_surface]
        return to_ref, to_pred

    results = {}
    for name, fn in (("k-d tree", lambda: surface_distances(pred_mask, ref_mask, spacing_mm)), ("EDT", by_edt)):
        tracemalloc.start()
        t0 = time.process_time()
        results[name] = fn()
        seconds = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"class {value} distances by {name}: {seconds:.1f} CPU s, traced peak {peak / MiB:.0f} MiB")
    diff = max(float(np.abs(np.sort(a) - np.sort(b)).max()) for a, b in zip(*results.values(), strict=True))
    print(f"largest difference between the two: {diff:.2e} mm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="where the cases are written (default: a temp dir)")
    parser.add_argument("--demo-cases", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; the medians are reported")
    parser.add_argument("--compare-edt", action="store_true", help="time distance_transform_edt beside the k-d tree")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_dir or Path(tmp)
        folders = {"demo": make_demo(root, args.demo_cases), **make_large(root)}
        print(f"{'cases':<22} {'surface':>7} {'wall s':>7} {'CPU s':>7} {'peak RSS MiB':>12}")
        for name, folder in folders.items():
            for surface in (False, True):
                runs = [run_evaluate(folder, surface) for _ in range(args.repeats)]
                wall, cpu, rss = (
                    float(np.median([r[k] for r in runs])) for k in ("seconds", "cpu_seconds", "peak_rss_bytes")
                )
                print(f"{name:<22} {'yes' if surface else 'no':>7} {wall:7.2f} {cpu:7.2f} {rss / MiB:12.0f}")
            print(runs[-1]["table"].rstrip())
        print("surface metrics alone, in this process:")
        surface_alone(folders["small_organ_and_body"], args.repeats)
        if args.compare_edt:
            compare_edt(folders["small_organ_and_body"], 2)


if __name__ == "__main__":
    main()
