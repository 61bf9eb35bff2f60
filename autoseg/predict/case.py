"""One case's prediction, its three stages one after the other: preprocess (``prepare_case``, ``preprocess_case``), the
sliding window over every fold (``predict_labels`` or ``predict_probabilities``) and the export in the input's own
grid (slab by slab inside the window, ``SlabExport``, or ``export_prediction``).

A ``Predictor`` (``autoseg.predict.networks``) is what these functions share: one configuration's folds as tile
runners, its plan and the command's ``WindowOptions``. Each case's window is planned before it starts
(``inference_plan``: the tile batch and the accumulator's place within ``inference_budget_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from autoseg.core.resources import available_ram_bytes
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case, load_case
from autoseg.memory.inference import InferenceSetting
from autoseg.memory.inference_plan import InferencePlan, plan_inference
from autoseg.model.agreement import Agreement, AgreementCounter
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tile_buffers import OUTPUT_DTYPES
from autoseg.model.tiles import overlap_step_fractions, tile_layout
from autoseg.model.window import SlidingWindow
from autoseg.plan.inference_tile import inference_budget_share, tile_for_image
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.cascade import cascade_input
from autoseg.predict.export import SlabExport, export_segmentation, export_with_probabilities
from autoseg.predict.networks import Predictor
from autoseg.predict.probabilities import ProbabilityFile
from autoseg.predict.uncertainty import UncertaintyParts
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.preprocessor import preprocess_case
from autoseg.preprocess.store import CaseProperties

log = logging.getLogger("autoseg")

# The probabilities of a case between the sliding window and the export: float16 halves the largest array
# prediction holds (outputs x the image); the label map is their argmax (regions: thresholded at 0.5), so only
# voxels whose top two classes are within float16's 1e-3 of each other can change.
PROBABILITIES_DTYPE = "float16"
PROBABILITIES_BYTES = OUTPUT_DTYPES[PROBABILITIES_DTYPE]


def predict_case(
    case: Case,
    predictor: Predictor,
    probabilities_path: Path | None = None,
    previous: np.ndarray | None = None,
) -> tuple[np.ndarray, CaseProperties]:
    """``predict_image`` of ``case`` as read."""
    data, _, geometry = load_case(case)
    return predict_image(data, geometry, case.case_id, predictor, probabilities_path, previous)


def predict_image(
    data: np.ndarray,
    geometry: Geometry,
    case_id: str,
    predictor: Predictor,
    probabilities_path: Path | None = None,
    previous: np.ndarray | None = None,
) -> tuple[np.ndarray, CaseProperties]:
    """Label map (Z, Y, X) of ``data`` (C, Z, Y, X) float32 in its own grid; with ``probabilities_path``
    the probabilities are written there too (``ProbabilityFile``, atomically). The stages one after the other:
    ``preprocess_case``, then ``predict_labels`` (or ``predict_probabilities`` and ``export_prediction``).
    ``previous``: a cascade stage's previous-stage label map (Z, Y, X) of the image (``cascade_input``)."""
    plans, config = predictor.plans, predictor.config
    data, _, props = preprocess_case(data, None, geometry, plans, config, case_id)
    if config.previous_stage:
        data = cascade_input(data, previous, props, plans, config)
    if probabilities_path is None:
        return predict_labels(data, props, case_id, predictor), props
    probabilities = predict_probabilities(data, case_id, predictor)
    del data
    labels = export_prediction(probabilities, props, plans.label_scheme, probabilities_path, predictor.class_weights)
    return labels, props


def prepare_case(case: Case, plans: Plans, config: ConfigurationPlan) -> tuple[np.ndarray, CaseProperties]:
    """Read ``case`` and preprocess it as in training: the (C, Z', Y', X') float32 input of the sliding window
    and what export needs to go back to the original grid."""
    data, _, geometry = load_case(case)
    data, _, props = preprocess_case(data, None, geometry, plans, config, case.case_id)
    return data, props


def predict_probabilities(data: np.ndarray, case_id: str, predictor: Predictor) -> torch.Tensor:
    """(K, Z', Y', X') float16 probabilities (on the host) of a preprocessed image: the sliding window's softmax
    (classes) or sigmoid (regions) of the logits averaged over the folds and mirror variants."""
    probabilities = _sliding_window(data, case_id, predictor, on_slab=None)
    assert probabilities is not None
    return probabilities


def predict_labels(
    data: np.ndarray,
    props: CaseProperties,
    case_id: str,
    predictor: Predictor,
    uncertainty: UncertaintyParts | None = None,
) -> np.ndarray:
    """The label map (Z, Y, X) in the original grid of a preprocessed image, exported slab by slab as the sliding
    window finishes them (``SlabExport``): the probabilities are never held whole. ``uncertainty``: the members'
    agreement is counted into its counter and the export's maps pass through its entropy map."""
    export = SlabExport(props, predictor.plans.label_scheme, tuple(data.shape[1:]), predictor.class_weights)
    if uncertainty is None:
        _sliding_window(data, case_id, predictor, on_slab=export.add)
    else:
        on_slab = partial(_add_slab, export, uncertainty.entropy.add)
        _sliding_window(data, case_id, predictor, on_slab=on_slab, agreement=uncertainty.counter)
    return export.labels()


def _add_slab(export: SlabExport, on_output: Callable, z_start: int, z_stop: int, probabilities: torch.Tensor) -> None:
    export.add(z_start, z_stop, probabilities, on_output)


def _sliding_window(
    data: np.ndarray,
    case_id: str,
    predictor: Predictor,
    on_slab: Callable | None,
    agreement: AgreementCounter | None = None,
) -> torch.Tensor | None:
    """``sliding_window_predict`` over every fold at once with the plan's settings: the probabilities (float16,
    ``on_slab`` None) or nothing (each slab went to ``on_slab``). The window's options (``WindowOptions``): its
    mirror variants (``--tta``); its tile ("planned" or "patch", this image's: ``tile_for_image``), consecutive tiles
    overlapping by ``1 - step_fraction`` of the training patch (``overlap_step_fractions``); its tile batch (None:
    the largest that ``plan_inference`` predicts to fit, which also places the accumulator: ``inference_plan``) and
    the accumulator's dtype. ``agreement``: where the members' disagreement is counted (``autoseg.model.agreement``)."""
    config, window, scheme = predictor.config, predictor.window, predictor.plans.label_scheme
    image_shape = tuple(data.shape[1:])
    compared = None if agreement is None else agreement.agreement
    plan = inference_plan(predictor, image_shape, streamed=on_slab is not None, agreement=compared)
    tile_size, steps = window_tile(config, window, image_shape)
    (log.info if window.verbose else log.debug)(
        "case %s, input %s: tile %s (%s), %d tile(s) x %d fold(s); %s",
        case_id,
        "x".join(map(str, image_shape)),
        "x".join(map(str, tile_size)),
        window.tile,
        tile_layout(image_shape, tile_size, steps).num_tiles,
        len(predictor.runners),
        plan.describe(),
    )
    sliding = SlidingWindow(
        tile_size,
        scheme.num_outputs,
        step_fraction=steps,
        mirror_axes=window.mirror_axes(config),
        tta=window.num_variants(config),
        tile_batch_size=plan.tile_batch_size,
        accumulator_device=plan.accumulator_device,
        accumulator_dtype=plan.accumulator_dtype,
        activation=scheme.activation,  # "none": the logits are resampled, the activation applied after (export)
        output_dtype=PROBABILITIES_DTYPE,
        gaussian_centre=predictor.plans.gaussian_centre,
        agreement=compared,
    )
    return sliding_window_predict(predictor.runners, data, sliding, on_slab, agreement)


def window_tile(
    config: ConfigurationPlan, window: WindowOptions, image_shape_zyx: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The sliding window's tile over a preprocessed image of ``image_shape_zyx`` (``tile_for_image`` of
    ``window.tile``) and its per-axis step fractions (``overlap_step_fractions``): with ``tile_layout`` they give
    the tiles the window predicts."""
    tile_size = tile_for_image(config, image_shape_zyx, window.tile, window.step_fraction)
    return tile_size, overlap_step_fractions(tile_size, config.patch_size, window.step_fraction)


def export_prediction(
    probabilities: torch.Tensor,
    props: CaseProperties,
    scheme: LabelScheme,
    probabilities_path: Path | None = None,
    class_weights: np.ndarray | None = None,
) -> np.ndarray:
    """The label map in the original grid (``export_segmentation``, the argmax weighted by ``class_weights``); with
    ``probabilities_path`` the (unweighted) probabilities are streamed into that ``ProbabilityFile`` on the way."""
    if probabilities_path is None:
        return export_segmentation(probabilities, props, scheme, weights=class_weights)
    with ProbabilityFile.open(probabilities_path, props, scheme) as file:
        return export_with_probabilities(probabilities, props, scheme, file.write_output, class_weights)


def inference_plan(
    predictor: Predictor,
    image_shape_zyx: tuple[int, ...],
    streamed: bool = True,
    agreement: Agreement | None = None,
) -> InferencePlan:
    """How the sliding window runs on an image of ``image_shape_zyx`` with ``predictor``'s configuration, folds and
    window options (``_sliding_window``), chosen before it starts (``plan_inference``, which asks the runners for
    their working bytes) within ``inference_budget_bytes(device)``; a given ``tile_batch_size`` caps the batch at
    that number. ``streamed``: the slabs go to a ``SlabExport`` (no output volume); else a float16 output.
    ``agreement``: the members whose disagreement the window counts (``autoseg.model.agreement``). The
    tile simulations are kept between runs where the command keeps them (``kept_simulations``)."""
    config, window = predictor.config, predictor.window
    tile_size, steps = window_tile(config, window, tuple(image_shape_zyx))
    setting = InferenceSetting(
        config.network,
        tile_size,
        tuple(image_shape_zyx),
        predictor.plans.label_scheme.num_outputs,
        device=window.device,
        precision=window.compute_precision(config),
        mirror_axes=window.mirror_axes(config),
        tta=window.num_variants(config),
        step_fraction=steps,
        output_dtype=None if streamed else PROBABILITIES_DTYPE,
        accumulator_dtype=window.accumulator,
        agreement=agreement,
    )
    return plan_inference(
        setting, inference_budget_bytes(window.device), window.tile_batch_size, runners=predictor.runners
    )


def inference_budget_bytes(device: str) -> int:
    """The memory one sliding window may use (``inference_budget_share``, as the inference tile was planned): 90%
    of the CUDA device's memory, or half the host RAM available now on CPU (the rest for reading, resampling and
    export)."""
    if device.startswith("cuda"):
        return inference_budget_share(device, torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return inference_budget_share(device, available_ram_bytes())
