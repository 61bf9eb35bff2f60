"""The labels of a dataset (dataset.json, nnU-Net v2 format) and what they mean for training and prediction.

Three forms, one ``LabelScheme`` for all of them:

- plain classes ``{"background": 0, "organ": 1, "lesion": 2}``: values consecutive from 0; the network has
  one output channel per value (background included), softmax, argmax.
- an ignore label ``{..., "ignore": 3}``: the highest value, consecutive with the others. Its voxels are
  unlabelled: they carry no loss, are never sampled as foreground and are left out of every evaluation
  count. It is not a network output.
- regions ``{"background": 0, "whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing": 3}`` with a
  top-level ``"regions_class_order": [1, 2, 3]``: every entry but background (and ignore) is a region, the
  union of its label values; the network has one sigmoid output per region. A prediction becomes a label
  map by painting, region after region, ``regions_class_order[r]`` where region ``r``'s probability is
  above 0.5 (later regions overwrite earlier ones).

Label maps on disk always hold label values; only the network's outputs differ between the forms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autoseg.core.errors import InputError

if TYPE_CHECKING:  # torch is imported where tensors are handled: dataset readers and workers do without it
    import torch

LabelValue = int | tuple[int, ...]  # a class's value, or a region's values
IGNORE = "ignore"


class LabelError(InputError):
    """The labels (and regions_class_order) of a dataset.json or plans.json break the format's rules."""


def label_map_dtype(num_label_values: int) -> type[np.integer]:
    """The preprocessed label maps' dtype: the smallest signed type for -1 (outside the body) .. K-1, int8
    up to 127 label values and int16 beyond."""
    return np.int8 if num_label_values <= 127 else np.int16


def foreground_entries(labels: Mapping[str, Any]) -> dict[str, LabelValue]:
    """The entries a model predicts and evaluation scores: every label but background (value 0) and
    ``"ignore"``, in the file's order; lists become tuples (regions)."""
    out: dict[str, LabelValue] = {}
    for name, value in labels.items():
        if name == IGNORE or (not isinstance(value, (list, tuple)) and value == 0):
            continue
        out[name] = tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else int(value)
    return out


@dataclass(frozen=True)
class LabelScheme:
    """What a dataset's labels mean for the network, the loss, sampling, prediction and evaluation.

    ``names[i]`` and ``foreground_values[i]`` describe foreground entry ``i`` (a class or a region);
    ``foreground_channels[i]`` is its network output channel (class value ``v`` -> channel ``v``; region
    ``r`` -> channel ``r``). Build with ``LabelScheme.from_labels``.
    """

    names: tuple[str, ...]
    foreground_values: tuple[tuple[int, ...], ...]  # plain: ((1,), (2,), ...); regions: each region's values
    has_regions: bool
    regions_class_order: tuple[int, ...]  # one label value per region; () for plain labels
    ignore_value: int | None
    label_values: tuple[int, ...]  # every value a label file may hold: 0, the classes, ignore; sorted
    # prediction: the averaged logits are resampled to the input's grid and the activation applied there (nnU-Net
    # v2's order, ``Plans.export_space`` "logits"); False: the probabilities are resampled (autoseg's)
    resample_logits: bool = False

    @classmethod
    def from_labels(
        cls, labels: Mapping[str, Any], regions_class_order: Sequence[int] | None = None, where: str = "dataset.json"
    ) -> LabelScheme:
        """Validate ``labels`` (name -> value or list of values) and ``regions_class_order``; raise
        ``LabelError`` naming ``where`` and what to change."""
        values = _parse_values(labels, where)
        ignore = _ignore_value(labels, where)
        if "background" in labels and values["background"] != (0,):
            raise LabelError(f"{where}: labels must map 'background' to 0; found {labels['background']!r}")
        has_regions = any(isinstance(v, (list, tuple)) for v in labels.values())
        declared = sorted({v for name, vs in values.items() if name != IGNORE for v in vs})
        if 0 not in declared:
            raise LabelError(f'{where}: no label has value 0; add "background": 0 to labels')
        if ignore is not None and ignore <= declared[-1]:
            raise LabelError(
                f"{where}: 'ignore' is {ignore} but must be the highest label value (nnU-Net's rule); "
                f"give it {declared[-1] + 1} and relabel the ignored voxels in labelsTr"
            )
        every = declared + ([ignore] if ignore is not None else [])
        if every != list(range(len(every))) or (not has_regions and len(every) != len(values)):
            raise LabelError(
                f"{where}: label values must be consecutive integers from 0, each used once (ignore "
                f"last); found {_describe(values)}"
            )
        entries = foreground_entries(labels)
        names = tuple(entries)
        fg_values = tuple(v if isinstance(v, tuple) else (v,) for v in entries.values())
        if has_regions:
            order = _check_regions(names, fg_values, regions_class_order, where)
        else:
            if regions_class_order:
                raise LabelError(
                    f"{where}: regions_class_order is only for region-based labels (label values "
                    "given as lists); remove it, or give the regions as lists of values"
                )
            by_value = sorted(zip(fg_values, names))
            names, fg_values, order = tuple(n for _, n in by_value), tuple(v for v, _ in by_value), ()
        return cls(
            names=names,
            foreground_values=fg_values,
            has_regions=has_regions,
            regions_class_order=order,
            ignore_value=ignore,
            label_values=tuple(every),
        )

    @classmethod
    def plain(cls, num_label_values: int) -> LabelScheme:
        """Plain labels ``0 .. num_label_values-1`` named by their value (background 0), no ignore label."""
        return cls.from_labels({"background": 0, **{str(v): v for v in range(1, num_label_values)}}, where="labels")

    @classmethod
    def for_outputs(cls, num_outputs: int) -> LabelScheme:
        """A stand-in where only the network's output count is known: plain classes, except that a single
        output can only be one region (label value 1, sigmoid)."""
        if num_outputs == 1:
            return cls.from_labels({"background": 0, "1": [1]}, [1], where="labels")
        return cls.plain(num_outputs)

    @property
    def num_outputs(self) -> int:
        """Network output channels: classes with background (plain labels) or regions; never ignore."""
        return len(self.foreground_values) + (0 if self.has_regions else 1)

    @property
    def num_label_values(self) -> int:
        """Highest label value + 1 (ignore included): the size of per-value counts, the label map's range."""
        return self.label_values[-1] + 1

    @property
    def regions(self) -> tuple[tuple[int, ...], ...]:
        """The label values of each region, in output order; () for plain labels."""
        return self.foreground_values if self.has_regions else ()

    @property
    def foreground_channels(self) -> tuple[int, ...]:
        """The output channel of each foreground entry: the class value (plain) or the region index."""
        if self.has_regions:
            return tuple(range(len(self.foreground_values)))
        return tuple(v[0] for v in self.foreground_values)

    @property
    def predicted_values(self) -> tuple[int, ...]:
        """The foreground values a predicted label map holds: each class's value (plain labels) or the value painted
        for each region (``regions_class_order``). A cascade's network takes one one-hot input channel per value
        (``one_hot``): ``num_outputs - 1`` for plain labels, one per region."""
        return self.regions_class_order if self.has_regions else tuple(v[0] for v in self.foreground_values)

    def one_hot(self, labels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``one_hot`` of ``labels`` over ``predicted_values``: a cascade's extra input channels."""
        return one_hot(labels, self.predicted_values, out)

    def export_dtype(self) -> type[np.integer]:
        """The smallest dtype of an exported label map: uint8, or int16 beyond 255."""
        return np.uint8 if self.num_label_values <= 256 else np.int16

    def target_to_regions(self, seg: torch.Tensor) -> torch.Tensor:
        """``seg`` ``(B, 1, *spatial)`` integer label map -> bool ``(B, F, *spatial)``: voxel in foreground
        entry ``i`` (region ``i``, or class ``i + 1`` for plain labels). -1 and ignore are in none."""
        import torch

        if seg.ndim < 3 or seg.shape[1] != 1:
            raise ValueError(f"seg has shape {tuple(seg.shape)}; expected (B, 1, *spatial)")
        out = torch.empty(
            (seg.shape[0], len(self.foreground_values), *seg.shape[2:]), dtype=torch.bool, device=seg.device
        )  # B x F x spatial bytes
        for i, values in enumerate(self.foreground_values):
            member = seg[:, 0] == values[0]
            for v in values[1:]:
                member |= seg[:, 0] == v
            out[:, i] = member
        return out

    def valid_mask(self, seg: torch.Tensor) -> torch.Tensor | None:
        """bool like ``seg``: False at ignore voxels; None when there is no ignore label."""
        return None if self.ignore_value is None else seg != self.ignore_value

    def probabilities(self, logits: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Softmax over the output channels (plain labels) or a sigmoid per region."""
        import torch

        return torch.sigmoid(logits) if self.has_regions else torch.softmax(logits, dim=dim)

    @property
    def activation(self) -> str:
        """What the sliding window applies to the averaged logits before they are exported: "softmax" over the
        classes, "sigmoid" per region, or "none" where the logits are exported (``resample_logits``)."""
        if self.resample_logits:
            return "none"
        return "sigmoid" if self.has_regions else "softmax"

    def paint_region(self, labels: np.ndarray, region: int, probability: np.ndarray) -> None:
        """Write ``regions_class_order[region]`` into ``labels`` where ``probability`` > 0.5 (in place); where the
        map is the region's logit (``resample_logits``), where it is > 0, the same voxels as its sigmoid > 0.5."""
        labels[probability > (0.0 if self.resample_logits else 0.5)] = self.regions_class_order[region]


def one_hot(labels: np.ndarray, values: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``(F, *S)``: channel ``i`` is 1 where the label map ``labels`` ``(*S)`` holds ``values[i]``, else 0
    (so background, -1 and ignore are 0 in every channel); written into ``out`` (a view may do) when given.
    F x S x 4 bytes."""
    if out is None:
        out = np.empty((len(values), *labels.shape), dtype=np.float32)
    if out.shape != (len(values), *labels.shape):
        raise ValueError(f"one-hot output {out.shape} does not fit {len(values)} values x {labels.shape}")
    for channel, value in zip(out, values, strict=True):
        np.equal(labels, value, out=channel, casting="unsafe")
    return out


def _parse_values(labels: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(labels, Mapping) or not labels:
        raise LabelError(
            f"{where}: 'labels' must be an object mapping names to values, e.g. "
            '{"background": 0, "organ": 1}; found ' + repr(labels)
        )
    out = {}
    for name, value in labels.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in items):
            raise LabelError(
                f"{where}: label {name!r} has value {value!r}; expected a non-negative integer, or "
                "for a region a non-empty list of them"
            )
        out[name] = tuple(items)
    return out


def _ignore_value(labels: Mapping[str, Any], where: str) -> int | None:
    if IGNORE not in labels:
        return None
    if isinstance(labels[IGNORE], (list, tuple)):
        raise LabelError(f"{where}: 'ignore' must be one integer (the highest label value), not a list")
    return int(labels[IGNORE])


def _check_regions(
    names: tuple[str, ...], values: tuple[tuple[int, ...], ...], regions_class_order: Sequence[int] | None, where: str
) -> tuple[int, ...]:
    """Validate the regions and their ``regions_class_order``; return the order as a tuple."""
    for name, vs in zip(names, values, strict=True):
        if 0 in vs:
            raise LabelError(f"{where}: region {name!r} holds 0 (background); regions hold foreground values only")
    described = ", ".join(f"{n} {list(v)}" for n, v in zip(names, values, strict=True))
    if not regions_class_order:
        raise LabelError(
            f"{where}: region-based labels (values given as lists) need a top-level "
            f'"regions_class_order": the label value written for each region ({described}) when '
            f"predictions become a label map, later regions over earlier ones; e.g. "
            f'"regions_class_order": {_suggested_order(values)}'
        )
    order = list(regions_class_order)
    if len(order) != len(values) or any(isinstance(v, bool) or not isinstance(v, int) for v in order):
        raise LabelError(
            f"{where}: regions_class_order {order} must hold one integer per region; there are "
            f"{len(values)} regions ({described})"
        )
    for r, (name, vs, v) in enumerate(zip(names, values, order, strict=True)):
        if v not in vs:
            raise LabelError(
                f"{where}: regions_class_order[{r}] is {v}, which is not a value of region {name!r} "
                f"{list(vs)}; use one of its values, e.g. {_suggested_order(values)}"
            )
    return tuple(order)


def _suggested_order(values: tuple[tuple[int, ...], ...]) -> list[int]:
    """Per region, its smallest value that no later region holds (else its smallest value)."""
    out = []
    for r, vs in enumerate(values):
        later = {v for other in values[r + 1 :] for v in other}
        own = sorted(set(vs) - later)
        out.append(own[0] if own else min(vs))
    return out


def _describe(values: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{n}: {list(v) if len(v) > 1 else v[0]}" for n, v in values.items())
