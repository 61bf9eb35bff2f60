"""Host RAM of the CPU-side stages, as plain formulas over shapes (bytes; no simulation).

Each function returns its terms and their ``total``; a stage that runs in phases reports each phase and
the ``total`` is the largest. They follow the code they model (``autoseg.preprocess.preprocessor``,
``autoseg.predict.export``) and are meant to be held against measurements of those modules; where a quantity is
not known (the crop, the exact path of a resampling) they take the larger case. The resampling terms
(``resampling_peak_bytes``, ``segmentation_resampling_peak_bytes``) follow ``autoseg.preprocess.resampling``.

``WORKER_RUNTIME_BYTES``: RSS of a fresh (spawned) Python process that imported autoseg.preprocess.preprocessor or
autoseg.data.augment (numpy, scipy, SimpleITK, batchgenerators), as measured (docs/memory.md section 3). Part of it
is shared libraries, so a sum over many workers over-counts somewhat. A training loader worker is forked from the
trainer instead and shares its pages: its bytes are ``autoseg.memory.loader_worker``'s.

The export's model (``export_bytes``, ``slab_export_bytes``) is held against the real export by
``benchmarks/host_memory.py`` and by tracemalloc in ``tests/predict/test_export.py`` and
``tests/memory/test_memory.py``; the DICOM writers' (``dicom_seg_bytes``, ``rtstruct_bytes``) by peak RSS and
tracemalloc in ``tests/memory/test_dicom_write_memory.py`` and by ``benchmarks/dicom_memory.py`` (peak RSS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoseg.core.spacing import SKIMAGE_SPLINE_PAD, out_of_plane_axis
from autoseg.core.units import GiB, KiB, MiB
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.nifti import GZIP_READ_CHUNK_BYTES

WORKER_RUNTIME_BYTES = 150 * MiB
TRAINER_HOST_BYTES = 2 * GiB  # the CUDA training process itself (torch, CUDA libraries, pinned batches)
_F32 = 4  # bytes of a float32
# What an export holds beyond its arrays (Python objects, numpy's small arrays): above what tracemalloc sees of them
_EXPORT_OVERHEAD_BYTES = 64 * KiB
# A DICOM output's source slice header and highdicom's references to it (measured 24-25 KiB a 512 x 512 slice), a
# SEG frame's functional groups (5.6-5.7 KiB traced, 6-7.5 KiB in RSS), and what a process's first SEG / RTSTRUCT
# loads (highdicom's tables of the standard; pydicom's and scikit-image's lazily imported modules: measured peaks 110
# and 66 MiB): ``dicom_seg_bytes``, ``rtstruct_bytes``
DICOM_HEADER_BYTES = 28 * KiB
SEG_FRAME_BYTES = 8 * KiB
SEG_LIBRARY_BYTES, RTSTRUCT_LIBRARY_BYTES = 112 * MiB, 68 * MiB
CONTOUR_POINT_BYTES = 1400  # an RTSTRUCT contour point: 3 pydicom DSfloat coordinates and text (measured 1.2-1.3 KB)
# Small numpy arrays and Python objects scipy and we create per call: above what tracemalloc sees of them.
_CALL_OVERHEAD_BYTES = 16 * KiB
# ... and what the skimage style's padding, transform and clip add to them (measured: 1.5-4 KiB)
_SKIMAGE_CALL_OVERHEAD_BYTES = 8 * KiB


def _voxels(shape: Sequence[int]) -> int:
    if any(int(s) < 1 for s in shape):
        raise ValueError(f"shape {tuple(shape)} must have positive sizes")
    return math.prod(int(s) for s in shape)


def preprocess_worker_bytes(
    shape_zyx_before: Sequence[int],
    shape_zyx_after: Sequence[int],
    num_channels: int,
    runtime_bytes: int = WORKER_RUNTIME_BYTES,
    cropped_zyx: Sequence[int] | None = None,
) -> dict[str, int]:
    """Peak RAM of one preprocessing worker on one case (``autoseg.preprocess.preprocessor.run_case``).
    ``runtime_bytes``: the process before the case (a spawned worker's ``WORKER_RUNTIME_BYTES``, or the RSS of the
    process that preprocesses in-process: with torch and the planner loaded, 300-500 MiB).

    ``shape_zyx_before``: the image as read; ``cropped_zyx``: its crop to the nonzero box (the fingerprint's
    ``cropped_shape_zyx``; None: the whole image, an upper bound); ``shape_zyx_after``: the crop after resampling.
    Phases, each on top of ``runtime``: ``load``: the channels as read plus their stacked copy (C x V x float32,
    twice) and one reader copy; ``crop``: the image and int16 label as read (alive until the case is done) + their
    cropped copies, the whole image's nonzero mask and the cropped one; ``resample_image``: + the float32 output and
    the spline temporaries (``resampling_peak_bytes``); ``resample_seg``: + the resampled image, and the label's
    resampling (int16 output, float32 best score and response, bool buffer, one float32 crop-sized mask)."""
    cropped_zyx = shape_zyx_before if cropped_zyx is None else cropped_zyx
    vb, vc, va, c = _voxels(shape_zyx_before), _voxels(cropped_zyx), _voxels(shape_zyx_after), int(num_channels)
    raw = c * vb * _F32 + vb * 2  # image float32 + label int16 as read
    cropped = c * vc * _F32 + vc * 2 + vb + vc  # copies + the nonzero mask + its crop
    seg_temps = resampling_peak_bytes(cropped_zyx, shape_zyx_after, 1, order=1, order_z=0) - va * _F32
    phases = {
        "load": 2 * c * vb * _F32 + vb * _F32,
        "crop": raw + cropped,
        "resample_image": raw + cropped + resampling_peak_bytes(cropped_zyx, shape_zyx_after, c),
        "resample_seg": (raw + cropped + c * va * _F32 + va * (2 + _F32 + _F32 + 1) + vc * _F32 + max(seg_temps, 0)),
    }
    return {"runtime": runtime_bytes, **phases, "total": runtime_bytes + max(phases.values())}


def prediction_preprocess_bytes(
    shape_zyx: Sequence[int],
    shape_zyx_after: Sequence[int],
    num_channels: int,
    spacing_mm: Sequence[float] | None = None,
    style: str = "sitk",
) -> dict[str, int]:
    """Peak RAM of reading and preprocessing one case for prediction (``autoseg.dataset.raw.load_case``, then
    ``autoseg.preprocess.preprocessor.preprocess_case`` without a label), the crop taken as the whole image.

    Phases: ``load`` the channels as read and their stacked copy (C x V float32, twice), the finiteness
    check's bool map and the reader's compressed chunk (``GZIP_READ_CHUNK_BYTES``); ``crop`` the image as read
    (alive until the case is preprocessed), the nonzero mask, its cropped copy, the cropped image and one
    float32 map of the normalization; ``resample`` the image as read, the cropped image and mask, and
    ``resampling_peak_bytes`` (the output and its temporaries, in the plan's ``style`` of image resampling). ``result``:
    the preprocessed image handed to the sliding window (C x resampled V float32), held until it is predicted.
    """
    vb, va, c = _voxels(shape_zyx), _voxels(shape_zyx_after), int(num_channels)
    image = c * vb * _F32
    phases = {
        "load": 2 * image + vb + GZIP_READ_CHUNK_BYTES,
        "crop": 2 * image + 2 * vb + vb * _F32,
        "resample": 2 * image + vb + resampling_peak_bytes(shape_zyx, shape_zyx_after, c, spacing_mm, style=style),
    }
    return {**phases, "result": c * va * _F32, "total": max(phases.values())}


def cascade_input_bytes(
    shape_zyx: Sequence[int],
    shape_zyx_after: Sequence[int],
    num_channels: int,
    num_previous: int,
    spacing_mm: Sequence[float] | None = None,
    label_itemsize: int = 1,
) -> dict[str, int]:
    """Host bytes a cascade stage's prediction of one case holds beside its preprocessed image
    (``prediction_preprocess_bytes``' result) while it builds the network input
    (``autoseg.predict.cascade.cascade_input``), the crop taken as the whole image: ``labels`` the previous stage's
    label map in the image's grid (V x ``label_itemsize``), ``on_grid`` resampling it to the preprocessed grid
    (``segmentation_resampling_peak_bytes``, the labels being the previous stage's values and background), and
    ``input`` the network input, (C + K) x V' float32 (K = ``num_previous`` one-hot channels). ``total``: the
    peak, at the input's allocation (the labels on the grid still alive)."""
    vb, va = _voxels(shape_zyx), _voxels(shape_zyx_after)
    labels = vb * label_itemsize
    on_grid = segmentation_resampling_peak_bytes(
        shape_zyx, shape_zyx_after, spacing_mm, label_itemsize=1, num_labels=num_previous + 1
    )
    network_input = (num_channels + num_previous) * va * _F32
    return {
        "labels": labels,
        "on_grid": on_grid,
        "input": network_input,
        "total": max(labels + on_grid, labels + va + network_input),
    }


def export_bytes(
    shape_zyx_original: Sequence[int],
    shape_zyx_resampled: Sequence[int],
    scheme: LabelScheme,
    probability_bytes: int = _F32,
) -> dict[str, int]:
    """RAM of exporting one prediction held whole (``autoseg.predict.export.export_with_probabilities``, the
    ``--save-probabilities`` path): ``probabilities`` the network's (K, resampled shape) softmax or sigmoid, held
    throughout, of ``probability_bytes`` per value (4: float32, 2: float16), and ``slab_export_bytes`` with the
    whole image as one slab; where the scheme resamples logits, ``activation``: what applying it in the original
    grid holds."""
    vr, vo = _voxels(shape_zyx_resampled), _voxels(shape_zyx_original)
    terms = {
        "probabilities": scheme.num_outputs * vr * int(probability_bytes),
        **slab_export_bytes(
            shape_zyx_original, shape_zyx_resampled, scheme, int(shape_zyx_resampled[0]), probability_bytes
        ),
    }
    terms["total"] = terms["probabilities"] + terms.pop("total")
    if scheme.resample_logits:  # export_with_probabilities: the activation after resampling
        # while an output's resampled map (one map) is activated, the interpolation's other arrays are gone:
        # regions hold its sigmoid beside it; classes the softmax's running maximum and sum throughout (two maps),
        # the new maximum and a shifted copy while a class is added, and the second pass's label map beside the first
        one, interpolation = _F32 * vo, terms["interpolation"]
        if scheme.has_regions:
            terms["activation"] = max(0, 2 * one - interpolation)
        else:
            terms["activation"] = 2 * one + terms["labels"] + max(0, 3 * one - interpolation)
        terms["total"] += terms["activation"]
    return terms


def slab_export_bytes(
    shape_zyx_original: Sequence[int],
    shape_zyx_resampled: Sequence[int],
    scheme: LabelScheme,
    slab_depth: int,
    probability_bytes: int = _F32,
) -> dict[str, int]:
    """RAM of ``autoseg.predict.export.SlabExport`` beside the slabs it is handed (``slab_depth`` z-slices of the
    resampled image at most, ``probability_bytes`` per value). The crop is taken as the whole image.

    ``labels``: the label map (``scheme.export_dtype()``), uncropped, held throughout. While a slab is exported,
    one output at a time: ``float32_copy`` its float32 copy (float16 slabs only); ``interpolation`` the largest
    pass of ``interpolate_separable`` (z, y, x: the previous pass's result and the two gathered float32 arrays of
    this one; an axis that keeps its size is a view); ``best_score`` the running maximum (float32; plain labels)
    and ``compare`` a bool mask of the output slab; ``kept`` the input slices across a slab border (K x 3 slices,
    float32, when the z-axis is resampled); ``taps`` the interpolation's index arrays and small objects.
    """
    original, resampled = [int(n) for n in shape_zyx_original], [int(n) for n in shape_zyx_resampled]
    k, depth = scheme.num_outputs, min(int(slab_depth), resampled[0])
    out_depth = (
        depth if original[0] == resampled[0] else min(original[0], math.ceil(depth * original[0] / resampled[0]) + 1)
    )
    # the block after each pass: (out_depth, Y', X'), (out_depth, Y, X'), (out_depth, Y, X)
    sizes = [
        out_depth * resampled[1] * resampled[2],
        out_depth * original[1] * resampled[2],
        out_depth * original[1] * original[2],
    ]
    interpolation, previous = 0, 0
    for axis, size in enumerate(sizes):
        if original[axis] != resampled[axis]:
            interpolation = max(interpolation, _F32 * (previous + 2 * size))
            previous = size
    plane = resampled[1] * resampled[2]
    terms = {
        "labels": _voxels(original) * np.dtype(scheme.export_dtype()).itemsize,
        "float32_copy": 0 if probability_bytes == _F32 else depth * plane * _F32,
        "interpolation": interpolation,
        "best_score": 0 if scheme.has_regions else _F32 * sizes[2],
        "compare": sizes[2],
        "kept": 0 if original[0] == resampled[0] else 3 * k * plane * _F32,
        # per axis and output voxel a float64 coordinate, int64 indices and a float32 weight, and small arrays
        "taps": 40 * sum(original) + _EXPORT_OVERHEAD_BYTES,
    }
    terms["total"] = sum(terms.values())
    return terms


def resampling_peak_bytes(
    shape_zyx: Sequence[int],
    new_shape_zyx: Sequence[int],
    num_channels: int,
    spacing_mm: Sequence[float] | None = None,
    order: int = 3,
    order_z: int = 0,
    style: str = "sitk",
) -> int:
    """Host bytes ``resample_image`` holds at its peak beyond its float32 input.

    The output array plus the largest per-channel temporary (see ``resample_channel``) plus a small
    constant for per-call bookkeeping; 0 when the shape is unchanged (the input is returned). With
    ``spacing_mm=None`` the path is unknown and the larger of the 3D and anisotropic estimates is given
    (the anisotropic one taking the z axis as out-of-plane). ``style`` "skimage": the spline's temporary is the
    image (or slice) padded by ``SKIMAGE_SPLINE_PAD`` voxels per side.
    """
    pad = SKIMAGE_SPLINE_PAD if style == "skimage" else 0
    shape, new_shape = tuple(int(n) for n in shape_zyx), tuple(int(n) for n in new_shape_zyx)
    if shape == new_shape:
        return 0
    output = 4 * num_channels * int(np.prod(new_shape))
    if spacing_mm is None:
        temp = max(
            _channel_temp_bytes(shape, new_shape, None, (order, order_z), pad),
            _channel_temp_bytes(shape, new_shape, 0, (order, order_z), pad),
        )
    else:
        temp = _channel_temp_bytes(shape, new_shape, out_of_plane_axis(spacing_mm), (order, order_z), pad)
    return output + temp + _CALL_OVERHEAD_BYTES + (_SKIMAGE_CALL_OVERHEAD_BYTES if pad else 0)


def _channel_temp_bytes(
    shape: tuple[int, ...], new_shape: tuple[int, ...], axis: int | None, orders: tuple[int, int], pad: int = 0
) -> int:
    """Peak float32 temporaries of one ``resample_channel`` call (the output excluded); ``orders``: (order,
    order_z); ``pad``: voxels per side the spline's coefficients are padded by."""
    order, order_z = orders
    if axis is None:
        return _coefficient_bytes(shape, pad) if order > 1 else 0
    n_in, n_out = shape[axis], new_shape[axis]
    plane_in = [s for a, s in enumerate(shape) if a != axis]
    plane_out = [s for a, s in enumerate(new_shape) if a != axis]
    slice_coeffs = _coefficient_bytes(plane_in, pad) if order > 1 and plane_in != plane_out else 0
    if n_in == n_out:  # in-plane only, written straight into the output
        return slice_coeffs
    mid = 4 * n_in * int(np.prod(plane_out)) if plane_in != plane_out else 0
    mid_coeffs = 4 * n_in * int(np.prod(plane_out)) if order_z > 1 else 0
    return max(mid + slice_coeffs, mid + mid_coeffs)


def _coefficient_bytes(shape: Sequence[int], pad: int) -> int:
    """float32 spline coefficients of an image of ``shape`` padded by ``pad`` per side, and (padded) the largest of
    its faces, copied while the padding is filled (``resampling._edge_padded``)."""
    padded = [int(s) + 2 * pad for s in shape]
    return 4 * math.prod(padded) + (4 * math.prod(padded) // min(padded) if pad else 0)


def segmentation_resampling_peak_bytes(
    shape_zyx: Sequence[int],
    new_shape_zyx: Sequence[int],
    spacing_mm: Sequence[float] | None = None,
    order: int = 1,
    order_z: int = 0,
    label_itemsize: int = 1,
    num_labels: int = 2,
) -> int:
    """Host bytes ``resample_segmentation`` holds at its peak beyond its input (see its docstring).

    ``label_itemsize`` is the label map's bytes per voxel (1 for int8); ``num_labels`` the number of
    distinct values in it (``-1`` included).
    """
    shape, new_shape = tuple(int(n) for n in shape_zyx), tuple(int(n) for n in new_shape_zyx)
    if shape == new_shape:
        return 0
    n_in, n_out = int(np.prod(shape)), int(np.prod(new_shape))
    output = label_itemsize * n_out
    if order == 0 or num_labels < 2:
        return output + _CALL_OVERHEAD_BYTES
    if order <= 1 and order_z <= 1:  # separable path: running sum and best score, one label's box at a time
        # taps: per output index along each axis a float64 coordinate, int64 indices and a float32 weight,
        # kept for the volume and for the label's box
        taps = 2 * 40 * sum(new_shape)
        return output + 8 * n_out + _separable_temp_bytes(shape, new_shape) + taps + _CALL_OVERHEAD_BYTES
    best_score_response_better = (4 + 4 + 1) * n_out
    mask = 4 * n_in
    channel_temp = resampling_peak_bytes(shape, new_shape, 1, spacing_mm, order, order_z) - 4 * n_out
    return output + best_score_response_better + mask + channel_temp


def _separable_temp_bytes(shape: tuple[int, ...], new_shape: tuple[int, ...]) -> int:
    """Peak temporaries of ``_resample_labels_separable`` beside its output, running sum and best score,
    for a label whose box is the whole volume: the largest of its bool + float32 mask (5 B per input voxel);
    a pass of ``interpolate_separable`` (the mask, the pass's float32 input and two gathered float32 arrays
    of its output size; passes go z, y, x); the response with its comparison and selection (9 B per output voxel); the
    final comparisons (4 bool arrays)."""
    n_in, n_out = int(np.prod(shape)), int(np.prod(new_shape))
    sizes = [n_in] + [int(np.prod(new_shape[: a + 1]) * np.prod(shape[a + 1 :])) for a in range(3)]
    # the caller's argument (the mask) stays referenced until the call returns
    passes = max(4 * (sizes[a] + 2 * sizes[a + 1]) + (4 * n_in if a else 0) for a in range(3))
    return max(5 * n_in, passes, 9 * n_out, 4 * n_out)


def dicom_seg_bytes(shape_zyx: Sequence[int], num_segments: int, regions: bool = False) -> dict[str, int]:
    """RAM of writing a label map of ``shape_zyx`` as a binary DICOM SEG of ``num_segments`` segments
    (``autoseg.dataset.dicom_write.write_dicom_seg``, highdicom) beside the label map itself, every segment taken to
    cover every slice: the plan is made before the label map is known, and a segment's empty frames are left out.

    ``headers``: the source slices' headers (pydicom) and highdicom's references to them; ``frame_items``: each
    frame's functional groups; ``pixel_data``: the frames' packed bits (one bit a voxel) and their join into the
    Pixel Data, both held at once (and the Pixel Data's copy while it is saved); ``plane``: a frame's mask, its copy
    and the flat run bit-packed; ``region_masks``: regions overlap, so they are handed over as (Z, Y, X, S) bool
    masks, and highdicom's overlap check sums them over S as int64 and compares the sum (plain labels: the label map
    itself, one segment at a time); ``libraries``: what the process's first SEG loads, counted for every case."""
    z, y, x = (int(n) for n in shape_zyx)
    voxels, frames = _voxels(shape_zyx), int(num_segments) * z
    terms = {
        "headers": z * DICOM_HEADER_BYTES,
        "frame_items": frames * SEG_FRAME_BYTES,
        "pixel_data": 2 * frames * math.ceil(y * x / 8),
        "plane": 4 * y * x,
        "region_masks": (int(num_segments) + 11) * voxels if regions else 0,
        "libraries": SEG_LIBRARY_BYTES,
        "overhead": _EXPORT_OVERHEAD_BYTES,
    }
    terms["total"] = sum(terms.values())
    return terms


def rtstruct_bytes(shape_zyx: Sequence[int], contour_points: int = 0) -> dict[str, int]:
    """RAM of writing a label map of ``shape_zyx`` as an RTSTRUCT (``autoseg.dataset.dicom_rtstruct``) beside the
    label map: ``headers`` as in ``dicom_seg_bytes``; ``masks`` a slice's mask of a structure, padded, and its copy
    traced; ``contours`` its ``contour_points`` outline points as pydicom holds them (each coordinate a Python number
    and its text; how many points the outlines have is not known before the label map, 0: not counted; a
    512 x 512 organ's outline has tens to hundreds a slice); ``libraries``: what the process's first RTSTRUCT loads,
    counted for every case."""
    terms = {
        "headers": int(shape_zyx[0]) * DICOM_HEADER_BYTES,
        "masks": 4 * _voxels(shape_zyx[1:]),
        "contours": int(contour_points) * CONTOUR_POINT_BYTES,
        "libraries": RTSTRUCT_LIBRARY_BYTES,
        "overhead": _EXPORT_OVERHEAD_BYTES,
    }
    terms["total"] = sum(terms.values())
    return terms
