"""``{case}.npz`` beside a label map (``predict --save-probabilities``): every output's probability map in the
image's own grid, streamed one output and one z-plane at a time and renamed into place when complete."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from autoseg.core.artifacts import atomic_path
from autoseg.core.errors import InputError
from autoseg.core.units import KiB
from autoseg.dataset.labels import LabelScheme
from autoseg.preprocess.store import CaseProperties

PROBABILITY_DTYPE = np.float16  # 2 bytes a voxel per output; 1e-3 relative precision, ample for averaging folds
# read_probabilities' bytes beyond the array, whatever its size: numpy reads a zip member in 256 KiB chunks, beside
# zipfile's inflate buffers (about half a MiB whatever the array's size, measured)
READ_BUFFER_BYTES = 768 * KiB


@dataclass
class ProbabilityFile:
    """``{case}.npz``, what an ensembling tool needs to average several models' predictions of a case:

    - ``probabilities``: float16 (K, Z, Y, X), the image's own array grid (Z = 1 for a 2D image), as the label
      map; K outputs: the softmax of every class 0 .. K-1 (plain labels; background 1 outside the crop box) or
      the sigmoid of every region (region labels; 0 outside). float16 halves the file and the memory; the
      label map is the argmax (or the regions painted at 0.5) of the float32 maps, so ties in float16 may
      differ from it.
    - ``names``: the output names (``background`` and the classes by value, or the regions in order);
      ``activation``: ``softmax`` or ``sigmoid``.

    Written as a zip (``np.load`` reads it) one output at a time, so only one output's map is held; under a
    temporary name, renamed when complete (``atomic_path``).
    """

    props: CaseProperties
    scheme: LabelScheme
    stream: IO[bytes] | None = None

    @classmethod
    @contextmanager
    def open(cls, path: Path, props: CaseProperties, scheme: LabelScheme) -> Iterator[ProbabilityFile]:
        with _probability_stream(path, (scheme.num_outputs, *props.shape_before_crop), scheme) as stream:
            yield cls(props, scheme, stream)

    def write_output(self, k: int, resampled: np.ndarray) -> None:
        """Output ``k``'s map (the cropped original shape, float32), uncropped one z-slice at a time
        (``uncropped_planes``)."""
        assert self.stream is not None
        for plane in uncropped_planes(k, resampled, self.props, self.scheme):
            self.stream.write(memoryview(plane.reshape(-1)).cast("B"))


def uncropped_planes(k: int, resampled: np.ndarray, props: CaseProperties, scheme: LabelScheme) -> Iterator[np.ndarray]:
    """Output ``k``'s map (the cropped original shape, float32) in the image's uncropped grid, one float16 (Y, X)
    plane at a time (the same array, refilled: one plane held beyond the map); outside the crop the background class
    is certain, every region absent."""
    fill = 1.0 if k == 0 and not scheme.has_regions else 0.0
    (z0, z1), (y0, y1), (x0, x1) = props.crop_bbox
    plane = np.empty(props.shape_before_crop[1:], dtype=PROBABILITY_DTYPE)
    for z in range(props.shape_before_crop[0]):
        plane.fill(fill)
        if z0 <= z < z1:
            plane[y0:y1, x0:x1] = resampled[z - z0]
        yield plane


@dataclass
class ProbabilityMaps:
    """``write_output``'s maps kept in memory: ``maps`` (K, Z, Y, X) float16 in the image's uncropped grid, as a
    ``ProbabilityFile`` holds them (what ``autoseg.predict.segmenter.Segmenter.predict`` returns)."""

    props: CaseProperties
    scheme: LabelScheme
    maps: np.ndarray

    @classmethod
    def empty(cls, props: CaseProperties, scheme: LabelScheme) -> ProbabilityMaps:
        """Room for every output: K x Z x Y x X x 2 bytes."""
        return cls(props, scheme, np.empty((scheme.num_outputs, *props.shape_before_crop), dtype=PROBABILITY_DTYPE))

    def write_output(self, k: int, resampled: np.ndarray) -> None:
        """Output ``k``'s map (the cropped original shape, float32), uncropped (``uncropped_planes``)."""
        for z, plane in enumerate(uncropped_planes(k, resampled, self.props, self.scheme)):
            self.maps[k, z] = plane


class _Abandoned(Exception):  # noqa: N818 (not an error of its own: carries one through atomic_path)
    """Carries an error raised while a ``ProbabilityFile`` was open past ``atomic_path`` (which would report
    it as a write error)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _outputs_of(scheme: LabelScheme) -> tuple[tuple[str, ...], str]:
    """The file's ``names`` and ``activation`` for ``scheme``: its regions (sigmoid), or background and its classes
    (softmax)."""
    if scheme.has_regions:
        return tuple(scheme.names), "sigmoid"
    return ("background", *scheme.names), "softmax"


@contextmanager
def _probability_stream(path: Path, shape: tuple[int, ...], scheme: LabelScheme) -> Iterator[IO[bytes]]:
    """The ``probabilities.npy`` member of a new ``{case}.npz`` (header written; the caller writes the float16
    values in C order), then its ``names`` and ``activation``; renamed into place when complete. An error raised
    by the caller drops the file and goes on unchanged."""
    names, activation = _outputs_of(scheme)
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(PROBABILITY_DTYPE)),
        "fortran_order": False,
        "shape": shape,
    }
    try:
        with (
            atomic_path(path, suffix=".npz") as tmp,
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
        ):
            with archive.open("probabilities.npy", "w", force_zip64=True) as stream:
                np.lib.format.write_array_header_1_0(stream, header)
                try:
                    yield stream
                except BaseException as e:  # not a write error: the file is dropped, the error goes on
                    raise _Abandoned(e) from e
            for name, value in (("names", np.array(names)), ("activation", np.array(activation))):
                with archive.open(f"{name}.npy", "w") as f:
                    np.lib.format.write_array(f, value, allow_pickle=False)
    except _Abandoned as abandoned:
        raise abandoned.error from None


def write_probabilities(path: Path, probabilities: np.ndarray, scheme: LabelScheme) -> None:
    """A whole (K, Z, Y, X) array in the image's grid (an ensemble's mean) as a ``{case}.npz``, one z-plane of
    one output converted to float16 at a time."""
    with _probability_stream(path, probabilities.shape, scheme) as stream:
        for k in range(probabilities.shape[0]):
            for z in range(probabilities.shape[1]):
                plane = np.ascontiguousarray(probabilities[k, z], dtype=PROBABILITY_DTYPE)
                stream.write(memoryview(plane.reshape(-1)).cast("B"))


def read_probabilities(path: Path, scheme: LabelScheme) -> np.ndarray:
    """A ``{case}.npz`` back: float16 (K, Z, Y, X), 2 bytes a voxel per output (decompressed in chunks into that
    array: ``READ_BUFFER_BYTES`` beside it). Raises ``InputError`` naming the file when it is not such a file or
    its outputs are not ``scheme``'s (another dataset's labels)."""
    names, activation = _outputs_of(scheme)
    try:
        with np.load(path, allow_pickle=False) as npz:
            found_names, found_activation = tuple(str(n) for n in npz["names"]), str(npz["activation"])
            if found_names != names or found_activation != activation:
                raise InputError(
                    f"{path}: holds {found_activation} outputs {list(found_names)}, but the labels have "
                    f"{activation} outputs {list(names)}; it was written for other labels: predict "
                    "these cases again with this workspace"
                )
            probabilities = npz["probabilities"]
    except InputError:
        raise
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise InputError(
            f"{path}: not a readable probability file ({type(e).__name__}: {e}); predict the case again to rewrite it"
        ) from e
    if probabilities.ndim != 4 or probabilities.shape[0] != len(names):
        raise InputError(f"{path}: probabilities of shape {probabilities.shape}; expected ({len(names)}, Z, Y, X)")
    return probabilities


def mean_probabilities(paths: Sequence[Path], scheme: LabelScheme) -> np.ndarray:
    """The mean of several ``{case}.npz`` of one case (an ensemble of configurations): float32 (K, Z, Y, X),
    ``ensemble_case_bytes``. Raises ``InputError`` naming the files when their shapes differ."""
    total: np.ndarray | None = None
    for path in paths:
        probabilities = read_probabilities(path, scheme)  # float16 (K, Z, Y, X)
        if total is None:
            total = probabilities.astype(np.float32)
        elif total.shape != probabilities.shape:
            raise InputError(
                f"{path}: probabilities of shape {probabilities.shape}, but {paths[0]} has "
                f"{total.shape}; predict both in the image's own grid (predict and train's final "
                "validation do)"
            )
        else:
            total += probabilities
        del probabilities
    assert total is not None, "no probability files"
    total /= len(paths)  # the mean: regions are thresholded at 0.5
    return total


def ensemble_case_bytes(num_outputs: int, num_voxels: int) -> int:
    """Host bytes an ensemble's label map of one case holds at its peak: the float32 probability sum (4 bytes a
    voxel per output) beside one configuration's float16 probabilities (2) as they are read and added; later the
    sum beside the label map, the running maximum and its mask (``labels_from_probabilities``: 1 + 4 + 1), less
    for two outputs or more; and the reader's buffers."""
    return max(
        num_outputs * num_voxels * (4 + 2) + READ_BUFFER_BYTES, num_outputs * num_voxels * 4 + num_voxels * (1 + 4 + 1)
    )


def labels_from_probabilities(
    probabilities: np.ndarray, scheme: LabelScheme, weights: np.ndarray | None = None
) -> np.ndarray:
    """(K, Z, Y, X) probabilities in the image's grid -> label map (Z, Y, X), ``scheme.export_dtype()``, by
    export's rule (``autoseg.predict.export``): the argmax over the classes (the first on ties), or each region
    above 0.5 painted in ``regions_class_order``. Holds the label map, one output's map and a mask beside it.
    ``weights``: a factor per output on its probability before the argmax (``autoseg.predict.class_weights``; plain
    classes), compared as export compares them (``weigh``); the running maximum is then float32."""
    labels = np.zeros(probabilities.shape[1:], dtype=scheme.export_dtype())
    if scheme.has_regions:
        for r in range(probabilities.shape[0]):
            scheme.paint_region(labels, r, probabilities[r])
        return labels
    # a running argmax, as export's: np.argmax over axis 0 would copy the whole (K, Z, Y, X) array transposed
    best = probabilities[0].copy() if weights is None else probabilities[0].astype(np.float32)  # one output's map
    better = np.empty(best.shape, dtype=bool)  # and a bool mask beside it
    weigh(best, weights, 0, 1)
    for k in range(1, probabilities.shape[0]):
        weigh(best, weights, k, -1)  # in output k's own units: its map is not copied
        np.greater(probabilities[k], best, out=better)
        labels[better] = k
        np.maximum(best, probabilities[k], out=best)
        weigh(best, weights, k, 1)
    return labels


def weigh(score: np.ndarray, weights: np.ndarray | None, k: int, sign: int, logits: bool = False) -> None:
    """``score`` (a float32 map) times output ``k``'s factor of ``weights`` (``sign`` 1) or divided by it (-1), in
    place; where the maps are ``logits``, the factor's logarithm added or subtracted. Nothing for no weights or a
    factor of 1: the running argmax of ``SlabExport`` and ``labels_from_probabilities`` keeps its best score in
    weighted units this way."""
    if weights is None or weights[k] == 1.0:
        return
    if logits:
        score += np.float32(sign * np.log(weights[k]))
    else:
        score *= np.float32(weights[k] if sign > 0 else 1.0 / weights[k])
