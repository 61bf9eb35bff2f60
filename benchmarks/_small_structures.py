"""Generated two-channel CT/PET-like cases with thin branching tubes and small lesions (issue 28), in nnU-Net's raw
layout: a training set (imagesTr/labelsTr) and held-out cases (imagesTs/labelsTs).

Each case is a body ellipsoid (about 40 HU, air -1000 HU outside) running through the whole stack, holding:

- one large organ (label 1): an ellipsoid, brighter on both channels;
- ``trees`` branching tubes (label 2, "tubes"): a root segment from a random point inside the body, each segment
  splitting into two children turned 30-60 degrees either way in-plane, ``tree_depth`` levels; a segment runs
  ``segment_vox`` in-plane voxels and a few slices up or down. Rasterised in voxel space, so their width is exact
  whatever the spacing: a segment of width w paints a w x w in-plane block (w = 3: a plus, corners left out) at each
  point of its centre line, one slice thick, the root ``tube_width_vox[1]`` wide and each level one voxel narrower
  down to ``tube_width_vox[0]``; contrast-enhanced on CT (200 HU), blood-pool uptake on PET;
- ``lesions`` small spheres (the last label, "lesions") of ``lesion_mm`` diameters, centred on a slice so the
  centre slice holds their full diameter, most inside the organ; slightly darker than the organ on CT, bright on
  PET (SUV 5-10). A lesion never touches a tube or another lesion (26-neighbourhood), so each is one component.

Channel 0 (CT) carries a smooth texture and Gaussian noise (int16 HU); channel 1 (PET) is the uptake blurred by
about a millimetre with multiplicative gamma noise inside the body (float32). Spacing varies per case: in-plane
``inplane_mm`` +-5%, z uniform in ``z_mm``; sizes +-8% around ``shape_zyx``. Case ``i`` depends only on
``np.random.default_rng([seed, i])``: the same seed gives the same bytes.

``PRESETS``: ``small-structures`` (the issue's dataset) and ``slabs`` (a dataset of different character: few thick
slices of 224x224, no tubes, large lesions: a 2D-like volume where the organ and lesions are large).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from _cases import case_geometry, ellipsoid, jittered_shape
from scipy import ndimage

FILE_ENDING = ".nii.gz"
AIR_HU, BODY_HU, ORGAN_HU, TEXTURE_HU = -1000.0, 40.0, 90.0, 6.0
BODY_SUV, ORGAN_SUV, TUBE_SUV = 1.0, 2.0, 1.6
PET_BLUR_VOX = (0.3, 1.0, 1.0)  # (z, y, x) sigma: about 1 mm in-plane, as a reconstructed PET after resampling
PET_NOISE_SHAPE = 16.0  # gamma shape of the multiplicative noise: mean 1, coefficient of variation 0.25
CHILD_TURN_DEG = (30.0, 60.0)  # each child turns this far from its parent, one left, one right
TUBE_SLOPE = 0.08  # slices per in-plane voxel at most: a 30-voxel segment climbs up to 2.4 slices
LESION_IN_ORGAN = 0.6  # share of lesion centres drawn inside the organ


@dataclass(frozen=True)
class StructureOptions:
    """What a generated dataset holds; every range is (low, high), drawn per case (per segment, per lesion)."""

    shape_zyx: tuple[int, int, int] = (50, 160, 160)
    inplane_mm: float = 0.8
    z_mm: tuple[float, float] = (3.0, 5.0)
    trees: int = 3  # branching tube trees per case; 0: no tubes label
    tree_depth: int = 4  # levels: a tree has up to 2**depth - 1 segments
    segment_vox: tuple[float, float] = (12.0, 28.0)  # a segment's in-plane length in voxels
    tube_width_vox: tuple[int, int] = (1, 3)  # the narrowest (leaves) and widest (root) segment, in voxels
    lesions: tuple[int, int] = (2, 5)  # lesions per case; (0, 0): no lesions label
    lesion_mm: tuple[float, float] = (3.0, 10.0)  # lesion diameters
    # contrast: near the floor a model must learn from, so that thin and small structures take many iterations
    tube_hu: float = 120.0  # the tubes on CT (the body is 40 HU)
    lesion_below_organ_hu: float = 20.0  # lesions are hypodense on CT: visible inside the organ, hardly outside it
    lesion_suv: tuple[float, float] = (3.0, 6.0)  # lesion uptake on PET (the organ 2, the body 1)
    noise_hu: float = 20.0  # CT noise, Gaussian, per voxel
    # CT partial volume: the tissue map blurred (sigma in voxels, z y x) before texture and noise; a 1-voxel tube
    # keeps about 60% of its contrast at 0.6 voxels in-plane
    ct_blur_vox: tuple[float, float, float] = (0.3, 0.6, 0.6)


# the contrasts of the first version (commit a75ec1d): tubes at 13 noise sigmas, every target met in 30 minutes
EASY_CONTRAST = {
    "tube_hu": 200.0,
    "lesion_below_organ_hu": 30.0,
    "lesion_suv": (5.0, 10.0),
    "noise_hu": 12.0,
    "ct_blur_vox": (0.0, 0.0, 0.0),
}
PRESETS = {
    "small-structures": StructureOptions(),
    "small-structures-easy": StructureOptions(**EASY_CONTRAST),
    "slabs": StructureOptions(
        shape_zyx=(16, 224, 224), z_mm=(6.0, 8.0), trees=0, lesions=(1, 3), lesion_mm=(15.0, 30.0)
    ),
}


@dataclass(frozen=True)
class StructureCase:
    """One generated case, arrays (Z, Y, X)."""

    ct_zyx: np.ndarray  # int16 HU
    pet_zyx: np.ndarray  # float32 SUV
    label_zyx: np.ndarray  # uint8, values as in ``label_values``
    spacing_zyx_mm: tuple[float, float, float]
    branch_points_zyx: tuple[tuple[float, float, float], ...]  # where a tube splits in two (voxel coordinates)
    lesion_diameters_mm: tuple[float, ...]


def label_values(options: StructureOptions) -> dict[str, int]:
    """dataset.json's labels: background 0, organ 1, then tubes and lesions where the options draw them."""
    names = ["background", "organ"] + ["tubes"] * (options.trees > 0) + ["lesions"] * (options.lesions[1] > 0)
    return {name: value for value, name in enumerate(names)}


def make_structures_dataset(
    root: Path, name: str, options: StructureOptions, counts: tuple[int, int], seed: int
) -> Path:
    """``Dataset028_<name>...`` under ``root``: ``counts`` = (training, held-out) cases, generated once per
    (options, counts, seed); a ``.complete`` marker holding them says it is whole."""
    from autoseg.dataset.imageio import write_image

    num_train, num_test = counts
    tag = json.dumps({"options": asdict(options), "counts": counts, "seed": seed}, sort_keys=True)
    shape = "x".join(map(str, options.shape_zyx))
    dataset = root / f"Dataset028_{name.title().replace('-', '')}_{num_train}p{num_test}x{shape}_s{seed}"
    if (dataset / ".complete").is_file() and (dataset / ".complete").read_text() == tag:
        return dataset
    t0 = time.perf_counter()
    for index in range(num_train + num_test):
        images, labels = ("imagesTr", "labelsTr") if index < num_train else ("imagesTs", "labelsTs")
        case = synthesize_case(options, seed, index)
        geometry = case_geometry(case.label_zyx.shape, case.spacing_zyx_mm[::-1])
        case_id = f"struct_{index:03d}"
        write_image(dataset / images / f"{case_id}_0000{FILE_ENDING}", case.ct_zyx, geometry)
        write_image(dataset / images / f"{case_id}_0001{FILE_ENDING}", case.pet_zyx, geometry)
        write_image(dataset / labels / f"{case_id}{FILE_ENDING}", case.label_zyx, geometry)
    meta = {
        "name": name,
        "description": f"generated by benchmarks/_small_structures.py (seed {seed}): {asdict(options)}",
        "channel_names": {"0": "CT", "1": "PET"},
        "labels": label_values(options),
        "numTraining": num_train,
        "numTest": num_test,
        "file_ending": FILE_ENDING,
    }
    (dataset / "dataset.json").write_text(json.dumps(meta, indent=2))
    (dataset / ".complete").write_text(tag)
    print(f"generated {num_train} + {num_test} {name} cases in {time.perf_counter() - t0:.0f} s: {dataset}")
    return dataset


def synthesize_case(options: StructureOptions, seed: int, index: int) -> StructureCase:
    """Case ``index`` of the dataset with ``seed``; depends on nothing else."""
    rng = np.random.default_rng([seed, index])
    shape = jittered_shape(rng, options.shape_zyx)
    inplane = options.inplane_mm * rng.uniform(0.95, 1.05)
    spacing = (float(rng.uniform(*options.z_mm)), inplane, inplane)
    coords = tuple((np.arange(n) + 0.5 - n / 2) * s for n, s in zip(shape, spacing, strict=True))
    half_mm = np.array(shape) * spacing / 2
    body_semi = half_mm * np.array([1.2, *rng.uniform(0.80, 0.90, size=2)])  # through the whole stack
    body = ellipsoid(coords, np.zeros(3), body_semi)
    organ_semi = body_semi * np.array([0.6, *rng.uniform(0.35, 0.45, size=2)])
    organ_centre = body_semi * np.array([0.0, *rng.uniform(-0.25, 0.25, size=2)])
    label_of = label_values(options)
    label = np.zeros(shape, np.uint8)
    label[ellipsoid(coords, organ_centre, organ_semi) & body] = label_of["organ"]
    inner_body = ellipsoid(coords, np.zeros(3), body_semi - 3 * np.array(spacing))  # 3 voxels inside the body
    tubes, branches = draw_tubes(rng, inner_body, options)
    if options.trees:
        label[tubes] = label_of["tubes"]
    organ = label == label_of["organ"]
    lesions, diameters = draw_lesions(rng, (organ, tubes), coords, inner_body, options)
    if options.lesions[1]:
        label[lesions > 0] = label_of["lesions"]
    ct, pet = _channels(rng, (label, body, lesions), label_of, options)
    return StructureCase(ct, pet, label, spacing, branches, diameters)


def draw_tubes(
    rng: np.random.Generator, inside: np.ndarray, options: StructureOptions
) -> tuple[np.ndarray, tuple[tuple[float, float, float], ...]]:
    """bool (Z, Y, X) mask of ``options.trees`` branching trees kept within ``inside``, and their branch points."""
    mask = np.zeros(inside.shape, bool)
    branches: list[tuple[float, float, float]] = []
    centre = np.array(inside.shape) / 2
    candidates = np.argwhere(inside)  # roots start in the middle third of the body, in-plane and in z
    candidates = candidates[np.all(np.abs(candidates - centre) < np.array(inside.shape) / 6, axis=1)]
    for _ in range(options.trees):
        start = candidates[rng.integers(len(candidates))].astype(float)
        _grow(rng, mask, inside, options, (start, rng.uniform(0, 2 * np.pi), 0), branches)
    return mask, tuple(branches)


def _grow(
    rng: np.random.Generator,
    mask: np.ndarray,
    inside: np.ndarray,
    options: StructureOptions,
    seed_point: tuple[np.ndarray, float, int],
    branches: list[tuple[float, float, float]],
) -> float:
    """Paint one segment from ``seed_point`` = (start zyx, in-plane angle, level), then its two children; returns
    the segment's in-plane length in voxels. A segment stops where it would leave ``inside``; one cut to under half
    the shortest length has no children, and a branch point is recorded where both children reach that length
    (so each recorded branch point has three arms at least that long)."""
    start, angle, level = seed_point
    step = np.array([rng.uniform(-TUBE_SLOPE, TUBE_SLOPE), np.sin(angle), np.cos(angle)])
    points = start + np.arange(0, rng.uniform(*options.segment_vox), 0.25)[:, None] * step  # 4 per voxel
    rounded = np.rint(points).astype(int)
    within = np.all((rounded >= 0) & (rounded < np.array(inside.shape)), axis=1)
    within[within] = inside[tuple(rounded[within].T)]
    kept = points[: len(points) if within.all() else int(np.argmin(within))]  # up to the first point outside
    _paint(mask, kept, max(options.tube_width_vox[0], options.tube_width_vox[1] - level))
    length, shortest = len(kept) * 0.25, options.segment_vox[0] / 2
    if level + 1 >= options.tree_depth or length < shortest:
        return length
    arms = [
        _grow(
            rng,
            mask,
            inside,
            options,
            (kept[-1], angle + side * np.radians(rng.uniform(*CHILD_TURN_DEG)), level + 1),
            branches,
        )
        for side in (-1, 1)
    ]
    if min(arms) >= shortest:
        branches.append(tuple(float(v) for v in kept[-1]))
    return length


def _paint(mask: np.ndarray, points: np.ndarray, width: int) -> None:
    """Set a ``width`` x ``width`` in-plane block (a plus for width 3) at each point, on the point's slice."""
    if not len(points):
        return
    corner = np.floor(points[:, 1:] - (width - 1) / 2 + 0.5).astype(int)  # the block's first row and column
    offsets = [(dy, dx) for dy in range(width) for dx in range(width)]
    if width == 3:
        offsets = [(dy, dx) for dy, dx in offsets if (dy - 1) * (dx - 1) == 0]  # the plus: corners left out
    z = np.rint(points[:, 0]).astype(int)
    for dy, dx in offsets:
        y, x = corner[:, 0] + dy, corner[:, 1] + dx
        keep = (y >= 0) & (y < mask.shape[1]) & (x >= 0) & (x < mask.shape[2])
        mask[z[keep], y[keep], x[keep]] = True


def draw_lesions(
    rng: np.random.Generator,
    organ_and_tubes: tuple[np.ndarray, np.ndarray],
    coords: tuple[np.ndarray, ...],
    inside: np.ndarray,
    options: StructureOptions,
) -> tuple[np.ndarray, tuple[float, ...]]:
    """uint8 (Z, Y, X) map of lesion ids 1..n (0 elsewhere) and their diameters in mm: spheres centred on a slice,
    within ``inside``, most in the organ (bool mask), not touching the tubes (bool mask) or one another
    (26-neighbourhood)."""
    organ, tubes = organ_and_tubes
    count = int(rng.integers(options.lesions[0], options.lesions[1] + 1))
    lesions = np.zeros(organ.shape, np.uint8)
    forbidden = ndimage.binary_dilation(tubes, structure=np.ones((3, 3, 3), bool))
    pools = (np.argwhere(organ & inside), np.argwhere(inside))  # organ voxels, body voxels
    diameters: list[float] = []
    for _ in range(50 * max(count, 1)):  # tries
        if len(diameters) == count:
            break
        pool = pools[0] if rng.uniform() < LESION_IN_ORGAN and len(pools[0]) else pools[1]
        centre_index = pool[rng.integers(len(pool))]
        diameter = float(rng.uniform(*options.lesion_mm))
        placed = _place_sphere(lesions, forbidden, coords, inside, (centre_index, diameter, rng.uniform(-0.5, 0.5, 2)))
        if placed:
            diameters.append(diameter)
            lesions[placed[0]][placed[1]] = len(diameters)
            grown = ndimage.binary_dilation(np.pad(placed[1], 1), structure=np.ones((3, 3, 3), bool))
            padded = tuple(slice(s.start - 1, s.stop + 1) for s in placed[0])
            forbidden[padded] |= grown
    return lesions, tuple(diameters)


def _place_sphere(
    lesions: np.ndarray,
    forbidden: np.ndarray,
    coords: tuple[np.ndarray, ...],
    inside: np.ndarray,
    candidate: tuple[np.ndarray, float, np.ndarray],
) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """The (box, bool mask) of a sphere of ``candidate`` = (centre voxel, diameter mm, in-plane shift in voxels),
    or None where it would leave ``inside`` or the array's inner margin, or touch ``forbidden``."""
    index, diameter, shift = candidate
    spacing = [float(c[1] - c[0]) for c in coords]
    centre_mm = np.array([coords[a][index[a]] + (shift[a - 1] * spacing[a] if a else 0.0) for a in range(3)])
    reach = [int(np.ceil(diameter / 2 / s)) + 1 for s in spacing]
    box = tuple(slice(int(i) - r, int(i) + r + 1) for i, r in zip(index, reach, strict=True))
    if any(b.start < 1 or b.stop > n - 1 for b, n in zip(box, lesions.shape, strict=True)):
        return None
    mask = ellipsoid(tuple(c[b] for c, b in zip(coords, box, strict=True)), centre_mm, np.full(3, diameter / 2))
    if not mask.any() or (mask & (forbidden[box] | ~inside[box])).any():
        return None
    return box, mask


def _channels(
    rng: np.random.Generator,
    maps: tuple[np.ndarray, np.ndarray, np.ndarray],
    label_of: dict[str, int],
    options: StructureOptions,
) -> tuple[np.ndarray, np.ndarray]:
    """(CT int16 HU, PET float32 SUV) of ``maps`` = (label map, body mask, lesion ids): tissue values, CT partial
    volume, texture and noise, PET blur and noise."""
    label, body, lesions = maps
    organ, tubes = label == label_of["organ"], label == label_of.get("tubes", -1)
    ct = np.where(body, BODY_HU, AIR_HU).astype(np.float32)
    ct[organ], ct[tubes] = ORGAN_HU, options.tube_hu
    ct[lesions > 0] = ORGAN_HU - options.lesion_below_organ_hu
    if any(options.ct_blur_vox):
        ct = ndimage.gaussian_filter(ct, sigma=options.ct_blur_vox)
    texture = ndimage.gaussian_filter(rng.standard_normal(label.shape, dtype=np.float32), sigma=(0.5, 2.0, 2.0))
    ct += body * texture * (TEXTURE_HU / max(float(texture.std()), 1e-6))
    ct += rng.standard_normal(label.shape, dtype=np.float32) * np.float32(options.noise_hu)
    suv = body * np.float32(BODY_SUV)
    suv[organ], suv[tubes] = ORGAN_SUV, TUBE_SUV
    lesion_suv = np.concatenate([[0.0], rng.uniform(*options.lesion_suv, size=int(lesions.max()))]).astype(np.float32)
    suv = np.where(lesions > 0, lesion_suv[lesions], suv)
    noise = rng.gamma(PET_NOISE_SHAPE, 1 / PET_NOISE_SHAPE, size=label.shape).astype(np.float32)
    pet = ndimage.gaussian_filter(suv, sigma=PET_BLUR_VOX) * noise * body
    return np.clip(ct, -1024, 3000).astype(np.int16), pet.astype(np.float32)
