"""Postprocessing of a label map: keep only the largest connected component of all foreground together, then of
each chosen class or region. ``autoseg find-best`` (``autoseg.selection``) decides from cross-validation which of
these steps helps and records them in inference.json (``autoseg.predict.choice``); prediction applies them with
``apply_postprocessing``.

Connected components are those of ``scipy.ndimage.label`` with full connectivity (26 neighbours in 3D, 8 in a 2D
image read as (1, Y, X)), as nnU-Net's (acvl-utils' ``remove_all_but_largest_component``, skimage's default
connectivity); when several components share the largest size, all of them are kept, as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from autoseg.core.errors import InputError
from autoseg.core.units import KiB
from autoseg.dataset.labels import LabelScheme

BINCOUNT_CHUNK = 1 << 16  # voxels counted at a time (512 KiB of int64)
# the count and keep tables (9 bytes a component) and the label lookup: 64 KiB covers ~7000 components (a predicted
# label map has a handful; the test's noise has thousands)
COMPONENT_TABLE_BYTES = 64 * KiB
FOREGROUND = "foreground"  # the name of the step "all foreground classes as one" in the tables


@dataclass(frozen=True)
class Postprocessing:
    """What to do to a predicted label map, in this order:

    - ``largest_foreground_component``: keep only the largest connected component of the voxels of any
      foreground class (or region); the rest become background (0).
    - ``largest_component_of``: foreground class or region names (as in dataset.json); for each, in this
      order, keep only the largest connected component of its voxels (a region: the union of its values);
      the rest become background.

    ``Postprocessing()``: none.
    """

    largest_foreground_component: bool = False
    largest_component_of: tuple[str, ...] = ()

    @property
    def is_identity(self) -> bool:
        return not self.largest_foreground_component and not self.largest_component_of

    def describe(self) -> str:
        steps = (["largest component of all foreground"] if self.largest_foreground_component else []) + [
            f"largest component of {name}" for name in self.largest_component_of
        ]
        return ", then ".join(steps) if steps else "none"


def largest_component_mask(mask: np.ndarray) -> np.ndarray:
    """bool like ``mask``: the voxels of its largest connected component(s) (all of those tied for the largest
    size). Holds an int32 component map (4 bytes a voxel) while it runs: ``largest_component_bytes``."""
    structure = ndimage.generate_binary_structure(mask.ndim, mask.ndim)  # full connectivity
    components, count = ndimage.label(mask, structure=structure)
    if count <= 1:
        return mask.astype(bool, copy=True)
    sizes = np.zeros(count + 1, dtype=np.int64)
    flat = components.reshape(-1)
    for start in range(0, flat.size, BINCOUNT_CHUNK):  # bincount casts to int64: 8 bytes a voxel at once
        sizes += np.bincount(flat[start : start + BINCOUNT_CHUNK], minlength=count + 1)
    sizes[0] = 0  # background
    keep = sizes == sizes.max()  # per component (a table): a lookup costs 1 byte a voxel, np.isin 10 (sorting)
    return keep[components]


def largest_component_bytes(num_voxels: int, label_itemsize: int = 1) -> int:
    """Host bytes ``apply_postprocessing`` holds beside the label map it was given, at its peak: the postprocessed
    copy (``label_itemsize`` bytes a voxel: 1 for ``export_dtype`` up to 255 labels), the class mask (bool) and the
    int32 component map, beside either one chunk of the component count (int64) or, later, the kept mask (bool);
    and the per-component tables (``COMPONENT_TABLE_BYTES``). Held against tracemalloc in
    tests/predict/test_postprocessing.py."""
    return (
        num_voxels * (label_itemsize + 1 + 4)
        + max(num_voxels, min(num_voxels, BINCOUNT_CHUNK) * 8)
        + COMPONENT_TABLE_BYTES
    )


def apply_postprocessing(labels: np.ndarray, postprocessing: Postprocessing, scheme: LabelScheme) -> np.ndarray:
    """``labels`` (Z, Y, X) label values, as exported -> a postprocessed copy (same shape and dtype); the input is
    left unchanged. Unknown class names raise ``InputError`` (an inference.json of another dataset)."""
    check_postprocessing(postprocessing, scheme)
    out = labels.copy()
    if postprocessing.largest_foreground_component:
        values = sorted({v for vs in scheme.foreground_values for v in vs})
        _keep_largest(out, values)
    for name in postprocessing.largest_component_of:
        _keep_largest(out, list(scheme.foreground_values[scheme.names.index(name)]))
    return out


def check_postprocessing(postprocessing: Postprocessing, scheme: LabelScheme) -> None:
    """Raise ``InputError`` when ``postprocessing`` names a class or region ``scheme`` does not have (an
    inference.json of another dataset)."""
    unknown = [name for name in postprocessing.largest_component_of if name not in scheme.names]
    if unknown:
        raise InputError(
            f"postprocessing names {', '.join(map(repr, unknown))}, which is not a foreground class or "
            f"region of these labels ({', '.join(scheme.names)}); run `autoseg find-best` again for "
            "this workspace"
        )


def _keep_largest(labels: np.ndarray, values: list[int]) -> None:
    """Set to 0, in place, the voxels holding any of ``values`` outside their largest connected component."""
    table = np.zeros(max(int(labels.max()), *values) + 1, dtype=bool)  # label value -> in the mask
    table[values] = True
    mask = table[labels]  # 1 byte a voxel (np.isin would sort: ~10)
    outside = largest_component_mask(mask)
    np.logical_not(outside, out=outside)
    outside &= mask
    labels[outside] = 0
