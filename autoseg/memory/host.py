"""Host RAM of the CPU-side stages, as plain formulas over shapes (bytes; no simulation).

Each function returns its terms and their ``total``; a stage that runs in phases reports each phase and
the ``total`` is the largest. They follow the code they model (``autoseg.preprocess.preprocessor``,
``autoseg.predict.predictor.export_segmentation``) and are meant to be
held against measurements of those modules; where a quantity is not known (the crop, the exact path of
a resampling) they take the larger case.

``WORKER_RUNTIME_BYTES``: RSS of a fresh Python process that imported autoseg.preprocess.preprocessor or
autoseg.data.augment (numpy, scipy, SimpleITK, batchgenerators), measured at about 135-150 MiB. Part of it is
shared libraries, so a sum over many workers over-counts somewhat.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoseg.preprocess.resampling import resampling_peak_bytes

MiB = 1024**2
WORKER_RUNTIME_BYTES = 150 * MiB
_F32, _F64, _I64 = 4, 8, 8


def _voxels(shape: Sequence[int]) -> int:
    if any(int(s) < 1 for s in shape):
        raise ValueError(f"shape {tuple(shape)} must have positive sizes")
    return math.prod(int(s) for s in shape)


def preprocess_worker_bytes(shape_zyx_before: Sequence[int], shape_zyx_after: Sequence[int],
                            num_channels: int) -> dict[str, int]:
    """Peak RAM of one preprocessing worker on one case (``autoseg.preprocess.preprocessor._run_case``).

    ``shape_zyx_before``: the image as read (the crop is taken as the whole image: an upper bound);
    ``shape_zyx_after``: after resampling. Phases, each on top of ``runtime``:
    ``load``: the channels as read plus their stacked copy (C x V x float32, twice) and one reader copy;
    ``crop``: the image and int16 label as read (alive until the case is done) + their cropped copies
    and two bool masks; ``resample_image``: + the float32 output and the spline temporaries
    (``resampling_peak_bytes``); ``resample_seg``: + the resampled image, and the label's resampling
    (int16 output, float32 best score and response, bool buffer, one float32 input-sized mask).
    """
    vb, va, c = _voxels(shape_zyx_before), _voxels(shape_zyx_after), int(num_channels)
    raw = c * vb * _F32 + vb * 2  # image float32 + label int16 as read
    cropped = c * vb * _F32 + vb * 2 + 2 * vb  # copies + mask + "outside" buffer
    seg_temps = resampling_peak_bytes(shape_zyx_before, shape_zyx_after, 1, order=1, order_z=0) - va * _F32
    phases = {
        "load": 2 * c * vb * _F32 + vb * _F32,
        "crop": raw + cropped,
        "resample_image": raw + cropped + resampling_peak_bytes(shape_zyx_before, shape_zyx_after, c),
        "resample_seg": (raw + cropped + c * va * _F32 + va * (2 + _F32 + _F32 + 1) + vb * _F32
                         + max(seg_temps, 0)),
    }
    return {"runtime": WORKER_RUNTIME_BYTES, **phases, "total": WORKER_RUNTIME_BYTES + max(phases.values())}


def export_bytes(shape_zyx_original: Sequence[int], shape_zyx_resampled: Sequence[int],
                 num_classes: int) -> dict[str, int]:
    """RAM of exporting one prediction (``autoseg.predict.predictor.export_segmentation``), streamed per class.

    ``probabilities`` the network's (K, resampled shape) float32 softmax, held throughout;
    ``class_map`` one class resampled to the original shape (float32) and its resampling temporaries;
    ``best_score`` the running maximum (float32); ``compare`` a bool buffer; ``labels`` the running
    argmax and its uncropped copy (uint8, int16 beyond 127 classes). The crop is taken as the whole image.
    """
    vo, vr, k = _voxels(shape_zyx_original), _voxels(shape_zyx_resampled), int(num_classes)
    label_bytes = 1 if k <= 127 else 2
    resample = resampling_peak_bytes(shape_zyx_resampled, shape_zyx_original, 1, order=1, order_z=0)
    terms = {
        "probabilities": k * vr * _F32,
        "class_map": max(resample, vo * _F32),
        "best_score": vo * _F32,
        "compare": vo,
        "labels": 2 * vo * label_bytes,
    }
    terms["total"] = sum(terms.values())
    return terms
