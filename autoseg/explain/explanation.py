"""`autoseg explain`: where the memory of one planned configuration goes, and what would change it.

``explain(plans, config_name)`` runs the memory model (``autoseg.memory``) on the configuration as planned
and returns an ``Explanation`` of plain numbers (bytes): the training step's peak split into parameters,
gradients, optimizer state, the input batch, the activations each network stage saves for backward (with
the stage's feature-map shape, so a reader sees why a stage is big), the transient rest, and the device's
own terms (allocator rounding and fragmentation, convolution workspace, CUDA context); sliding-window
inference on the median image and the host RAM of a preprocessing worker and an export
(``autoseg.explain.inference_and_host``); a loader worker's host RAM; and
what-if rows (batch +1, batch 1, precision, checkpointing, the next patch size up) with their predicted
peaks. ``format_explanation`` renders it as tables with sentences derived from the numbers;
``Explanation.to_dict`` is the same figures for ``--json``.

Each what-if is one direct simulation (0.5-3 s for realistic networks, cached per process).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.core.workspace import Workspace
from autoseg.explain.inference_and_host import HostCase, host_cases, inference_terms
from autoseg.memory.device import DEVICE_TERMS, DEVICES, predict_device_peak
from autoseg.memory.loader_worker import worker_bytes
from autoseg.memory.step_record import StepConfig, TrainingMemory
from autoseg.memory.training import simulate_training_step
from autoseg.model.topology import NetworkTopology
from autoseg.plan.configuration import AMP_PRECISION
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.iteration_target import IterationTarget
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.training_data import loader_config

__all__ = [
    "Explanation",
    "HostCase",
    "NetworkSummary",
    "StageMemory",
    "WhatIf",
    "explain",
    "network_summary",
    "next_patch_up",
]


@dataclass(frozen=True)
class StageMemory:
    """Bytes a network stage keeps alive at the end of the forward (what backward will need).

    ``shape``: the stage's spatial feature-map size ``(z, y, x)`` / ``(y, x)``; ``features``: its channels.
    ``map_copies``: ``activation_bytes / (batch x features x voxels x 4 B)``, how many fp32 feature maps of
    that size the stage keeps per sample (conv outputs, norm outputs, concatenations, ...).
    """

    name: str
    features: int
    shape: tuple[int, ...]
    activation_bytes: int
    map_copies: float


@dataclass(frozen=True)
class WhatIf:
    """One variation of the plan and its predicted device peak (``total_bytes``, tensors + device terms)."""

    change: str
    batch_size: int
    patch_size: tuple[int, ...]
    precision: str
    checkpointing: bool
    tensor_bytes: int
    total_bytes: int
    fits: bool


@dataclass(frozen=True)
class NetworkSummary:
    """The planned network: its ``architecture`` (``NetworkTopology.architecture``), channels per stage, the blocks of
    each encoder stage (``encoder_block``: "conv" blocks of a plain U-Net, "residual" blocks after a stem conv
    block of a residual encoder) and the conv blocks per decoder stage; ``parameters``: trainable values."""

    architecture: str
    features_per_stage: tuple[int, ...]
    encoder_block: str
    encoder_blocks_per_stage: tuple[int, ...]
    decoder_convs_per_stage: int
    parameters: int


def network_summary(topology: NetworkTopology, parameter_bytes: int) -> NetworkSummary:
    """``NetworkSummary`` of ``topology``; ``parameter_bytes``: its fp32 parameters as the memory model counts them."""
    residual = bool(topology.blocks_per_stage)
    return NetworkSummary(
        architecture=topology.architecture,
        features_per_stage=tuple(topology.features_per_stage),
        encoder_block="residual" if residual else "conv",
        encoder_blocks_per_stage=tuple(topology.blocks_per_stage)
        if residual
        else (topology.conv_per_stage,) * topology.num_stages,
        decoder_convs_per_stage=topology.conv_per_stage,
        parameters=parameter_bytes // 4,
    )


@dataclass(frozen=True)
class Explanation:
    """Where one configuration's memory goes. All sizes in bytes.

    ``training_terms`` sum to ``training_total_bytes`` (the predicted device peak of one training step);
    ``inference_terms`` sum to ``inference_total_bytes``. ``precision`` is what runs on ``device`` (AMP
    applies on CUDA only; on CPU the trainer runs fp32), ``planned_precision`` what the plan says.
    ``budget_bytes`` is the plan's GPU memory for cuda, its host RAM for cpu. ``network``: what the plan builds
    (``NetworkSummary``).
    """

    config_name: str
    device: str
    patch_size: tuple[int, ...]
    batch_size: int
    accumulation_steps: int
    precision: str
    planned_precision: str
    checkpointing: bool
    budget_name: str
    budget_bytes: int
    peak_phase: str
    training_terms: dict[str, int]
    training_total_bytes: int
    stages: tuple[StageMemory, ...]
    inference_image_shape_zyx: tuple[int, int, int]
    inference_precision: str
    inference_phase: str
    inference_terms: dict[str, int]
    inference_total_bytes: int
    host_ram_bytes: int
    preprocessing_processes: int
    loader_workers: int
    loader_queue_depth: int
    loader_worker: dict[str, int]  # autoseg.memory.loader_worker.worker_bytes
    host_cases: tuple[HostCase, ...]
    what_ifs: tuple[WhatIf, ...]
    predicted_seconds_per_iteration: float | None = None  # the plan's, at the throughput below
    cpu_flops_per_second: float | None = None  # CPU plans: the measured throughput it was sized for
    cpu_elements_per_second: float | None = None  # ... and the element rate beside it (None: FLOPs alone)
    cpu_mapped_bytes_per_second: float | None = None  # ... and the rate of mapping fresh pages
    cpu_rates_source: str = ""  # ... and where they came from (Plans.cpu_rates_source)
    iteration: IterationTarget | None = None  # CPU plans: the seconds an iteration was sized to, why (Plans.iteration)
    network: NetworkSummary | None = None

    @property
    def headroom_bytes(self) -> int:
        """Budget left over at the training peak (negative: over budget)."""
        return self.budget_bytes - self.training_total_bytes

    def to_dict(self) -> dict:
        """JSON-ready copy of every figure (tuples become lists in ``json.dumps``)."""
        return {
            "units": "bytes",
            **asdict(self),
            "headroom_bytes": self.headroom_bytes,
            "fits": self.headroom_bytes >= 0,
        }


def explain_plans_file(plans_path: Path, config_name: str | None, device: str | None) -> Explanation:
    """``explain`` of a plans.json (``config_name`` None: its default configuration), with the dataset's
    fingerprint.json when it lies beside it, as in a workspace."""
    plans = Plans.from_json(plans_path)
    fingerprint_path = Workspace.at(plans_path.parent).fingerprint_path
    fingerprint = Fingerprint.from_json(fingerprint_path) if fingerprint_path.is_file() else None
    return explain(plans, config_name or plans.default_configuration(), device=device, fingerprint=fingerprint)


def explain(
    plans: Plans, config_name: str, device: str | None = None, fingerprint: Fingerprint | None = None
) -> Explanation:
    """Explain the memory of configuration ``config_name`` on ``device`` (default: the one it was planned
    for). ``fingerprint``: the dataset's, for the host rows of the median and the largest case at their
    original shapes; without it the host rows use the plan's median shape (no resampling)."""
    config = plans.configuration(config_name)  # KeyError naming the available configurations
    device = device or config.device
    if device not in DEVICES:
        raise InputError(f"device {device!r} is not modelled; use one of {list(DEVICES)} (--device)")
    precision = effective_precision(config.precision, device)
    budget_name, budget = (
        ("GPU memory", plans.gpu_memory_bytes) if device == "cuda" else ("host RAM", plans.host_ram_bytes)
    )
    step = _simulate(config, config.batch_size, tuple(config.patch_size), precision, config.checkpointing, device)
    terms = _training_terms(step, device)
    inference_phase, inference = inference_terms(plans, config, device, precision)
    loader = loader_config(config, augment=True)  # the trainer's, on the fly
    return Explanation(
        config_name=config_name,
        device=device,
        patch_size=tuple(config.patch_size),
        batch_size=config.batch_size,
        accumulation_steps=config.accumulation_steps,
        precision=precision,
        planned_precision=config.precision,
        checkpointing=config.checkpointing,
        budget_name=budget_name,
        budget_bytes=int(budget),
        peak_phase=step.peak_phase,
        training_terms=terms,
        training_total_bytes=sum(terms.values()),
        stages=_stages(config, step),
        inference_image_shape_zyx=tuple(config.median_shape_zyx),
        inference_precision=precision,
        inference_phase=inference_phase,
        inference_terms=inference,
        inference_total_bytes=sum(inference.values()),
        host_ram_bytes=int(plans.host_ram_bytes),
        preprocessing_processes=plans.preprocessing_processes,
        loader_workers=config.loader_workers,
        loader_queue_depth=config.loader_queue_depth,
        loader_worker=worker_bytes(
            config.patch_size,
            loader.enlarged_patch_size,
            config.batch_size,
            plans.input_channels(config),
            config.loader_queue_depth,
            dummy_2d=loader.dummy_2d,
        ),
        host_cases=host_cases(plans, config, fingerprint),
        what_ifs=_what_ifs(config, device, precision, int(budget), step),
        predicted_seconds_per_iteration=config.predicted_seconds_per_iteration,
        **_cpu_time_fields(plans),
        network=network_summary(config.network, step.parameter_bytes),
    )


def _cpu_time_fields(plans: Plans) -> dict:
    """What a CPU plan records about time: the rates its steps were priced at, where they came from, the seconds an
    iteration was sized to and why (None / "" in a CUDA plan)."""
    return dict(
        cpu_flops_per_second=plans.cpu_flops_per_second,
        cpu_elements_per_second=plans.cpu_elements_per_second,
        cpu_mapped_bytes_per_second=plans.cpu_mapped_bytes_per_second,
        cpu_rates_source=plans.cpu_rates_source,
        iteration=plans.iteration,
    )


def _simulate(
    config: ConfigurationPlan,
    batch_size: int,
    patch_size: tuple[int, ...],
    precision: str,
    checkpointing: bool,
    device: str,
) -> TrainingMemory:
    return _simulate_cached(
        config.network, batch_size, patch_size, precision, checkpointing, config.accumulation_steps, device
    )


@functools.lru_cache(maxsize=64)
def _simulate_cached(
    topology: NetworkTopology,
    batch_size: int,
    patch_size: tuple[int, ...],
    precision: str,
    checkpointing: bool,
    accumulation_steps: int,
    device: str,
) -> TrainingMemory:
    """The simulation is deterministic: explaining again (another budget) reuses it."""
    return simulate_training_step(
        StepConfig(
            topology,
            batch_size,
            patch_size,
            precision=precision,
            checkpointing=checkpointing,
            accumulation_steps=accumulation_steps,
            device=device,
        )
    )


def _training_terms(step: TrainingMemory, device: str) -> dict[str, int]:
    """The step's tensors at the peak, activations split into what the stages saved at the end of the
    forward and the transient rest (loss and backward temporaries, net of saved tensors already released),
    then the device's terms."""
    saved = min(sum(step.stage_activation_bytes.values()), step.activation_bytes)
    device_terms = predict_device_peak(step, device)
    return {
        "parameters": step.parameter_bytes,
        "gradients": step.gradient_bytes,
        "optimizer_state": step.optimizer_state_bytes,
        "batch": step.batch_bytes,
        "saved_activations": saved,
        "transient_activations": step.activation_bytes - saved,
        **{k: v for k, v in device_terms.items() if k in DEVICE_TERMS},
    }


def _stage_key(name: str) -> tuple[int, int]:
    """Execution order: encoder 0..n-1, decoder n-2..0, seg heads, then anything else."""
    group, _, index = name.partition(".")
    order = {"encoder": 0, "decoder": 1, "seg_heads": 2}.get(group, 3)
    i = int(index) if index.isdigit() else 0
    return order, (i if order == 0 else -i)


def _stages(config: ConfigurationPlan, step: TrainingMemory) -> tuple[StageMemory, ...]:
    topo = config.network
    shapes, size = [], list(config.patch_size)
    for stride in topo.strides:
        size = [p // s for p, s in zip(size, stride)]
        shapes.append(tuple(size))
    rows = []
    for name in sorted(step.stage_activation_bytes, key=_stage_key):
        group, _, index = name.partition(".")
        s = int(index) if index.isdigit() else -1
        if group in ("encoder", "decoder") and 0 <= s < topo.num_stages:
            features, shape = topo.features_per_stage[s], shapes[s]
        elif group == "seg_heads" and 0 <= s < topo.num_stages:
            features, shape = topo.num_outputs, shapes[s]
        else:
            features, shape = 0, ()
        nbytes = step.stage_activation_bytes[name]
        map_bytes = config.batch_size * features * math.prod(shape) * 4
        rows.append(StageMemory(name, features, shape, nbytes, nbytes / map_bytes if map_bytes else 0.0))
    return tuple(rows)


def next_patch_up(config: ConfigurationPlan) -> tuple[tuple[int, ...], int]:
    """The patch grown by one stride multiple on the axis with the most room (largest median / patch
    ratio), and that axis's index into the patch."""
    divisor = config.network.patch_divisor()
    median = tuple(config.median_shape_zyx)[-config.dim :]
    axis = max(range(config.dim), key=lambda a: median[a] / config.patch_size[a])
    patch = list(config.patch_size)
    patch[axis] += divisor[axis]
    return tuple(patch), axis


def _what_if_settings(
    config: ConfigurationPlan, device: str, precision: str
) -> list[tuple[str, int, tuple[int, ...], str, bool]]:
    b, patch, ckpt = config.batch_size, tuple(config.patch_size), config.checkpointing
    rows = [("as planned", b, patch, precision, ckpt), (f"batch {b + 1} (+1)", b + 1, patch, precision, ckpt)]
    if b > 1:
        rows.append(("batch 1", 1, patch, precision, ckpt))
    if device == "cuda":
        other = "fp32" if precision != "fp32" else AMP_PRECISION
        rows.append((f"{other} ({'no AMP' if other == 'fp32' else 'AMP'})", b, patch, other, ckpt))
    rows.append((f"checkpointing {'off' if ckpt else 'on'}", b, patch, precision, not ckpt))
    bigger, axis = next_patch_up(config)
    axis_name = "zyx"[-config.dim :][axis]
    rows.append((f"patch {'x'.join(map(str, bigger))} (next up in {axis_name})", b, bigger, precision, ckpt))
    least_precision = AMP_PRECISION if device == "cuda" and precision == "fp32" else precision
    if (b, least_precision, ckpt) != (1, precision, True):
        amp = " + AMP" if least_precision != precision else ""
        rows.append((f"batch 1{amp} + checkpointing (least at this patch)", 1, patch, least_precision, True))
    return rows


def _what_ifs(
    config: ConfigurationPlan, device: str, precision: str, budget: int, planned: TrainingMemory
) -> tuple[WhatIf, ...]:
    out = []
    for i, (change, batch, patch, prec, ckpt) in enumerate(_what_if_settings(config, device, precision)):
        step = planned if i == 0 else _simulate(config, batch, patch, prec, ckpt, device)
        total = predict_device_peak(step, device)["total"]
        out.append(WhatIf(change, batch, patch, prec, ckpt, step.peak_bytes, total, total <= budget))
    return tuple(out)
