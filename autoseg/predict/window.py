"""``WindowOptions``: the sliding window's settings for one command, made once (``autoseg predict``'s flags, the
final validation's device and ``--tta``) and passed as one value to everything that predicts. Per configuration
they resolve against the plan: its mirror axes (``config.dim``), mirror variants and precision; ``check`` refuses
bad ones before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.model.tile_buffers import ACCUMULATOR_DTYPES, PREDICTION_ACCUMULATOR
from autoseg.model.tta import parse_tta
from autoseg.plan.plans import ConfigurationPlan

# --tta when none is given: on CPU the first 4 mirror variants (identity, z, y, x flips), nearly all of the
# mirroring's Dice for a fraction of its time (docs/prediction.md); on CUDA, where the batched variants cost
# little, all of them.
DEFAULT_TTA = {"cpu": "4", "cuda": "all"}


def default_tta(device: str) -> str:
    return DEFAULT_TTA["cuda" if device.startswith("cuda") else "cpu"]


@dataclass(frozen=True)
class WindowOptions:
    """How the sliding window runs, for every case and configuration of one command."""

    device: str = "cpu"  # where the networks run: "cpu" or "cuda"
    tta: str | None = None  # --tta: all, none or N mirror variants; None: default_tta(device)
    mirror: bool = True  # False (--no-mirror): no mirror variants, the same as --tta none
    tile: str = "planned"  # --tile: "planned" (the plan's inference tile, fitted to each image) or "patch"
    tile_batch_size: int | None = None  # --tile-batch-size: a cap; None: as many as plan_inference fits
    step_fraction: float = 0.5  # consecutive tiles overlap by 1 - step_fraction of the training patch
    accumulator: str = PREDICTION_ACCUMULATOR  # --accumulator: the running mean's dtype (ACCUMULATOR_DTYPES)
    verbose: bool = False  # --verbose: log each case's tile and inference plan, and the pipeline's plan

    @property
    def tta_flag(self) -> str:
        """``--tta`` as it applies: the given value, the device's default, or "none" without mirroring."""
        return (self.tta or default_tta(self.device)) if self.mirror else "none"

    def mirror_axes(self, config: ConfigurationPlan) -> tuple[int, ...]:
        """The spatial axes ``config``'s network is mirrored along: all of them, or none without mirroring."""
        return tuple(range(config.dim)) if self.mirror else ()

    def num_variants(self, config: ConfigurationPlan) -> int:
        """The mirror variants per tile (``parse_tta``)."""
        return parse_tta(self.tta_flag, len(self.mirror_axes(config)))

    def precision(self, config: ConfigurationPlan) -> str:
        """The precision ``config``'s network runs in on this device (``effective_precision``)."""
        return effective_precision(config.precision, self.device)

    def check(self, config: ConfigurationPlan) -> None:
        """A bad --tta, --tile or --accumulator fails before any work, not once per case."""
        parse_tta(self.tta_flag, config.dim)
        config.inference_tile(self.tile)
        if self.accumulator not in ACCUMULATOR_DTYPES:
            raise InputError(f"--accumulator {self.accumulator!r}: use one of {', '.join(sorted(ACCUMULATOR_DTYPES))}")
