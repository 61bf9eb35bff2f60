"""``RunConfig``: the knobs of one training run that are not part of the plan (`autoseg train`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.core.errors import InputError
from autoseg.model.optimizer import OPTIMIZERS, OptimizerSettings


@dataclass(frozen=True)
class RunConfig:
    """Knobs of one training run that are not part of the plan.

    ``resume``: continue from the fold's checkpoint_latest.pt (its schedule, degradations and random
    states; the plan must be unchanged). ``time_budget_s``: choose epochs, iterations per epoch (at most
    ``iterations_per_epoch``) and the final validation's cost so that the run ends within this many seconds
    (``autoseg.train.schedule.TimeBudget``; ``epochs`` is then only the schedule before the first decision).
    ``cpu_threads``: torch threads on CPU (None: every CPU, ``autoseg.core.machine.use_cpu_threads``).
    ``loader_workers``: batch-building worker processes (None: the plan's, sized by its host RAM budget).
    ``use_precomputed``: sample the precomputed spatially augmented copies instead of rotating and scaling
    on the fly (None: yes when every training case has copies; True fails if a case has none).
    ``precision_check``: after the final validation, on a CPU with native bf16, predict its cases in fp32 and bf16
    too and store the fold's bf16 agreement check (``autoseg.train.precision_check``).
    ``track``: log each epoch, the plan and the memory checks to TensorBoard and/or MLflow (``autoseg.train.tracking``).
    ``init_from``: a fresh run starts from this model's weights (an archive, a checkpoint file or a workspace;
    ``autoseg.train.init_weights``), fold ``init_fold`` (None: the model's first); a resumed run ignores both.
    """

    epochs: int = 1000
    iterations_per_epoch: int = 250
    val_iterations: int = 50
    optimizer: OptimizerSettings = OPTIMIZERS["sgd"]  # learning rate, momentum, weight decay, gradient clipping
    seed: int = 0
    device: str = "cpu"
    loader_workers: int | None = None  # None: the configuration's planned loader_workers
    use_precomputed: bool | None = None  # None: when every training case has precomputed augmented copies
    validate: bool = True  # predict and evaluate the fold's validation cases at the end
    precision_check: bool = True  # then the bf16 agreement check on those cases (native bf16 CPUs only)
    resume: bool = False
    time_budget_s: float | None = None
    cpu_threads: int | None = None
    track: tuple[str, ...] = ()  # --track: experiment trackers of ``autoseg.train.tracking.TRACKERS`` (rank 0 logs)
    init_from: str | None = None  # --init-from: the model whose weights a fresh run starts from
    init_fold: str | None = None  # --init-fold: its fold (None: its first)

    def __post_init__(self) -> None:
        for name in ("epochs", "iterations_per_epoch", "val_iterations"):
            if getattr(self, name) < 1:
                raise InputError(
                    f"RunConfig.{name} is {getattr(self, name)}; it must be at least 1 (--{name.replace('_', '-')})"
                )
        if self.loader_workers is not None and self.loader_workers < 0:
            raise InputError(f"RunConfig.loader_workers is {self.loader_workers}; give 0 or more (--loader-workers)")
        if self.init_fold is not None and self.init_from is None:
            raise InputError(f"--init-fold {self.init_fold} without --init-from: name the model to start from")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise InputError(f"RunConfig.time_budget_s is {self.time_budget_s}; give a positive time (--time-budget)")
