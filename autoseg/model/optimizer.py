"""The optimizers a run may use (``OPTIMIZERS``, by name) and their settings; torch is imported only to build one, so
the planner checks a name without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoseg.core.errors import InputError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer of a run: ``sgd`` is nnU-Net's (Nesterov, momentum 0.99, weight decay 3e-5, lr 1e-2 with a
    poly schedule), ``adamw`` the what-if the memory model offers. ``grad_clip``: the gradient norm clipped to."""

    name: str = "sgd"
    initial_lr: float = 1e-2
    momentum: float = 0.99
    weight_decay: float = 3e-5
    grad_clip: float = 12.0

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """``foreach`` as on CUDA (one fused update over all parameters; it also runs on CPU), so the step that
        trains and the step the memory model simulates are the same."""
        import torch

        if self.name == "sgd":
            return torch.optim.SGD(
                params,
                lr=self.initial_lr,
                momentum=self.momentum,
                nesterov=True,
                weight_decay=self.weight_decay,
                foreach=True,
            )
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.initial_lr, weight_decay=self.weight_decay, foreach=True)
        raise InputError(f"OptimizerSettings.name {self.name!r} is not known; use 'sgd' or 'adamw'")


OPTIMIZERS: dict[str, OptimizerSettings] = {
    "sgd": OptimizerSettings(),
    "adam": OptimizerSettings(name="adamw", initial_lr=1e-3, weight_decay=1e-2),
}
