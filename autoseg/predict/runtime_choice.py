"""``--runtime auto`` and ``--precision auto`` on the CPU: the runtime and precision that run a model's tiles fastest on
this machine, chosen by timing them, never from a table.

The candidates (``candidates``) are every installed runtime (``autoseg.core.extras.RUNTIMES``) in each precision it
computes that the CPU computes natively: fp32 always; bf16 (torch autocast, OpenVINO's inference hint) only where
``autoseg.core.precision.native_bf16_flag`` finds AVX-512 BF16 or AMX, and only for a model whose stored agreement
check passed for that runtime (the caller drops the others, saying why). Each candidate runs a tile batch of the
planned inference size (``timing_tiles``: the planned tile, as many mirror variants as one CPU forward pass takes)
once to warm up and then ``TIMED_RUNS`` times with prediction's thread count; its best wall seconds count
(``time_candidates``). The fastest is chosen (``RuntimeChoice``).

The seconds are kept per machine and model (``autoseg.core.machine.MachineCache``: keyed by the machine, the first
fold's checkpoint digest, the tile batch, the thread count and the runtimes' versions) unless other processes kept
the CPUs busy while they were timed (``autoseg.core.resources.busy_by_others``): then they choose for this run only
and the next run times again.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autoseg.core.errors import InputError, RunError
from autoseg.core.extras import RUNTIMES, installed
from autoseg.core.machine import Measurement
from autoseg.core.resources import OthersBusy, busy_by_others, cpu_count
from autoseg.memory.inference_plan import cpu_tile_batch_cap
from autoseg.model.graph_runners import GRAPH_RUNNERS
from autoseg.model.tile_runner import TileRunner
from autoseg.plan.plans import ConfigurationPlan
from autoseg.predict.window import AUTO, WindowOptions

log = logging.getLogger("autoseg")

TORCH_CPU_PRECISIONS = ("fp32", "bf16")  # torch on the CPU: fp32, or bf16 autocast (fp16 is CUDA's)
TIMED_RUNS = 2  # after one warm-up run; the best counts
CHOICE_VERSION = 1  # part of the cache key: a change to how candidates are timed times them again


@dataclass(frozen=True)
class Candidate:
    """A runtime (a key of ``RUNTIMES``) computing in a precision (a key of ``PRECISIONS``)."""

    runtime: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.runtime} {self.precision}"


def runtime_precisions(runtime: str) -> tuple[str, ...]:
    """The precisions ``runtime`` computes in on the CPU."""
    return TORCH_CPU_PRECISIONS if runtime == "torch" else GRAPH_RUNNERS[runtime].precisions


def candidates(window: WindowOptions, native_bf16: bool) -> tuple[Candidate, ...]:
    """What ``window``'s ``--runtime`` and ``--precision`` (either may be ``AUTO``) leave to choose from on this
    CPU: each installed runtime (or the one asked) in each precision it computes (or the one asked), bf16 only
    with ``native_bf16``."""
    runtimes = [r for r, (module, _) in RUNTIMES.items() if installed(module)] if window.runtime == AUTO else None
    wanted = None if window.precision == AUTO else window.precision or "fp32"  # None: the plan's, fp32 on the CPU
    return tuple(
        Candidate(runtime, precision)
        for runtime in runtimes or [window.runtime]
        for precision in runtime_precisions(runtime)
        if (precision != "bf16" or native_bf16) and wanted in (None, precision)
    )


def timing_tiles(config: ConfigurationPlan, window: WindowOptions) -> torch.Tensor:
    """The tile batch each candidate is timed on ``(B, C, *tile)`` float32, seeded noise: ``window``'s tile of
    ``config`` (the planned inference tile by default) and as many mirror variants as one CPU forward pass takes
    (``cpu_tile_batch_cap``, ``--tile-batch-size``)."""
    tile = config.inference_tile(window.tile)
    batch = min(cpu_tile_batch_cap(tile), window.num_variants(config), window.tile_batch_size or math.inf)
    noise = np.random.default_rng(0).standard_normal((int(batch), config.network.in_channels, *tile))
    return torch.from_numpy(noise.astype(np.float32))


def time_runner(runner: TileRunner, tiles: torch.Tensor) -> float:
    """The best wall seconds of ``TIMED_RUNS`` calls of ``runner`` on ``tiles``, after one warm-up call (a
    runtime's first call allocates and picks its kernels)."""
    runner(tiles)
    walls = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        runner(tiles)
        walls.append(time.perf_counter() - start)
    return min(walls)


def time_candidates(
    found: Sequence[Candidate], build: Callable[[Candidate], TileRunner], tiles: torch.Tensor
) -> Measurement:
    """Each of ``found`` built (``build``: one fold's runner) and timed on ``tiles`` (``time_runner``), one at a
    time; not to be kept when other processes kept the CPUs busy meanwhile (``busy_by_others``). A candidate that
    cannot be built or run (e.g. its ONNX graph failed the agreement check: ``RunError``) is None, with a warning
    naming why: no candidate of ``auto`` stops a prediction that another can run."""
    seconds: dict[str, float | None] = {}
    with OthersBusy() as others:
        for candidate in found:
            try:
                runner = build(candidate)
                seconds[candidate.name] = time_runner(runner, tiles)
            except (InputError, RunError) as e:
                log.warning("--runtime auto: %s is left out: %s", candidate.name, e)
                seconds[candidate.name] = None
            runner = None  # one candidate's weights and compiled graph at a time
    why = busy_by_others(others.cpus, cpu_count())
    details = {} if others.cpus is None else {"others": others.cpus}
    return Measurement(seconds, keep=not why, why_not_kept=why, details=details)


def runtime_versions(found: Sequence[Candidate]) -> dict[str, str]:
    """The installed version of each runtime among ``found`` (part of the cache key: a new version times again)."""
    return {c.runtime: importlib.metadata.version(RUNTIMES[c.runtime][0]) for c in found}


@dataclass(frozen=True)
class RuntimeChoice:
    """What ``--runtime``/``--precision auto`` chose: the fastest ``chosen`` of the timed candidates' ``seconds``
    (per tile batch ``tile_batch``, best of ``TIMED_RUNS``; by candidate name), where the seconds came from
    (``source``), and why bf16 was or was not among the candidates (``bf16``)."""

    chosen: Candidate
    seconds: dict[str, float | None]  # None: the candidate could not run
    tile_batch: tuple[int, ...]
    source: str
    bf16: str

    @classmethod
    def fastest(
        cls,
        seconds: dict[str, float | None],
        found: Sequence[Candidate],
        tile_batch: tuple[int, ...],
        source: str,
        bf16: str,
    ) -> RuntimeChoice:
        """The candidate of ``found`` with the fewest ``seconds`` (None: it could not run); refused when none ran."""
        ran = [c for c in found if seconds[c.name] is not None]
        if not ran:
            raise RunError(
                f"--runtime auto: none of {', '.join(c.name for c in found)} could run this model (the warnings above "
                "say why); predict with --runtime torch --precision fp32"
            )
        return cls(min(ran, key=lambda c: seconds[c.name]), seconds, tile_batch, source, bf16)

    def describe(self) -> str:
        """One line: the choice, each candidate's seconds (fastest first; "could not run"), where they came from, and
        bf16's verdict."""
        ordered = sorted(self.seconds.items(), key=lambda item: math.inf if item[1] is None else item[1])
        timed = ", ".join(f"{n} {'could not run' if s is None else f'{s:.3f} s'}" for n, s in ordered)
        return (
            f"runtime {self.chosen.runtime}, precision {self.chosen.precision} (auto: per tile batch "
            f"{self.tile_batch}: {timed}; {self.source}){f'; bf16: {self.bf16}' if self.bf16 else ''}"
        )
