"""From the sliding window's probabilities (preprocessed grid) to the label map in the input's own grid.

``SlabExport`` takes the probabilities as the sliding window finishes them, a slab of z-slices at a time
(``autoseg.model.sliding_window.SlabSink``), and turns each slab into finished slices of the label map at once:
each output's map is interpolated back to the cropped original grid (linear in-plane, nearest across thick
slices, as ``autoseg.preprocess.resampling.resample_channel`` resamples probabilities; separable taps, so a
slab needs only the input slices its output slices read) and folded into a running argmax (plain labels), or
thresholded at 0.5 and painted in ``regions_class_order`` (regions; ``autoseg.dataset.labels``). The label map
is written straight into the uncropped volume (zeros outside the crop). So the host never holds the image's
probabilities: a slab's worth (``autoseg.memory.host.slab_export_bytes``) and the label map.

``export_segmentation`` does the same for probabilities held whole (``--save-probabilities`` needs them per
output over the whole image, ``ProbabilityFile``): one slab that is the whole image.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from autoseg.core.errors import InputError
from autoseg.core.spacing import out_of_plane_axis
from autoseg.dataset.labels import LabelScheme
from autoseg.predict.probabilities import weigh
from autoseg.preprocess.resampling import axis_taps, interpolate_separable
from autoseg.preprocess.store import CaseProperties

Taps = tuple[np.ndarray, np.ndarray, np.ndarray]  # per output voxel: low and high input index, weight of high


class SlabExport:
    """The label map of one case, built from consecutive slabs of its probabilities (``add``), then ``labels``.

    ``shape_zyx``: the preprocessed image's (the sliding window's) shape. Holds the uncropped label map
    (``scheme.export_dtype()``), at most one input slice kept between slabs (linear interpolation across the
    slab border) and, while a slab is exported, one output's interpolated slab, the running best score and a
    comparison mask.

    ``weights``: a factor per output on its probability before the argmax (``autoseg.predict.class_weights``;
    where the maps are logits, their logarithm is added) for the argmax alone: the running best score is kept in
    weighted units, so no map is copied or changed; None: the plain argmax. Plain classes only.
    """

    def __init__(
        self,
        props: CaseProperties,
        scheme: LabelScheme,
        shape_zyx: tuple[int, ...],
        weights: np.ndarray | None = None,
    ) -> None:
        out_shape = tuple(int(n) for n in props.shape_after_crop)
        orders = [1, 1, 1]
        axis = out_of_plane_axis(props.target_spacing_mm)
        if axis is not None:
            orders[axis] = 0  # nearest across thick slices
        self.taps = [
            axis_taps(int(n_in), n_out, o) for n_in, n_out, o in zip(shape_zyx, out_shape, orders, strict=True)
        ]
        low, high, weight = self.taps[0]
        self.taps[0] = (low, np.where(weight > 0, high, low), weight)  # a tap of weight 0 is not waited for
        self.scheme, self.num_inputs = scheme, int(shape_zyx[0])
        self.full = np.zeros(props.shape_before_crop, dtype=scheme.export_dtype())
        self.cropped = self.full[tuple(slice(a, b) for a, b in props.crop_bbox)]  # a view: written in place
        self.done = 0  # output z-slices finished
        self.received = 0  # input z-slices received
        self.kept: np.ndarray | None = None  # (K, n, Y', X') float32 input slices [kept_from, received) still read
        self.kept_from = 0
        if weights is not None and (scheme.has_regions or len(weights) != scheme.num_outputs):
            raise ValueError(f"{len(weights)} class weights for labels with {scheme.num_outputs} outputs (plain only)")
        self.weights = weights

    def add(
        self,
        z_start: int,
        z_stop: int,
        probabilities: torch.Tensor | np.ndarray,
        on_output: Callable[[int, np.ndarray], None] | None = None,
    ) -> None:
        """Input z-slices ``[z_start, z_stop)`` (the next ones), ``(K, z_stop - z_start, Y', X')``: finish every output
        slice whose input slices have all arrived. ``on_output(k, map)`` sees each output's interpolated map of
        those slices (float32)."""
        if z_start != self.received:
            raise ValueError(f"slab [{z_start}, {z_stop}) after {self.received} input slices: slabs come in order")
        slab = probabilities.cpu().numpy() if isinstance(probabilities, torch.Tensor) else probabilities
        if slab.shape[0] != self.scheme.num_outputs:
            raise InputError(f"{slab.shape[0]} probability maps for labels with {self.scheme.num_outputs} outputs")
        low, high, _ = self.taps[0]
        self.received = z_stop
        end = int(np.searchsorted(high, z_stop)) if z_stop < self.num_inputs else len(high)  # reads < z_stop
        # outputs that read a kept slice: from the kept slices and the first of this slab (a small copy)
        split = min(max(int(np.searchsorted(low, z_start)), self.done), end)
        if split > self.done:
            assert self.kept is not None
            needed = int(high[split - 1]) + 1 - z_start
            block = np.concatenate([self.kept, slab[:, :needed].astype(np.float32, copy=False)], axis=1)
            self._export(block, self.kept_from, self.done, split, on_output)
        if end > split:  # the rest read this slab only: no copy
            self._export(slab, z_start, split, end, on_output)
        self.done = end
        self.kept = None
        if end < len(low) and low[end] < z_stop:  # the next output reads the end of this slab: keep it
            self.kept_from = int(low[end])
            self.kept = slab[:, self.kept_from - z_start :].astype(np.float32, copy=True)

    def _export(
        self, block: np.ndarray, block_start: int, j0: int, j1: int, on_output: Callable[[int, np.ndarray], None] | None
    ) -> None:
        """Output z-slices ``[j0, j1)`` from ``block`` (K, n, Y', X'), whose first slice is input slice
        ``block_start``."""
        low, high, weight = self.taps[0]
        taps = [(low[j0:j1] - block_start, high[j0:j1] - block_start, weight[j0:j1]), *self.taps[1:]]
        labels = self.cropped[j0:j1]
        best = better = None
        for k in range(block.shape[0]):
            # one output's slab in the original grid, float32 (a float16 channel: a float32 copy first)
            resampled = interpolate_separable(block[k].astype(np.float32, copy=False), taps)
            if on_output is not None:
                on_output(k, resampled)
            if self.scheme.has_regions:
                self.scheme.paint_region(labels, k, resampled)  # later regions overwrite earlier ones
            elif best is None:
                best, better = resampled.copy(), np.empty(resampled.shape, dtype=bool)
                weigh(best, self.weights, k, 1, self.scheme.resample_logits)
            else:  # weighted: compared in class k's own units (``resampled`` may be a view of the slab: not touched)
                weigh(best, self.weights, k, -1, self.scheme.resample_logits)
                np.greater(resampled, best, out=better)
                labels[better] = k
                np.maximum(best, resampled, out=best)
                weigh(best, self.weights, k, 1, self.scheme.resample_logits)
            del resampled  # not alive while the next output is interpolated (slab_export_bytes)

    def labels(self) -> np.ndarray:
        """The label map (Z, Y, X) in the original image's array space, once every slab has arrived."""
        if self.done != len(self.taps[0][0]):
            raise ValueError(
                f"{self.done} of {len(self.taps[0][0])} output slices exported; "
                f"{self.received} of {self.num_inputs} input slices arrived"
            )
        return self.full


def export_segmentation(
    probabilities: torch.Tensor | np.ndarray,
    props: CaseProperties,
    scheme: LabelScheme | None = None,
    on_output: Callable[[int, np.ndarray], None] | None = None,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """(K, Z', Y', X') probabilities in preprocessed space, held whole -> label map (Z, Y, X) of label values
    (``scheme.export_dtype()``) in the original image's array space: ``SlabExport`` with one slab. ``scheme``
    None: plain classes 0 .. K-1 (``LabelScheme.for_outputs``). ``on_output(k, map)`` sees each output's whole
    map in the original (cropped) grid; ``weights``: ``SlabExport``'s."""
    scheme = scheme or LabelScheme.for_outputs(probabilities.shape[0])
    export = SlabExport(props, scheme, tuple(probabilities.shape[1:]), weights)
    export.add(0, probabilities.shape[1], probabilities, on_output)
    return export.labels()


def export_with_probabilities(
    maps: torch.Tensor | np.ndarray,
    props: CaseProperties,
    scheme: LabelScheme,
    write: Callable[[int, np.ndarray], None],
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """The label map of ``maps`` (``export_segmentation``), each output's probabilities in the original (cropped)
    grid handed to ``write(k, map)`` in order (``ProbabilityFile.write_output``). ``maps`` are probabilities, or, where
    the scheme resamples logits (``LabelScheme.resample_logits``), the averaged logits: then the sigmoid of each
    resampled region's map, or the softmax over the resampled classes, which needs every class at a voxel: a first
    export pass sums them (``_Softmax``), a second hands each class's normalized map over. ``weights``: the label
    map's (``SlabExport``); the maps written are unweighted."""
    if not scheme.resample_logits:
        return export_segmentation(maps, props, scheme, on_output=write, weights=weights)
    if scheme.has_regions:
        return export_segmentation(maps, props, scheme, on_output=lambda k, logit: write(k, _sigmoid(logit)))
    softmax = _Softmax()
    labels = export_segmentation(maps, props, scheme, on_output=softmax.add, weights=weights)
    export_segmentation(maps, props, scheme, on_output=lambda k, logit: write(k, softmax.of(logit)))
    return labels


def _sigmoid(logit: np.ndarray) -> np.ndarray:
    """float32 sigmoid of ``logit`` as a new map (``SlabExport`` paints the region from ``logit`` after this)."""
    out = np.negative(logit)
    np.exp(out, out=out)
    out += 1.0
    return np.reciprocal(out, out=out)


class _Softmax:
    """The softmax over resampled class maps handed over one at a time: ``add`` each class's logits (kept: a running
    maximum and the sum of exponentials below it, float32 maps of the cropped original grid; at most two more while
    one is added), then ``of`` each class's map again for its probability."""

    def __init__(self) -> None:
        self.peak: np.ndarray | None = None
        self.total: np.ndarray | None = None

    def add(self, k: int, logit: np.ndarray) -> None:
        """Class ``k``'s logits, left as they are (``SlabExport`` takes their argmax after this)."""
        if self.peak is None:
            self.peak, self.total = logit.copy(), np.ones_like(logit)
            return
        assert self.total is not None
        higher = np.maximum(self.peak, logit)
        self.peak -= higher  # the sum so far, rescaled to the new maximum, in place
        np.exp(self.peak, out=self.peak)
        self.total *= self.peak
        shifted = np.subtract(logit, higher)
        np.exp(shifted, out=shifted)
        self.total += shifted
        self.peak = higher

    def of(self, logit: np.ndarray) -> np.ndarray:
        """Class ``logit``'s probability, in place: the map is its own, and the argmax the second pass then takes of
        it is the logits' (the map is the same increasing function of the logit at each voxel for every class)."""
        assert self.peak is not None and self.total is not None
        logit -= self.peak
        np.exp(logit, out=logit)
        logit /= self.total
        return logit
