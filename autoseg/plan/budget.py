"""``Budget``: what the planner may spend (GPU memory, host RAM, device, CPU throughput, time per iteration)."""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError
from autoseg.core.precision import PRECISIONS
from autoseg.core.units import GiB
from autoseg.model.topology import ARCHITECTURES, PLAIN_UNET
from autoseg.plan.iteration_target import DEFAULT_TARGET, IterationTarget
from autoseg.plan.throughput import StepRates


@dataclass(frozen=True)
class Budget:
    """What the plan must fit in. ``device`` is where training runs: "cuda" or "cpu".

    ``safety_margin``: the fraction of the memory budget kept free (5%): the device model's error
    (fragmentation is modelled as 15% of the tensor bytes: docs/memory.md section 3) and what the plan does not
    see (another process on the GPU, a display). A memory-limited plan's predicted peak then lies
    between ``FILL_TARGET`` (85%) and 95% of the budget. The memory budget is ``gpu_memory_bytes`` on
    CUDA and ``host_ram_bytes`` on CPU (the step's tensors live in host RAM there).
    ``cpu_seconds_per_iteration`` / ``cpu_flops_per_second`` / ``cpu_elements_per_second`` /
    ``cpu_mapped_bytes_per_second``: on CPU compute, not memory, is the limit; a step's seconds are
    ``cpu_rates.seconds`` (``autoseg.plan.throughput.StepRates``: its convolution FLOPs, its feature-map elements
    and the bytes it maps afresh, each at its rate; a rate of None drops its term). The CLI measures them with
    ``autoseg.plan.calibration.cpu_throughput``; ``cpu_rates_source`` says where they came from (measured now, the
    machine cache and its date, a fallback, --cpu-flops), for the plan to record.
    ``iteration``: the seconds a CPU iteration is sized to (``cpu_seconds_per_iteration``), why and for which time
    budget (``autoseg.plan.iteration_target``: the CLI's ``--time-budget`` by its rule; the default 1 s without).
    ``gpu_name``: for the throughput table (``autoseg.plan.throughput``); None: a typical GPU of this memory.
    ``cpu_count``: None = this machine's (``autoseg.core.resources.cpu_count``).
    ``architecture``: the network every configuration is planned with (``NetworkTopology.architecture``).
    """

    gpu_memory_bytes: int = 8 * GiB
    host_ram_bytes: int = 16 * GiB
    device: str = "cuda"
    safety_margin: float = 0.05
    iteration: IterationTarget = DEFAULT_TARGET
    cpu_flops_per_second: float = 20e9
    cpu_elements_per_second: float | None = None
    cpu_mapped_bytes_per_second: float | None = None
    cpu_rates_source: str = ""
    base_features: int | None = None  # None: 32 on CUDA; on CPU 16, or 8 if 16 leaves too small a patch
    precision: str | None = None  # None: fp16 (autocast) on CUDA, fp32 on CPU
    gpu_name: str | None = None
    cpu_count: int | None = None
    architecture: str = PLAIN_UNET

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise InputError(f"Budget.device {self.device!r}: use 'cuda' or 'cpu'")
        if not 0.0 <= self.safety_margin < 0.5:
            raise InputError(f"Budget.safety_margin {self.safety_margin} must be in [0, 0.5)")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise InputError(f"Budget.precision {self.precision!r}: use one of {sorted(PRECISIONS)}")
        if self.architecture not in ARCHITECTURES.values():
            raise InputError(
                f"Budget.architecture {self.architecture!r}: use one of {sorted(ARCHITECTURES.values())} "
                f"(autoseg plan --architecture {'|'.join(ARCHITECTURES)})"
            )
        if self.device == "cpu" and self.precision not in (None, "fp32"):
            raise InputError(
                "training on CPU runs in fp32 (autoseg.train.trainer uses autocast on CUDA only); "
                "leave Budget.precision unset for device 'cpu'"
            )

    @property
    def cpu_seconds_per_iteration(self) -> float:
        return self.iteration.seconds

    @property
    def cpu_rates(self) -> StepRates:
        return StepRates(self.cpu_flops_per_second, self.cpu_elements_per_second, self.cpu_mapped_bytes_per_second)

    @property
    def memory_bytes(self) -> int:
        """The memory the training step must fit in: GPU memory on CUDA, host RAM on CPU."""
        return int(self.gpu_memory_bytes if self.device == "cuda" else self.host_ram_bytes)

    @property
    def memory_limit_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.safety_margin)
