"""``{case}.npz`` beside a label map (``predict --save-probabilities``): every output's probability map in the
image's own grid, streamed one output and one z-plane at a time and renamed into place when complete."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from autoseg.core.artifacts import atomic_path
from autoseg.dataset.labels import LabelScheme
from autoseg.preprocess.store import CaseProperties

PROBABILITY_DTYPE = np.float16  # 2 bytes a voxel per output; 1e-3 relative precision, ample for averaging folds


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
        names = scheme.names if scheme.has_regions else ("background", *scheme.names)
        shape = (scheme.num_outputs, *props.shape_before_crop)
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(PROBABILITY_DTYPE)), "fortran_order": False,
                  "shape": shape}
        try:
            with atomic_path(path, suffix=".npz") as tmp, \
                    zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
                with archive.open("probabilities.npy", "w", force_zip64=True) as stream:
                    np.lib.format.write_array_header_1_0(stream, header)
                    try:
                        yield cls(props, scheme, stream)
                    except BaseException as e:  # not a write error: the file is dropped, the error goes on
                        raise _Abandoned(e) from e
                for name, value in (("names", np.array(names)),
                                    ("activation", np.array("sigmoid" if scheme.has_regions else "softmax"))):
                    with archive.open(f"{name}.npy", "w") as f:
                        np.lib.format.write_array(f, value, allow_pickle=False)
        except _Abandoned as abandoned:
            raise abandoned.error from None

    def write_output(self, k: int, resampled: np.ndarray) -> None:
        """Output ``k``'s map (the cropped original shape, float32), uncropped one z-slice at a time: one
        float16 (Y, X) plane held beyond it."""
        assert self.stream is not None
        fill = 1.0 if k == 0 and not self.scheme.has_regions else 0.0
        (z0, z1), (y0, y1), (x0, x1) = self.props.crop_bbox
        plane = np.empty(self.props.shape_before_crop[1:], dtype=PROBABILITY_DTYPE)
        for z in range(self.props.shape_before_crop[0]):
            plane.fill(fill)
            if z0 <= z < z1:
                plane[y0:y1, x0:x1] = resampled[z - z0]
            self.stream.write(memoryview(plane.reshape(-1)).cast("B"))


class _Abandoned(Exception):  # noqa: N818 (not an error of its own: carries one through atomic_path)
    """Carries an error raised while a ``ProbabilityFile`` was open past ``atomic_path`` (which would report
    it as a write error)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
