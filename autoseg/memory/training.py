"""The training step as live tensor bytes: simulated under ``FakeTensorMode`` or measured on real CPU tensors.

The step is THE training step, ``autoseg.model.step.TrainStep``, built by ``build_step`` as ``autoseg train``
builds it (network, Dice + CE or Dice + BCE with deep supervision and the ignore label, autocast of the
precision, SGD or AdamW with ``foreach`` as on CUDA, gradient clipping, accumulation) and fed synthetic
batches (``synthetic_batches``: float32 data, the loader's int8 target). ``StorageTracker`` records every
storage it allocates and frees; the step's ``trace`` marks its phases and tags the forward pass per stage.
The optimizer's state (SGD momentum, Adam moments) is allocated beforehand by one update on zero
gradients, as it is in every step after the first. With ``accumulation_steps > 1`` two micro-batches are
run: the second one carries the first one's gradients, and every later one looks like it.

Simulation and measurement run the same code (``autoseg.memory.training_simulation``); only the tensors differ
(fake ones hold no memory). The difference between them is what the dispatcher cannot see (a CPU kernel's
private scratch). This module describes the step and keeps its simulations; it imports torch (through the
simulation) only when a step must run.

Known differences from a CUDA run, all small or modelled elsewhere: the step runs on a CPU device, so CPU
autocast's op policy applies, except where it differs from CUDA's (``autocast_policy``: ``avg_pool3d``), which a
CUDA step's simulation runs as CUDA does; fp16 runs without the GradScaler (it scales only on CUDA; its state is a
few scalars); the caching allocator's rounding, fragmentation and convolution workspaces are in
``autoseg.memory.device``.
"""

from __future__ import annotations

import hashlib
import json

from autoseg.core.machine import kept_simulations, simulation_key
from autoseg.memory.step_record import StepConfig, StepRecord, TrainingMemory

# the code a simulated step runs: a change to any of these files simulates again
SIMULATED_MODULES = tuple(
    f"autoseg.model.{m}" for m in ("blocks", "loss", "network", "optimizer", "residual", "step", "topology")
) + (
    "autoseg.memory.tracker",
    "autoseg.memory.training_simulation",
    "autoseg.memory.autocast_policy",
    "autoseg.memory.step_record",
    "autoseg.memory.glibc_heap",
    "autoseg.dataset.labels",
    "autoseg.core.precision",
    __name__,
)


def record_training_step(cfg: StepConfig, fake: bool = True) -> StepRecord:
    """Run the step under ``FakeTensorMode`` (``fake``) or for real on CPU, and return its timeline. A simulated
    step is kept between runs while ``keep_simulations_in`` has set a cache (the CLI does), one file a step in its
    ``training_steps/``, keyed by the step and the code that simulates it (``SIMULATED_MODULES``, torch's
    version): a re-plan then reads its simulations instead of running them (each 0.3-1.5 s, and the first one
    imports torch and its fake-tensor machinery, ~2-4 s; a re-plan that finds every step kept imports neither)."""
    kept = kept_simulations("training_steps")
    if not fake or kept is None:
        return _record_training_step(cfg, fake)
    key = {**simulation_key(SIMULATED_MODULES), "step": repr(cfg)}
    name = "step-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    value, _ = kept.kept(name, key, lambda: _record_training_step(cfg, fake).to_json(), max_entries=1)
    return StepRecord.from_json(value)


def _record_training_step(cfg: StepConfig, fake: bool) -> StepRecord:
    from autoseg.memory.training_simulation import record_step  # torch: imported once a step must run

    return record_step(cfg, fake)


def simulate_training_step(step: StepConfig) -> TrainingMemory:
    """Peak live tensor bytes of one training step, predicted without allocating (FakeTensorMode).

    ``step``: the network, batch, patch (``(z, y, x)`` or ``(y, x)``, multiples of ``topology.patch_divisor()``),
    precision, checkpointing, optimizer, accumulation, labels (the plan's ``LabelScheme``: regions and the ignore
    label change the loss; None: plain classes, one region for a single-output network) and device ("cpu": each
    convolution's hidden oneDNN buffers count as alive while it runs). About 0.1-1 s, independent of the patch size.
    """
    return record_training_step(step, fake=True).peak()


def measure_training_step(step: StepConfig) -> int:
    """The same step run for real on CPU tensors, tracked the same way (``step.device`` as modelled: "cpu" counts
    the convolutions' hidden buffers): peak live tensor bytes.

    Allocates and computes for real: keep the sizes small. The caller's RNG state is left untouched.
    """
    return int(record_training_step(step, fake=False).timeline.sum(axis=1).max())
