"""A fresh run's weights from a trained model (``autoseg train --init-from MODEL [--init-fold K]``): fine-tuning.

Every tensor of the new network whose name and shape match one of the model's is copied; the others keep the
network's own initialisation. The segmentation heads (``seg_heads.*``) are re-initialised whenever the model's label
set differs from the plan's (other structures, or the same count in another order: their outputs would mean other
things), whatever their shapes. The run is refused when fewer than ``MIN_ENCODER_SHARE`` of the new encoder's
parameters can be copied (another architecture, depth or width): such a start is not the model's features, and the
error names the layers that do not fit and ``plan --like``, which plans a dataset with the model's network. A new
input channel count re-initialises only the first convolution, which holds a small share of a real encoder.

The init is applied once, before the first step: what was loaded (model, configuration, fold, checkpoint, sha256)
and what was copied is the run's ``InitRecord``, kept in its ``TrainingProgress`` (every checkpoint) and run.json.
A resumed run takes the checkpoint's weights and never applies the init again (``autoseg.train.trainer``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from autoseg.core.errors import InputError
from autoseg.plan.plans import Plans
from autoseg.train.source_model import SourceModel, open_source_model

log = logging.getLogger("autoseg.train.trainer")

MIN_ENCODER_SHARE = 0.9  # of the new encoder's parameters that must be copied
ENCODER, HEADS = "encoder.", "seg_heads."
SHOWN_LAYERS = 6  # layers named in a refusal; the rest are counted


@dataclass(frozen=True)
class InitRecord:
    """What a run started from: the model as read (``SourceModel.describe``'s parts) and what was copied."""

    model: str
    kind: str  # "archive", "checkpoint", "workspace"
    configuration: str
    fold: str
    checkpoint: str  # the file read (its path in the archive or workspace)
    sha256: str
    copied_tensors: int
    total_tensors: int
    encoder_share: float  # of the new encoder's parameters copied, 0..1
    reinitialised: tuple[str, ...]  # the layers (module names) left as the new network initialised them
    heads: str  # why the segmentation heads were copied or re-initialised

    def describe(self) -> str:
        """The log line: 'copied 41 of 44 tensors, 99.2% of the encoder's parameters; re-initialised: ...'."""
        again = ", ".join(self.reinitialised[:SHOWN_LAYERS]) + (
            f" and {len(self.reinitialised) - SHOWN_LAYERS} more" if len(self.reinitialised) > SHOWN_LAYERS else ""
        )
        return (
            f"initialised from {self.model} ({self.kind}, {self.configuration}"
            f"{f' fold {self.fold}' if self.fold else ''}, {self.checkpoint}, sha256 {self.sha256[:12]}): copied "
            f"{self.copied_tensors} of {self.total_tensors} tensors, {self.encoder_share:.1%} of the encoder's "
            f"parameters; {self.heads}; re-initialised: {again or 'nothing'}"
        )


def initialise_from(
    network: torch.nn.Module, plans: Plans, model: str, config_name: str, fold: str | None
) -> InitRecord:
    """Copy the weights of ``model`` (fold ``fold``, None: its first) into ``network``, ``plans``' network of
    ``config_name``, in place, and log what was copied. ``InputError`` when less than ``MIN_ENCODER_SHARE`` of the
    encoder fits."""
    source, weights = open_source_model(model, config_name, fold)
    target = network.state_dict()
    reset_heads, heads = _heads(source, plans, len(_layers(n for n in target if n.startswith(HEADS))))
    copied = {
        name: weights[name]
        for name, tensor in target.items()
        if name in weights
        and tuple(weights[name].shape) == tuple(tensor.shape)
        and not (reset_heads and name.startswith(HEADS))
    }
    share = _encoder_share(target, copied)
    misfits = [name for name in target if name not in copied and not (reset_heads and name.startswith(HEADS))]
    if share < MIN_ENCODER_SHARE:
        raise InputError(_refusal(source, target, weights, misfits, share))
    network.load_state_dict({**target, **{k: v.to(target[k].dtype) for k, v in copied.items()}})
    layers = _layers(name for name in target if name not in copied)
    record = InitRecord(
        str(source.given),
        source.kind,
        source.config_name,
        source.fold,
        source.checkpoint,
        source.sha256,
        len(copied),
        len(target),
        share,
        layers,
        heads,
    )
    log.info("%s", record.describe())
    return record


def _heads(source: SourceModel, plans: Plans, heads: int) -> tuple[bool, str]:
    """(re-initialise the ``heads`` segmentation heads, why): when the label sets differ; where the model's is
    unknown (a checkpoint outside its workspace), when the output counts differ."""
    outputs = plans.label_scheme.num_outputs
    theirs = source.config.network.num_outputs
    if source.plans is None:
        if theirs != outputs:
            return True, f"the {heads} segmentation heads re-initialised ({theirs} outputs -> {outputs})"
        return False, f"the {heads} segmentation heads copied (the model's label set is unknown; {outputs} outputs)"
    mine = (dict(plans.labels), tuple(plans.regions_class_order))
    if (dict(source.plans.labels), tuple(source.plans.regions_class_order)) != mine:
        return True, (
            f"the {heads} segmentation heads re-initialised: another label set ({theirs} outputs "
            f"{sorted(source.plans.labels)} -> {outputs} {sorted(plans.labels)})"
        )
    return False, f"the {heads} segmentation heads copied (the same label set)"


def _encoder_share(target: dict[str, torch.Tensor], copied: dict[str, torch.Tensor]) -> float:
    """The share of the new encoder's parameters (elements) that are copied."""
    total = sum(t.numel() for name, t in target.items() if name.startswith(ENCODER))
    return sum(t.numel() for name, t in copied.items() if name.startswith(ENCODER)) / max(total, 1)


def _layers(names) -> tuple[str, ...]:
    """Module names of tensor names (``encoder.0.0.0.weight`` -> ``encoder.0.0.0``), in order, once each."""
    return tuple(dict.fromkeys(name.rsplit(".", 1)[0] for name in names))


def _shape(tensor: torch.Tensor | None) -> str:
    return "absent" if tensor is None else "x".join(map(str, tensor.shape))


def _refusal(
    source: SourceModel,
    target: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    misfits: list[str],
    share: float,
) -> str:
    encoder = [name for name in misfits if name.startswith(ENCODER)]
    layers = {}  # each layer by its first tensor (a convolution's weight comes before its bias)
    for name in encoder:
        layers.setdefault(name.rsplit(".", 1)[0], name)
    shown = [
        f"{layer} ({_shape(weights.get(n))} in the model, {_shape(target[n])} here)"
        for layer, n in list(layers.items())[:SHOWN_LAYERS]
    ]
    more = len(layers) - len(shown)
    missing = sum(target[n].numel() for n in encoder)
    return (
        f"--init-from {source.describe()}: only {share:.1%} of this network's encoder parameters can be copied "
        f"(at least {MIN_ENCODER_SHARE:.0%} must; {missing:,} do not fit, in {len(layers)} layer(s)): "
        + "; ".join(shown)
        + (f"; and {more} more" if more > 0 else "")
        + f". The model's network ({source.config.network.architecture}, features "
        f"{list(source.config.network.features_per_stage)}, {source.config.network.in_channels} input channel(s)) "
        "is not this plan's: plan this dataset with the model's network, `autoseg plan_and_preprocess DATASET -w "
        f"WORKSPACE --like MODEL --overwrite` with MODEL {source.given}, then train again"
    )
