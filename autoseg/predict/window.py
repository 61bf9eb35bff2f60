"""``WindowOptions``: the sliding window's settings for one command, made once (``autoseg predict``'s flags, the
final validation's device and ``--tta``) and passed as one value to everything that predicts. Per configuration
they resolve against the plan: its mirror axes (``config.dim``), mirror variants and precision; ``check`` refuses
bad ones before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError
from autoseg.core.extras import RUNTIMES, require
from autoseg.core.precision import check_cpu_precision, check_precision, effective_precision
from autoseg.model.tile_buffers import ACCUMULATOR_DTYPES, PREDICTION_ACCUMULATOR
from autoseg.model.tta import parse_tta
from autoseg.plan.plans import ConfigurationPlan

# --tta when none is given: on CPU the first 4 mirror variants (identity, z, y, x flips), nearly all of the
# mirroring's Dice for a fraction of its time (docs/prediction.md); on CUDA, where the batched variants cost
# little, all of them.
DEFAULT_TTA = {"cpu": "4", "cuda": "all"}


AUTO = "auto"  # --runtime auto / --precision auto: chosen by timing (autoseg.predict.runtime_choice)


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
    runtime: str = "torch"  # --runtime: a key of RUNTIMES, or AUTO
    # --precision: fp32, bf16 (native bf16 CPUs, CUDA), fp16 (CUDA), AUTO; None: the plan's (fp32 on the CPU)
    precision: str | None = None
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

    def compute_precision(self, config: ConfigurationPlan) -> str:
        """The precision ``config``'s network runs in: --precision, else the plan's on this device
        (``effective_precision``: fp32 on the CPU). An ``AUTO`` one is chosen first
        (``autoseg.predict.runners.resolve_auto``)."""
        if self.precision == AUTO:
            raise ValueError("--precision auto is chosen before the networks run: autoseg.predict.runners.resolve_auto")
        return self.precision or effective_precision(config.precision, self.device)

    def check(self, config: ConfigurationPlan) -> None:
        """A bad --tta, --tile, --accumulator, --runtime or --precision fails before any work, not once per case."""
        parse_tta(self.tta_flag, config.dim)
        config.inference_tile(self.tile)
        if self.accumulator not in ACCUMULATOR_DTYPES:
            raise InputError(f"--accumulator {self.accumulator!r}: use one of {', '.join(sorted(ACCUMULATOR_DTYPES))}")
        self.check_runtime()

    def check_runtime(self) -> None:
        """Refuse an unknown --runtime, a graph runtime off the CPU or without its extra, and a --precision this
        device does not compute in (``check_cpu_precision`` on the CPU). ``AUTO`` passes: it chooses among what
        this machine has."""
        if self.runtime not in (*RUNTIMES, AUTO):
            raise InputError(f"--runtime {self.runtime!r}: use one of {', '.join((AUTO, *RUNTIMES))}")
        if self.runtime not in ("torch", AUTO):
            if self.device != "cpu":
                raise InputError(
                    f"--runtime {self.runtime} runs on the CPU; predict with --device cpu or --runtime torch"
                )
            module, extra = RUNTIMES[self.runtime]
            require(module, extra, f"predicting with --runtime {self.runtime}")
        if self.precision not in (None, AUTO):
            check_precision(self.precision)
            if self.device == "cpu":
                check_cpu_precision(self.precision)
