"""Reference datasets: what autoseg plans for well-known public datasets, checked in so a planner change
shows up as a diff.

``plans/reference/<dataset>.json`` holds a summary fingerprint (``ReferenceDataset``) taken from
published dataset descriptions, with a ``source`` per figure. ``to_fingerprint`` turns it into the
planner's input: ``num_training_cases`` identical cases of the median shape and spacing (so the host RAM
figures refer to a median-sized case). ``plans/derived/<dataset>_<N>GiB.json`` are the plans for CUDA
budgets of 8, 24, 40 and 80 GiB, with a fixed host (64 GiB RAM, 16 CPUs) so they do not depend on the
machine that derives them.

    python -m autoseg.plan.reference           # rewrite plans/derived/
    python -m autoseg.plan.reference --check   # compare, exit 1 on a difference
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from autoseg.core.artifacts import Artifact, to_dict
from autoseg.core.units import GiB
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.planner import plan
from autoseg.plan.plans import IntensityProperties, Plans

PLANS_ROOT = Path(__file__).resolve().parents[2] / "plans"
REFERENCE_BUDGETS_GIB = (8, 24, 40, 80)
REFERENCE_HOST_RAM_BYTES = 64 * GiB
REFERENCE_CPU_COUNT = 16


@dataclass(frozen=True)
class ReferenceDataset(Artifact):
    """A dataset summarised by its published figures (median case after cropping to the nonzero region)."""

    SCHEMA_VERSION = 1
    KIND = "reference dataset"

    dataset_name: str
    channel_names: tuple[str, ...]
    labels: dict[str, int]
    num_training_cases: int
    median_shape_zyx: tuple[int, int, int]  # at median_spacing_mm
    median_spacing_mm: tuple[float, float, float]
    foreground_intensity: tuple[IntensityProperties, ...]  # per channel
    median_relative_crop_volume: float = 1.0  # cropped / original volume of the median case
    file_ending: str = ".nii.gz"
    source: dict[str, str] = field(default_factory=dict)  # figure -> where it comes from


def to_fingerprint(ref: ReferenceDataset) -> Fingerprint:
    """The planner's input: ``num_training_cases`` identical median cases."""
    original = tuple(int(round(s / ref.median_relative_crop_volume ** (1 / 3))) for s in ref.median_shape_zyx)
    case = CaseFingerprint(
        case_id="",
        spacing_mm=tuple(ref.median_spacing_mm),
        shape_zyx=original,
        cropped_shape_zyx=tuple(ref.median_shape_zyx),
        class_voxels=(0,) * len(ref.labels),
    )
    cases = tuple(
        CaseFingerprint(f"case_{i:04d}", case.spacing_mm, case.shape_zyx, case.cropped_shape_zyx, case.class_voxels)
        for i in range(ref.num_training_cases)
    )
    return Fingerprint(
        dataset_name=ref.dataset_name,
        channel_names=tuple(ref.channel_names),
        labels=dict(ref.labels),
        file_ending=ref.file_ending,
        image_dim=3,
        cases=cases,
        foreground_intensity=tuple(ref.foreground_intensity),
        median_relative_crop_volume=ref.median_relative_crop_volume,
    )


def reference_budget(gib: int) -> Budget:
    return Budget(
        gpu_memory_bytes=gib * GiB,
        host_ram_bytes=REFERENCE_HOST_RAM_BYTES,
        device="cuda",
        cpu_count=REFERENCE_CPU_COUNT,
    )


def load_references(root: Path = PLANS_ROOT) -> dict[str, ReferenceDataset]:
    paths = sorted((root / "reference").glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no reference fingerprints in {root / 'reference'}")
    return {p.stem: ReferenceDataset.from_json(p) for p in paths}


def derived_path(root: Path, name: str, gib: int) -> Path:
    return root / "derived" / f"{name}_{gib}GiB.json"


def derive(ref: ReferenceDataset, gib: int) -> Plans:
    return plan(to_fingerprint(ref), reference_budget(gib))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoseg.plan.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in plans instead")
    parser.add_argument("--root", default=str(PLANS_ROOT), help="the plans/ folder")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(REFERENCE_BUDGETS_GIB), help="GiB")
    args = parser.parse_args(argv)
    root = Path(args.root)
    differ = []
    for name, ref in load_references(root).items():
        for gib in args.budgets:
            t0 = time.perf_counter()
            plans, path = derive(ref, gib), derived_path(root, name, gib)
            if args.check:
                if not path.is_file() or to_dict(Plans.from_json(path)) != to_dict(plans):
                    differ.append(path)
            else:
                plans.to_json(path)
            summary = ", ".join(f"{n} {c.patch_size} x{c.batch_size}" for n, c in plans.configurations.items())
            print(f"{name} {gib} GiB: {summary} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for path in differ:
        print(f"differs: {path}", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
