"""Detection of a class in a case: how many of the reference's connected components the prediction finds.

A reference component is a 26-connected set of the class's voxels (8-connected in a 2D image: the third axis of a
``(1, Y, X)`` array has one voxel, so the same 3x3x3 structure applies); the prediction finds it when its mask of
the class holds at least one of the component's voxels. A prediction that splits a lesion in two finds it once, and
one prediction blob over two reference lesions finds both: the count answers "which lesions would a reader be
pointed to", the question a small-lesion task asks, where Dice is dominated by the large ones. The prediction's
own components are not counted (false-positive detections are the Dice's FP voxels).

Cost: one ``scipy.ndimage.label`` per class over the bounding box of the class in the reference (int32 labels
and bool masks of the box: ``detection_bytes``); a class absent from the reference costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from autoseg.dataset.labels import LabelValue
from autoseg.evaluate.surface import class_mask, union_box

# detection_bytes: per box voxel the reference and prediction masks (bool, 1 + 1), the int32 component labels (4)
# and the prediction's complement (1), or while a mask is built one comparison per value (1); per component the
# box (a tuple of slices) or None that scipy.ndimage.find_objects lists
_BOX_BYTES_PER_VOXEL = 8
_BYTES_PER_COMPONENT = 64


@dataclass(frozen=True)
class Detection:
    components: int  # the reference's connected components of the class
    found: int  # those holding at least one voxel the prediction gives the class


def case_detection(pred: np.ndarray, ref: np.ndarray, classes: dict[str, LabelValue]) -> dict[str, Detection]:
    """Each class's or region's (name -> value, a tuple for a region: the union of its values) detection in one
    case. ``pred`` and ``ref``: non-negative integer label maps of one shape, (Z, Y, X) or (1, Y, X). Reference
    voxels holding the ignore label belong to no class, so they join no component."""
    if pred.shape != ref.shape:
        raise ValueError(f"prediction {pred.shape} and reference {ref.shape} differ in shape")
    ref_boxes = ndimage.find_objects(ref)  # one pass over the reference for every class
    result = {}
    for name, value in classes.items():
        values = (value,) if isinstance(value, int) else tuple(value)
        box = union_box([ref_boxes[v - 1] for v in values if 0 < v <= len(ref_boxes)])
        if box is None:
            result[name] = Detection(0, 0)
            continue
        result[name] = components_found(class_mask(pred[box], values), class_mask(ref[box], values))
    return result


def components_found(pred_mask: np.ndarray, ref_mask: np.ndarray) -> Detection:
    """The 26-connected components of the bool ``ref_mask`` and how many of them the bool ``pred_mask`` (same
    shape) touches."""
    structure = np.ones((3,) * ref_mask.ndim, dtype=bool)
    components, count = ndimage.label(ref_mask, structure=structure)  # int32, the box's shape
    components[~pred_mask] = 0  # what is left of a component is where the prediction touches it
    touched = ndimage.find_objects(components, max_label=count)  # None for a component left empty
    return Detection(int(count), sum(box is not None for box in touched))


def detection_bytes(box_voxels: int, components: int) -> int:
    """Peak bytes one class's detection holds: masks and int32 labels over the class's bounding box in the
    reference (``box_voxels``) and a list entry per reference component (``components``; at most one in 8 box
    voxels, as 26-connected components do not touch), held against tracemalloc in tests/evaluate/test_detection.py."""
    return _BOX_BYTES_PER_VOXEL * box_voxels + _BYTES_PER_COMPONENT * components
