"""``autoseg plan DATASET --like MODEL``: a dataset planned with a trained model's network, so that the model's
weights fit it (``autoseg train --init-from MODEL``), as nnU-Net's plans transfer does.

``PlanTemplate`` is the planner's option (``autoseg.plan.planner.plan``): the model's configurations as it planned
them. Each of them that suits the dataset keeps the model's network topology (architecture, depth, features,
kernels, strides; the input channels and outputs become the dataset's), its target spacing and its patch; the
memory model then checks that topology with the new dataset's channel count against this budget and sizes what may
change without touching the weights: the batch, gradient accumulation and activation checkpointing, cheapest first
(the settings the planner tries, ``configuration.candidate_settings``). When even micro-batch 1 with checkpointing
does not fit, the plan is refused naming the budget it needs. Each configuration's notes say where its network came
from; ``limited_by`` is ``LIKE_MODEL``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoseg.core.errors import InputError
from autoseg.core.units import MiB
from autoseg.plan.budget import Budget
from autoseg.plan.configuration import candidate_settings, chosen_fields, model_peak_fn, step_limits
from autoseg.plan.patch_search import SearchSpace, largest_batch
from autoseg.plan.plans import ConfigurationPlan
from autoseg.plan.step_cost import Candidate, PeakFn, Setting, StepCost

LIKE_MODEL = "like_model"  # ConfigurationPlan.limited_by: the patch and network are the model's


@dataclass(frozen=True)
class PlanTemplate:
    """The trained model a plan copies: ``source`` names it (for the notes and the advice), ``configurations`` are
    its configurations as planned (a checkpoint file outside its workspace: the one it was trained with)."""

    source: str
    configurations: dict[str, ConfigurationPlan]


def like_configuration(
    name: str,
    spacing_mm: tuple[float, float, float],
    median_shape_zyx: tuple[int, ...],
    space: SearchSpace,
    model: ConfigurationPlan,
    source: str,
    budget: Budget,
    peak_fn: PeakFn | None = None,
) -> ConfigurationPlan:
    """Configuration ``name`` with ``model``'s network and patch over ``space`` (the new dataset's axes at
    ``spacing_mm``, the model's target spacing); batch, accumulation and checkpointing as the budget allows."""
    topology = replace(model.network, in_channels=space.in_channels, num_outputs=space.num_outputs)
    patch = tuple(model.patch_size)
    model_backed = peak_fn is None
    peak_fn = peak_fn or model_peak_fn(budget.device)
    settings = _settings(budget, topology.dim, topology.architecture)
    limits, rates_source = step_limits(budget, settings[0].precision)
    tried = []
    for setting in settings:
        cost = StepCost(peak_fn, setting, limits)
        first = 1 if setting.single else 2
        tried.append(cost.peak(topology, first, patch))
        if tried[-1] <= limits.memory_bytes:
            batch = first if setting.single else largest_batch(space, topology, patch, cost)
            chosen = cost.candidate(topology, batch, patch, space.coverage(patch), space.max_batch(patch))
            break
    else:
        raise InputError(_too_small(name, source, patch, settings[-1], tried[-1], budget))
    return ConfigurationPlan(
        name=name,
        spacing_mm=spacing_mm,
        median_shape_zyx=tuple(median_shape_zyx),
        limited_by=LIKE_MODEL,
        notes=_notes(model, source, setting, chosen, rates_source),
        **chosen_fields(chosen, setting, budget, model_backed),
    )


def _settings(budget: Budget, dim: int, architecture: str) -> list[Setting]:
    """The planner's settings, cheapest first, once each: the widths they name do not apply (the network is the
    model's)."""
    settings = [replace(s, architecture=architecture) for s in candidate_settings(budget, dim)]
    return list({(s.precision, s.checkpointing, s.single): s for s in settings}.values())


def _notes(
    model: ConfigurationPlan, source: str, setting: Setting, chosen: Candidate, rates_source: str
) -> tuple[str, ...]:
    net = model.network
    notes = [
        f"network of {source} ({model.name}; plan --like): {net.architecture}, {net.num_stages} stages, features "
        f"{list(net.features_per_stage)}, strides {[list(s) for s in net.strides]}; its target spacing "
        f"{[round(s, 4) for s in model.spacing_mm]} mm and patch {list(model.patch_size)}, so that its weights fit "
        f"(autoseg train --init-from {source})"
    ]
    changes = [
        what
        for what, used in (
            ("activation checkpointing", setting.checkpointing),
            ("micro-batch 1 with 2 accumulation steps", setting.single),
        )
        if used
    ]
    if changes:
        notes.append(f"{' and '.join(changes)}: the model's network and patch do not fit the budget otherwise")
    notes.append(f"predicted {chosen.seconds:.2f} s per iteration from {rates_source}")
    return tuple(notes)


def _too_small(name: str, source: str, patch: tuple[int, ...], setting: Setting, peak: int, budget: Budget) -> str:
    flag = "--gpu-memory" if budget.device == "cuda" else "--ram"
    needed_mib = math.ceil(peak / (1.0 - budget.safety_margin) / MiB)
    return (
        f"{name}: the network of {source} (plan --like) with its patch {list(patch)} does not fit a budget of "
        f"{budget.memory_bytes / MiB:.0f} MiB ({flag}) even at micro-batch {1 if setting.single else 2}"
        f"{' with activation checkpointing' if setting.checkpointing else ''}: predicted {peak / MiB:.0f} MiB at its "
        f"peak; give at least {flag} {needed_mib}MiB (with its {budget.safety_margin:.0%} safety margin), or plan "
        "without --like (a network of its own, trained from scratch)"
    )
