"""A synthetic 3D dataset in the nnU-Net raw layout, for ``autoseg demo`` and for tests.

Each case is an MRI-like volume: a "body" ellipsoid (exact zeros outside it, so crop-to-nonzero has
something to crop), an "organ" ellipsoid inside the body (label 1) and a small bright "lesion" sphere
inside the organ (label 2, replacing the organ label there). Inside the body the image carries a smooth
texture, Gaussian noise and a smooth multiplicative bias field; a global gain per case mimics MRI's
arbitrary intensity scale. Spacing is anisotropic (z about 2.6-2.9 mm, in-plane about 0.85-0.95 mm) and
size, spacing and origin vary a little per case, so resampling and cropping are exercised.

Every case is derived from ``np.random.default_rng([seed, case_index])`` alone, so one case can be
regenerated without the others (``synthesize_case``). Training cases use indices ``0..num_train-1`` and
the held-out cases the indices after them, so the ids ``demo_000, demo_001, ...`` never repeat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.ndimage import gaussian_filter

from autoseg.core.artifacts import write_json
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry, write_image

DEMO_DATASET_NAME = "AutosegDemo"
FILE_ENDING = ".nii.gz"
LABEL_NAMES = ("background", "organ", "lesion")
DEFAULT_SHAPE_ZYX = (32, 80, 80)

# Nominal spacing in mm, jittered by +-5% per case (one in-plane value for y and x).
SPACING_Z_MM = 2.75
SPACING_INPLANE_MM = 0.9
# Tissue intensities before texture, bias field, noise and gain (arbitrary units), each jittered +-5%.
BODY_MEAN = 100.0
ORGAN_MEAN = 160.0
LESION_MEAN = 230.0
NOISE_STD = 8.0  # about 13% of the organ/body contrast (60) and 11% of the lesion/organ contrast (70)
TEXTURE_STD = 4.0
BIAS_MAX_FRACTION = 0.15  # the bias field stays within 1 +- 0.15 inside the body
LESION_RADIUS_MM = (4.0, 6.0)  # 3-4 slices across in z, 9-13 voxels in-plane


@dataclass(frozen=True)
class DemoCase:
    """One synthetic case, arrays in (Z, Y, X) order with shape ``geometry.shape_zyx``."""

    case_id: str
    image_zyx: np.ndarray  # float32, exactly 0 outside the body, >= 1 inside
    label_zyx: np.ndarray  # uint8, 0 background, 1 organ, 2 lesion (when num_label_values == 3)
    body_zyx: np.ndarray  # bool, the body mask (the image's nonzero region)
    geometry: Geometry


def case_id_for(case_index: int) -> str:
    return f"demo_{case_index:03d}"


def make_demo_dataset(
    out_dir: str | Path,
    num_train: int = 24,
    num_test: int = 6,
    shape_zyx: tuple[int, int, int] = DEFAULT_SHAPE_ZYX,
    seed: int = 0,
    num_label_values: int = 3,
) -> Path:
    """Write a synthetic dataset in the nnU-Net raw layout to ``out_dir`` and return that path.

    Writes ``imagesTr/{case}_0000.nii.gz`` and ``labelsTr/{case}.nii.gz`` for ``num_train`` cases,
    ``imagesTs/`` and ``labelsTs/`` (ground truth for evaluation) for ``num_test`` held-out cases, and
    ``dataset.json`` last. ``shape_zyx`` is the nominal image size (each case varies by up to +-10% per
    axis). ``num_label_values`` is 3 (background, organ, lesion) or 2 (background, organ; no lesion drawn).

    ``out_dir`` must be empty, missing, or a previous demo dataset (whose case files are replaced).
    """
    _check_args(num_train, num_test, shape_zyx, num_label_values)
    out = Path(out_dir).expanduser()
    _prepare_folder(out)
    for case_index in range(num_train + num_test):
        case = synthesize_case(seed, case_index, shape_zyx, num_label_values)
        images, labels = ("imagesTr", "labelsTr") if case_index < num_train else ("imagesTs", "labelsTs")
        write_image(out / images / f"{case.case_id}_0000{FILE_ENDING}", case.image_zyx, case.geometry)
        write_image(out / labels / f"{case.case_id}{FILE_ENDING}", case.label_zyx, case.geometry)
    meta = {
        "name": DEMO_DATASET_NAME,
        "description": f"synthetic body/organ/lesion volumes from autoseg.demo.data (seed {seed})",
        "channel_names": {"0": "MRI"},
        "labels": {name: value for value, name in enumerate(LABEL_NAMES[:num_label_values])},
        "numTraining": num_train,
        "numTest": num_test,
        "file_ending": FILE_ENDING,
    }
    write_json(out / "dataset.json", meta)
    return out


def synthesize_case(
    seed: int,
    case_index: int,
    shape_zyx: tuple[int, int, int] = DEFAULT_SHAPE_ZYX,
    num_label_values: int = 3,
) -> DemoCase:
    """Generate case ``case_index`` of the dataset with ``seed``; depends on nothing else."""
    _check_args(1, 0, shape_zyx, num_label_values)
    rng = np.random.default_rng([seed, case_index])
    size_zyx = tuple(max(8, round(n * rng.uniform(0.9, 1.1))) for n in shape_zyx)
    inplane_mm = SPACING_INPLANE_MM * rng.uniform(0.95, 1.05)
    spacing_zyx = (SPACING_Z_MM * rng.uniform(0.95, 1.05), inplane_mm, inplane_mm)
    origin_xyz = tuple(float(v) for v in rng.uniform(-200.0, 0.0, size=3))
    # Physical coordinates (mm) of the voxel centres, relative to the image centre, per axis.
    coords_mm = [(np.arange(n) + 0.5 - n / 2) * s for n, s in zip(size_zyx, spacing_zyx, strict=True)]
    half_extent_mm = np.array([n * s / 2 for n, s in zip(size_zyx, spacing_zyx, strict=True)])

    # Body: its bounding box stays within 85% of the field of view, leaving zero voxels on every face.
    body_semi = half_extent_mm * rng.uniform(0.68, 0.80, size=3)
    body_centre = rng.uniform(-1.0, 1.0, size=3) * (0.85 * half_extent_mm - body_semi)
    body = _ellipsoid(coords_mm, body_centre, body_semi)
    # Organ: (|offset| + semi-axis) <= 0.57 body semi-axis per axis keeps the organ's box inside the body.
    organ_ratio = rng.uniform(0.35, 0.50, size=3)
    organ_semi = organ_ratio * body_semi
    organ_centre = body_centre + rng.uniform(-1.0, 1.0, size=3) * (0.57 - organ_ratio) * body_semi
    organ = _ellipsoid(coords_mm, organ_centre, organ_semi) & body

    label = organ.astype(np.uint8)
    lesion_radius_mm = min(rng.uniform(*LESION_RADIUS_MM), 0.6 * float(organ_semi.min()))
    direction = rng.standard_normal(3)
    lesion_offset = direction / np.linalg.norm(direction) * rng.uniform() ** (1 / 3)  # uniform in a ball
    lesion_centre = organ_centre + lesion_offset * np.maximum(organ_semi - lesion_radius_mm, 0.0)
    if num_label_values == 3:
        lesion = _lesion_mask(coords_mm, lesion_centre, lesion_radius_mm, organ)
        label[lesion] = 2

    means = np.array([0.0, ORGAN_MEAN, LESION_MEAN]) * rng.uniform(0.95, 1.05, size=3)
    means[0] = BODY_MEAN * rng.uniform(0.95, 1.05)  # label 0 inside the body is body tissue
    texture = gaussian_filter(rng.standard_normal(size_zyx), sigma=(1.0, 3.0, 3.0))
    texture *= TEXTURE_STD / max(float(texture.std()), 1e-6)
    bias = _bias_field(rng, coords_mm, half_extent_mm, body)
    noise = rng.standard_normal(size_zyx) * NOISE_STD * rng.uniform(0.9, 1.1)
    gain = rng.uniform(0.8, 1.25)
    tissue = (means[label] + texture) * bias + noise
    image = np.where(body, np.maximum(tissue * gain, 1.0), 0.0).astype(np.float32)

    geometry = Geometry(
        ndim=3,
        size_xyz=tuple(int(n) for n in reversed(size_zyx)),
        spacing_xyz=tuple(float(s) for s in reversed(spacing_zyx)),
        origin_xyz=origin_xyz,
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )
    return DemoCase(case_id_for(case_index), image, label, body, geometry)


def _ellipsoid(coords_mm: list[np.ndarray], centre_mm: np.ndarray, semi_axes_mm: np.ndarray) -> np.ndarray:
    """Boolean (Z, Y, X) mask of an axis-aligned ellipsoid, evaluated at the voxel centres."""
    z, y, x = ((c - c0) / a for c, c0, a in zip(coords_mm, centre_mm, semi_axes_mm, strict=True))
    return (z[:, None, None] ** 2 + y[None, :, None] ** 2 + x[None, None, :] ** 2) <= 1.0


def _lesion_mask(coords_mm: list[np.ndarray], centre_mm: np.ndarray, radius_mm: float, organ: np.ndarray) -> np.ndarray:
    """Sphere inside the organ; never empty (falls back to the organ voxel nearest the centre)."""
    lesion = _ellipsoid(coords_mm, centre_mm, np.full(3, radius_mm)) & organ
    if not lesion.any():
        z, y, x = ((c - c0) ** 2 for c, c0 in zip(coords_mm, centre_mm, strict=True))
        dist2 = np.where(organ, z[:, None, None] + y[None, :, None] + x[None, None, :], np.inf)
        lesion.flat[int(np.argmin(dist2))] = True
    return lesion


def _bias_field(
    rng: np.random.Generator, coords_mm: list[np.ndarray], half_extent_mm: np.ndarray, body: np.ndarray
) -> np.ndarray:
    """Smooth multiplicative field (Z, Y, X): a random quadratic polynomial, 1 +- at most 15% in the body."""
    z, y, x = (c / h for c, h in zip(coords_mm, half_extent_mm, strict=True))  # in [-1, 1]
    z, y, x = z[:, None, None], y[None, :, None], x[None, None, :]
    terms = (z, y, x, z * z, y * y, x * x, z * y, z * x, y * x)
    coefficients = rng.standard_normal(len(terms))
    poly = sum(c * t for c, t in zip(coefficients, terms, strict=True)) * np.ones(body.shape)
    poly -= poly[body].mean()
    amplitude = rng.uniform(0.5, 1.0) * BIAS_MAX_FRACTION
    return 1.0 + amplitude * poly / max(float(np.abs(poly[body]).max()), 1e-6)


def _check_args(num_train: int, num_test: int, shape_zyx: tuple[int, ...], num_label_values: int) -> None:
    if num_train < 1 or num_test < 0:
        raise InputError(f"need num_train >= 1 and num_test >= 0; got num_train={num_train}, num_test={num_test}")
    if len(shape_zyx) != 3 or min(shape_zyx) < 8:
        raise InputError(f"shape_zyx must be 3 sizes of at least 8 voxels (z, y, x); got {tuple(shape_zyx)}")
    if num_label_values not in (2, 3):
        raise InputError(f"num_label_values must be 2 (background, organ) or 3 (+ lesion); got {num_label_values}")


def _prepare_folder(out: Path) -> None:
    """Accept a missing or empty folder, or a previous demo dataset (its demo_* case files are removed)."""
    if not out.exists() or not any(out.iterdir()):
        return
    meta_path = out / "dataset.json"
    try:
        is_demo = json.loads(meta_path.read_text()).get("name") == DEMO_DATASET_NAME
    except (OSError, json.JSONDecodeError, AttributeError):
        is_demo = False
    if not is_demo:
        raise InputError(
            f"{out}: folder is not empty and is not an autoseg demo dataset; "
            "pass a new or empty folder for the demo data"
        )
    meta_path.unlink()  # written again last, so an interrupted run leaves no dataset.json behind
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        if (out / sub).is_dir():
            for f in (out / sub).glob("demo_*"):
                f.unlink()
