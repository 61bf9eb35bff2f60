"""Peak RSS of writing a DICOM SEG (and an RTSTRUCT) of a predicted label map, measured against the plan (run by hand).

A 300-slice 512 x 512 CT-like series (int16, SimpleITK's series writer, with a Frame of Reference UID) is written
once into a temporary folder. For each scenario a fresh process does what ``autoseg predict --output-format`` does
before and at the write: lists the series (GDCM's scan), imports the writer's libraries (``check_dicom_output``),
holds a label map of 12 structures, then writes it through ``label_writer`` (the series' headers read, the DICOM
object built and saved). Measured: VmHWM during the write minus the RSS just before it (peak reset with clear_refs),
i.e. what writing adds beside the label map; predicted: ``dicom_seg_bytes`` (every segment on every slice, the
plan's bound) or ``rtstruct_bytes`` (with the written contour points), what ``LabelWrite.held_bytes`` adds to the
label map in the prediction's plan (``case_memory``'s export term).

Scenarios: "organs" (12 structures, each an ellipse over 60 of the 300 slices: a realistic SEG whose empty frames are
left out), "worst" (every structure on every slice: the plan's bound reached), "rtstruct" (the organs as an RTSTRUCT).

    python benchmarks/dicom_memory.py [--slices 300] [--size 512] [--structures 12] [--only organs|worst|rtstruct]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SERIES_UID = "1.2.826.0.1.3680043.8.498.9001"
SCENARIOS = ("organs", "worst", "rtstruct")


def write_series(folder: Path, shape_zyx: tuple[int, int, int]) -> None:
    """A CT-like int16 series of ``shape_zyx`` (tests/dicom_series.py's writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dicom_series import write_dicom_series

    voxels = np.random.default_rng(0).integers(-1000, 1000, shape_zyx, dtype=np.int16)
    write_dicom_series(folder, voxels, SERIES_UID, spacing_xyz=(0.8, 0.8, 1.5))


def _status(key: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{key}:")[1].split()[0]) * 1024


def child(folder: Path, scenario: str, structures: int, out: Path) -> dict:
    """What one write adds to the process's RSS beside its label map, and what the plan says it adds."""
    from autoseg.dataset.dicom_write import check_dicom_output, label_writer
    from autoseg.dataset.imageio import dicom_series, read_dicom_series_geometry
    from autoseg.dataset.labels import LabelScheme
    from autoseg.dataset.raw import Case
    from autoseg.memory.host import dicom_seg_bytes, rtstruct_bytes

    case = Case("bench", (folder,), None, series_uid=SERIES_UID)
    output = "rtstruct" if scenario == "rtstruct" else "dicom-seg"
    dicom_series(folder)  # the listing of the inputs scans the folder first
    check_dicom_output([case], output)  # imports highdicom / scikit-image
    geometry = read_dicom_series_geometry(folder, SERIES_UID)
    z, y, x = geometry.shape_zyx
    labels = np.zeros((z, y, x), np.uint8)
    rr, cc = np.mgrid[:y, :x]
    for k in range(structures):  # an ellipse in its band of rows: round outlines, as organs have
        top, bottom = (y * k) // structures, (y * (k + 1)) // structures
        ellipse = ((rr - (top + bottom) / 2) / ((bottom - top) / 2)) ** 2 + ((cc - x / 2) / (0.3 * x)) ** 2 <= 1
        first = (k * (z - z // 5)) // max(structures - 1, 1)
        slices = slice(0, z) if scenario == "worst" else slice(first, first + z // 5)
        labels[slices][:, ellipse] = k + 1
    scheme = LabelScheme.plain(structures + 1)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, start = _status("VmRSS"), time.perf_counter()
    label_writer(case, output)(out, labels, geometry, scheme)
    measured, seconds = _status("VmHWM") - before, time.perf_counter() - start
    if output == "rtstruct":
        import pydicom

        written = pydicom.dcmread(out)
        points = sum(int(c.NumberOfContourPoints) for r in written.ROIContourSequence for c in r.ContourSequence)
        predicted = rtstruct_bytes(labels.shape, points)
    else:
        predicted = dicom_seg_bytes(labels.shape, structures)
    return {
        "scenario": scenario,
        "shape": list(labels.shape),
        "label_map_mib": labels.nbytes / 2**20,
        "measured_mib": measured / 2**20,
        "predicted_mib": predicted["total"] / 2**20,
        "terms_mib": {k: round(v / 2**20, 1) for k, v in predicted.items() if k != "total"},
        "file_mib": out.stat().st_size / 2**20,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=300)
    parser.add_argument("--size", type=int, default=512, help="rows and columns")
    parser.add_argument("--structures", type=int, default=12)
    parser.add_argument("--only", choices=SCENARIOS, default=None)
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "SCENARIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, scenario = Path(args.child[0]), args.child[1]
        print(json.dumps(child(folder, scenario, args.structures, folder.parent / f"{scenario}.dcm")))
        return
    with tempfile.TemporaryDirectory(prefix="autoseg-dicom-memory-") as tmp:
        folder = Path(tmp) / "series"
        write_series(folder, (args.slices, args.size, args.size))
        for scenario in [args.only] if args.only else SCENARIOS:
            run = subprocess.run(
                [sys.executable, __file__, "--child", str(folder), scenario, "--structures", str(args.structures)],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(run.stdout.strip().splitlines()[-1])
            print(
                f"{row['scenario']:8s} {row['shape']}: writing adds {row['measured_mib']:.0f} MiB RSS beside the "
                f"{row['label_map_mib']:.0f} MiB label map, planned {row['predicted_mib']:.0f} MiB "
                f"({row['terms_mib']}); file {row['file_mib']:.0f} MiB, {row['seconds']} s"
            )


if __name__ == "__main__":
    main()
