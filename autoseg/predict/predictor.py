"""Prediction of new scans: preprocess, sliding window over every fold's network, export in the
input's exact geometry (size, spacing, origin, direction).

The export runs slab by slab inside the sliding window (``autoseg.predict.export.SlabExport``): each finished
slab of z-slices is resampled back to the original grid and becomes label-map slices at once, so the image's
probabilities are never held; the folds are one ensemble (each tile runs through every fold, logits averaged).
``--save-probabilities`` needs every output's whole map: then the sliding window keeps the probabilities
(float16, ``PROBABILITIES_DTYPE``) and the export streams the resampled maps, one output at a time, into
``{case}.npz`` (``ProbabilityFile``) on its way to the label map.

A case whose input is bad (``InputError`` or an unreadable file while it is read) is listed and skipped; the
run goes on and ends with ``CasesFailedError`` listing them (exit status 2). Any other failure (a full disk,
a bug) stops the run: the next case would meet it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.artifacts import check_writable_folder, remove_stale_temporaries
from autoseg.core.errors import InputError
from autoseg.core.machine import use_cpu_threads
from autoseg.core.precision import effective_precision
from autoseg.core.resources import available_ram_bytes, peak_rss_bytes, reset_peak_rss, use_one_malloc_arena
from autoseg.core.units import MiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import Geometry, supported_ending, write_image
from autoseg.dataset.inputs import PredictionInputs, list_prediction_inputs
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case, load_case
from autoseg.memory.inference import InferencePlan, plan_inference
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tile_buffers import ACCUMULATOR_DTYPES, OUTPUT_DTYPES, PREDICTION_ACCUMULATOR
from autoseg.model.tiles import overlap_step_fractions, tile_layout
from autoseg.model.tta import parse_tta
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.inference_tile import inference_budget_share, tile_for_image
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.cascade import CascadePrediction, cascade_input
from autoseg.predict.export import SlabExport, export_segmentation
from autoseg.predict.networks import load_networks
from autoseg.predict.pipeline import Pipeline, case_memory, pipeline_budget_bytes, plan_pipeline
from autoseg.predict.postprocessing import Postprocessing, apply_postprocessing, check_postprocessing
from autoseg.predict.probabilities import ProbabilityFile
from autoseg.preprocess.preprocessor import preprocess_case
from autoseg.preprocess.store import CaseProperties

log = logging.getLogger("autoseg")

# The probabilities of a case between the sliding window and the export: float16 halves the largest array
# prediction holds (outputs x the image); the label map is their argmax (regions: thresholded at 0.5), so only
# voxels whose top two classes are within float16's 1e-3 of each other can change.
PROBABILITIES_DTYPE = "float16"
PROBABILITIES_BYTES = OUTPUT_DTYPES[PROBABILITIES_DTYPE]


class CasesFailedError(InputError):
    """Some cases were not predicted because of their input; every other case was written."""


@dataclass(frozen=True)
class PredictOptions:
    """What ``predict`` does besides segmenting: save probabilities, skip finished cases, stop at the first
    bad case, which DICOM series to read."""

    save_probabilities: bool = False  # {case}.npz beside the label map (ProbabilityFile)
    skip_existing: bool = False  # --continue: a case whose outputs all exist is done (they are written atomically)
    fail_fast: bool = False  # stop at the first bad case (inputs whose headers are bad: before predicting any)
    series: str | None = None  # the SeriesInstanceUID to read from a folder of several DICOM series
    verbose: bool = False  # log the pipeline's and each case's inference plan (tile batch, accumulator, peaks)
    preprocess_workers: int | None = None  # cases read and preprocessed ahead (threads); None: plan_pipeline
    export_workers: int | None = None  # cases exported and written behind (threads); None: plan_pipeline
    done_cases: frozenset[str] = frozenset()  # case ids finished elsewhere (an ensemble's --continue): not predicted


def predict_case(
    case: Case,
    networks: list[torch.nn.Module],
    plans: Plans,
    config: ConfigurationPlan,
    *,
    mirror: bool,
    tile_batch_size: int | None,
    device: str,
    step_fraction: float = 0.5,
    probabilities_path: Path | None = None,
    tta: str | None = None,
    previous: np.ndarray | None = None,
) -> tuple[np.ndarray, CaseProperties]:
    data, _, geometry = load_case(case)
    return predict_image(
        data,
        geometry,
        case.case_id,
        networks,
        plans,
        config,
        mirror=mirror,
        tile_batch_size=tile_batch_size,
        device=device,
        step_fraction=step_fraction,
        probabilities_path=probabilities_path,
        tta=tta,
        previous=previous,
    )


def predict_image(
    data: np.ndarray,
    geometry: Geometry,
    case_id: str,
    networks: list[torch.nn.Module],
    plans: Plans,
    config: ConfigurationPlan,
    *,
    mirror: bool,
    tile_batch_size: int | None,
    device: str,
    step_fraction: float = 0.5,
    probabilities_path: Path | None = None,
    tta: str | None = None,
    verbose: bool = False,
    tile: str = "planned",
    previous: np.ndarray | None = None,
    accumulator: str = PREDICTION_ACCUMULATOR,
) -> tuple[np.ndarray, CaseProperties]:
    """Label map (Z, Y, X) of ``data`` (C, Z, Y, X) float32 in its own grid; with ``probabilities_path``
    the probabilities are written there too (``ProbabilityFile``, atomically). The stages one after the other:
    ``preprocess_case``, then ``predict_labels`` (or ``predict_probabilities`` and ``export_prediction``).
    ``tile``: the sliding window's tile, "planned" (the plan's inference tile) or "patch" (the training patch).
    ``previous``: a cascade stage's previous-stage label map (Z, Y, X) of the image (``cascade_input``)."""
    data, _, props = preprocess_case(data, None, geometry, plans, config, case_id)
    if config.previous_stage:
        data = cascade_input(data, previous, props, plans, config)
    window = {
        "mirror": mirror,
        "tile_batch_size": tile_batch_size,
        "device": device,
        "step_fraction": step_fraction,
        "tta": tta,
        "verbose": verbose,
        "tile": tile,
        "accumulator": accumulator,
    }
    if probabilities_path is None:
        return predict_labels(data, props, case_id, networks, plans, config, **window), props
    probabilities = predict_probabilities(data, case_id, networks, plans, config, **window)
    del data
    return export_prediction(probabilities, props, plans.label_scheme, probabilities_path), props


def prepare_case(case: Case, plans: Plans, config: ConfigurationPlan) -> tuple[np.ndarray, CaseProperties]:
    """Read ``case`` and preprocess it as in training: the (C, Z', Y', X') float32 input of the sliding window
    and what export needs to go back to the original grid."""
    data, _, geometry = load_case(case)
    data, _, props = preprocess_case(data, None, geometry, plans, config, case.case_id)
    return data, props


def predict_probabilities(
    data: np.ndarray, case_id: str, networks: list[torch.nn.Module], plans: Plans, config: ConfigurationPlan, **window
) -> torch.Tensor:
    """(K, Z', Y', X') float16 probabilities (on the host) of a preprocessed image: the sliding window's softmax
    (classes) or sigmoid (regions) of the logits averaged over ``networks`` (the folds) and mirror variants.
    ``window``: ``_sliding_window``'s options."""
    probabilities = _sliding_window(data, case_id, networks, plans, config, on_slab=None, **window)
    assert probabilities is not None
    return probabilities


def predict_labels(
    data: np.ndarray,
    props: CaseProperties,
    case_id: str,
    networks: list[torch.nn.Module],
    plans: Plans,
    config: ConfigurationPlan,
    **window,
) -> np.ndarray:
    """The label map (Z, Y, X) in the original grid of a preprocessed image, exported slab by slab as the sliding
    window finishes them (``SlabExport``): the probabilities are never held whole. ``window``: ``_sliding_window``'s
    options."""
    export = SlabExport(props, plans.label_scheme, tuple(data.shape[1:]))
    _sliding_window(data, case_id, networks, plans, config, on_slab=export.add, **window)
    return export.labels()


def _sliding_window(
    data: np.ndarray,
    case_id: str,
    networks: list[torch.nn.Module],
    plans: Plans,
    config: ConfigurationPlan,
    *,
    on_slab: Callable | None,
    mirror: bool,
    tile_batch_size: int | None,
    device: str,
    step_fraction: float = 0.5,
    tta: str | None = None,
    verbose: bool = False,
    tile: str = "planned",
    accumulator: str = PREDICTION_ACCUMULATOR,
) -> torch.Tensor | None:
    """``sliding_window_predict`` over every fold at once with the plan's settings: the probabilities (float16,
    ``on_slab`` None) or nothing (each slab went to ``on_slab``). ``tta``: the ``--tta`` flag (all, none, or the
    first N mirror variants; None: ``default_tta(device)``); ``mirror`` False: none. ``tile_batch_size`` None: the
    largest batch, and the accumulator's place, that ``plan_inference`` predicts to fit (``inference_plan``).
    ``tile``: "planned" or "patch", this image's tile (``tile_for_image``); consecutive tiles overlap by
    ``1 - step_fraction`` of the training patch (``overlap_step_fractions``). ``accumulator``: the accumulator's
    dtype (``ACCUMULATOR_DTYPES``)."""
    mirror_axes = tuple(range(config.dim)) if mirror else ()
    variants = parse_tta((tta or default_tta(device)) if mirror else "none", len(mirror_axes))
    scheme = plans.label_scheme
    precision = effective_precision(config.precision, device)
    window = inference_plan(
        config,
        data.shape[1:],
        scheme.num_outputs,
        device,
        precision,
        mirror_axes,
        variants,
        step_fraction,
        tile_batch_size,
        tile,
        streamed=on_slab is not None,
        num_networks=len(networks),
        accumulator=accumulator,
    )
    tile_size = tile_for_image(config, data.shape[1:], tile, step_fraction)
    steps = overlap_step_fractions(tile_size, config.patch_size, step_fraction)
    (log.info if verbose else log.debug)(
        "case %s, input %s: tile %s (%s), %d tile(s) x %d fold(s); %s",
        case_id,
        "x".join(map(str, data.shape[1:])),
        "x".join(map(str, tile_size)),
        tile,
        tile_layout(data.shape[1:], tile_size, steps).num_tiles,
        len(networks),
        window.describe(),
    )
    return sliding_window_predict(
        networks,
        data,
        tile_size,
        scheme.num_outputs,
        step_fraction=steps,
        mirror_axes=mirror_axes,
        tta=variants,
        tile_batch_size=window.tile_batch_size,
        device=device,
        accumulator_device=window.accumulator_device,
        precision=precision,
        activation="sigmoid" if scheme.has_regions else "softmax",
        output_dtype=PROBABILITIES_DTYPE,
        on_slab=on_slab,
        accumulator_dtype=window.accumulator_dtype,
    )


def export_prediction(
    probabilities: torch.Tensor, props: CaseProperties, scheme: LabelScheme, probabilities_path: Path | None = None
) -> np.ndarray:
    """The label map in the original grid (``export_segmentation``); with ``probabilities_path`` the
    probabilities are streamed into that ``ProbabilityFile`` on the way."""
    if probabilities_path is None:
        return export_segmentation(probabilities, props, scheme)
    with ProbabilityFile.open(probabilities_path, props, scheme) as file:
        return export_segmentation(probabilities, props, scheme, on_output=file.write_output)


# --tta when none is given: on CPU the first 4 mirror variants (identity, z, y, x flips): on the demo model they
# scored 0.9650 mean Dice in 10.7 s against 0.9653 in 23.5 s with all 8 and 0.9631 in 2.6 s with none
# (docs/prediction.md); on CUDA, where the batched variants cost little, all of them.
DEFAULT_TTA = {"cpu": "4", "cuda": "all"}


def default_tta(device: str) -> str:
    return DEFAULT_TTA["cuda" if device.startswith("cuda") else "cpu"]


def inference_plan(
    config: ConfigurationPlan,
    image_shape_zyx: tuple[int, ...],
    num_outputs: int,
    device: str,
    precision: str,
    mirror_axes: tuple[int, ...],
    variants: int,
    step_fraction: float,
    tile_batch_size: int | None,
    tile: str = "planned",
    streamed: bool = True,
    num_networks: int = 1,
    accumulator: str = PREDICTION_ACCUMULATOR,
) -> InferencePlan:
    """How the sliding window runs on this image with ``tile`` ("planned" or "patch": ``_sliding_window``),
    chosen before it starts (``plan_inference``) within ``inference_budget_bytes(device)``; a given
    ``tile_batch_size`` caps the batch at that number. ``streamed``: the slabs go to a ``SlabExport`` (no
    output volume); else a float16 output. ``num_networks``: the folds predicted together. ``accumulator``: its
    dtype. The tile simulations are kept between runs where the command keeps them (``kept_simulations``)."""
    tile_size = tile_for_image(config, tuple(image_shape_zyx), tile, step_fraction)
    return plan_inference(
        config.network,
        tile_size,
        tuple(image_shape_zyx),
        num_outputs,
        inference_budget_bytes(device),
        device,
        precision,
        mirror_axes,
        variants,
        overlap_step_fractions(tile_size, config.patch_size, step_fraction),
        max_tile_batch=tile_batch_size,
        output_dtype=None if streamed else PROBABILITIES_DTYPE,
        num_networks=num_networks,
        accumulator_dtype=accumulator,
    )


def inference_budget_bytes(device: str) -> int:
    """The memory one sliding window may use (``inference_budget_share``, as the inference tile was planned): 90%
    of the CUDA device's memory, or half the host RAM available now on CPU (the rest for reading, resampling and
    export)."""
    if device.startswith("cuda"):
        return inference_budget_share(device, torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return inference_budget_share(device, available_ram_bytes())


def predict(
    workspace: Workspace,
    inputs: str | Path,
    output_dir: str | Path,
    *,
    config_name: str | None = None,
    folds: tuple[int, ...] | None = None,
    checkpoint: str = "final",
    mirror: bool = True,
    tile_batch_size: int | None = None,
    device: str = "cpu",
    progress: bool = True,
    options: PredictOptions = PredictOptions(),
    tta: str | None = None,
    tile: str = "planned",
    postprocessing: Postprocessing = Postprocessing(),
    accumulator: str = PREDICTION_ACCUMULATOR,
) -> list[Path]:
    """Segment every case in ``inputs`` (folder, file or folder of DICOM series) with the trained folds; write
    into ``output_dir``; the label maps written. ``config_name`` None: the plan's default configuration
    (3d_fullres if planned, else the first). Cases are read ahead and exported behind on background threads
    (``plan_pipeline``). Cases with bad input are skipped and listed at the end (``CasesFailedError``) unless
    ``options.fail_fast``. ``tile``: "planned" (the plan's inference tile) or "patch" (the training patch).
    ``postprocessing``: applied to each label map before it is written (not to ``--save-probabilities``' maps), as
    ``autoseg find-best`` chose it. ``accumulator``: the sliding window's dtype."""
    use_one_malloc_arena()  # before any thread of the pipeline (or torch's) allocates: no arena per thread
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config_name = config_name or plans.default_configuration()
    config = plans.configuration(config_name)
    if folds is None:
        folds = workspace.trained_folds(config_name, checkpoint)
        if not folds:
            raise InputError(
                f"{workspace.root / 'results' / config_name}: no trained fold with "
                f"checkpoint_{checkpoint}.pt; run `autoseg train fold 0` first"
            )
    tta = (tta or default_tta(device)) if mirror else "none"
    _check_window_options(config, tta, tile, accumulator)
    check_postprocessing(postprocessing, plans.label_scheme)  # an inference.json of other labels too
    output_dir = check_writable_folder(output_dir, "-o/--output")  # before any work
    networks = load_networks(workspace, config, folds, checkpoint, device)
    window_options = {
        "mirror": mirror,
        "tile_batch_size": tile_batch_size,
        "device": device,
        "tta": tta,
        "verbose": options.verbose,
        "tile": tile,
        "accumulator": accumulator,
    }
    segment = partial(
        _segment_case, networks=networks, plans=plans, config=config, postprocessing=postprocessing, **window_options
    )

    def window(cfg: ConfigurationPlan, streamed: bool) -> Callable[..., InferencePlan]:
        return partial(
            inference_plan,
            cfg,
            num_outputs=plans.label_scheme.num_outputs,
            device=device,
            precision=effective_precision(cfg.precision, device),
            mirror_axes=tuple(range(cfg.dim)) if mirror else (),
            variants=parse_tta(tta, cfg.dim),
            step_fraction=0.5,
            tile_batch_size=tile_batch_size,
            tile=tile,
            streamed=streamed,
            num_networks=len(networks),
            accumulator=accumulator,
        )

    prepare, previous = partial(prepare_case, plans=plans, config=config), None
    if config.previous_stage:  # a cascade stage: its previous stage predicts each case first
        cascade = CascadePrediction.load(
            workspace, plans, config, folds, checkpoint, device, partial(predict_labels, **window_options)
        )
        prepare, segment, previous = (
            cascade.prepare,
            cascade.segment_with(segment),
            (cascade.stage, window(cascade.stage, True)),
        )
    found = prediction_inputs(workspace, plans, inputs, options.series)
    if options.fail_fast:
        found.raise_problems()
    remove_stale_temporaries(
        output_dir,
        [
            p.name
            for case in found.cases  # left by a killed run
            for p in case_outputs(case, output_dir, save_probabilities=True)
        ],
    )
    threads = torch.get_num_threads()
    if device == "cpu":
        use_cpu_threads(None, "prediction")  # every CPU, no timing probe (autoseg.core.machine)
    memory = partial(
        case_memory,
        plans=plans,
        config=config,
        window=window(config, not options.save_probabilities),
        postprocessed=not postprocessing.is_identity,
        previous=previous,
    )
    try:
        return _predict_cases(found, prepare, segment, memory, output_dir, options, progress)
    finally:
        torch.set_num_threads(threads)


def _check_window_options(config: ConfigurationPlan, tta: str, tile: str, accumulator: str) -> None:
    """A bad --tta, --tile or --accumulator fails before any work, not once per case."""
    parse_tta(tta, config.dim)
    config.inference_tile(tile)
    if accumulator not in ACCUMULATOR_DTYPES:
        raise InputError(f"--accumulator {accumulator!r}: use one of {', '.join(sorted(ACCUMULATOR_DTYPES))}")


def _predict_cases(
    found: PredictionInputs,
    prepare: Callable[[Case], tuple[Any, CaseProperties]],
    segment: Callable[..., Callable[[], None]],
    memory: Callable[..., dict[str, int]],
    output_dir: Path,
    options: PredictOptions,
    progress: bool,
) -> list[Path]:
    """Every case that is not done and has no problem: read and preprocess it (``prepare``: ``prepare_case``, ahead),
    ``segment`` it (``_segment_case`` with the networks and window settings bound) and write it (behind); raise
    CasesFailedError at the end listing the bad cases. ``memory``: ``case_memory`` of the cases to do, with its
    probabilities' bytes per value (None: streamed)."""
    written: list[Path] = []
    failed = dict(found.problems)  # case id -> why
    done = [
        c
        for c in found.cases
        if c.case_id in options.done_cases
        or (
            options.skip_existing
            and c.case_id not in failed
            and all(p.is_file() for p in case_outputs(c, output_dir, options.save_probabilities))
        )
    ]
    if done:
        log.info(
            "--continue: %d of %d case(s) already have their output(s); not predicted again",
            len(done),
            len(found.cases),
        )
    todo = [c for c in found.cases if c not in done and c.case_id not in failed]
    streamed = not options.save_probabilities
    stages = plan_pipeline(
        memory(todo, probability_bytes=None if streamed else PROBABILITIES_BYTES),
        len(todo),
        pipeline_budget_bytes(),
        options.preprocess_workers,
        options.export_workers,
    )
    (log.info if options.verbose else log.debug)("pipeline: %s", stages.describe())
    reset_peak_rss()  # the measured peak below counts from here, as the predicted one does
    try:
        with Pipeline(prepare, stages.preprocess_workers, stages.export_workers) as pipeline:
            for case, prepared in tqdm(
                pipeline.prepared(todo), total=len(todo), desc="predict", unit="case", disable=not progress
            ):
                try:
                    data, props = prepared()
                except (InputError, OSError) as e:  # this case's input: the others go on
                    if options.fail_fast:
                        raise
                    failed[case.case_id] = str(e) if isinstance(e, InputError) else f"{e.filename}: {e.strerror}"
                    log.warning("case %s not predicted: bad input (listed at the end)", case.case_id)
                    continue
                labels_path, *probabilities_path = case_outputs(case, output_dir, options.save_probabilities)
                write = segment(
                    data, props, case.case_id, labels_path, probabilities_path[0] if probabilities_path else None
                )
                del data
                pipeline.finish(write)
                written.append(labels_path)
    except BaseException:
        if failed:  # the error itself is reported by the caller
            log.error(
                "before this error, %d case(s) were not predicted for bad input:\n  %s",
                len(failed),
                "\n  ".join(f"{k}: {v}" for k, v in failed.items()),
            )
        raise
    measured = peak_rss_bytes()
    if measured is not None and written:
        (log.info if options.verbose else log.debug)(
            "host peak: predicted %.0f MiB, measured %.0f MiB (%+.0f%%)",
            stages.peak_bytes / MiB,
            measured / MiB,
            100 * (stages.peak_bytes / measured - 1),
        )
    if failed:
        raise CasesFailedError(
            f"{len(failed)} of {len(found.cases)} case(s) not predicted for bad input ({len(written)} written to "
            f"{output_dir}{f', {len(done)} already done' if done else ''}); fix them and rerun with --continue:\n  "
            + "\n  ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
        )
    return written


def _segment_case(
    data: np.ndarray,
    props: CaseProperties,
    case_id: str,
    labels_path: Path,
    probabilities_path: Path | None,
    *,
    networks: list[torch.nn.Module],
    plans: Plans,
    config: ConfigurationPlan,
    postprocessing: Postprocessing,
    **window,
) -> Callable[[], None]:
    """Predict one preprocessed case and return what is left to do behind (an export thread): postprocess and
    write its label map (exported slab by slab already, ``predict_labels``), or, with ``probabilities_path``,
    export its probabilities into that file and the label map (``_write_case``)."""
    if probabilities_path is None:
        labels = predict_labels(data, props, case_id, networks, plans, config, **window)
        return partial(write_labels, labels_path, labels, props.geometry, postprocessing, plans.label_scheme)
    probabilities = predict_probabilities(data, case_id, networks, plans, config, **window)
    return partial(
        _write_case, probabilities, props, plans.label_scheme, labels_path, probabilities_path, postprocessing
    )


def write_labels(
    path: Path, labels: np.ndarray, geometry: Geometry, postprocessing: Postprocessing, scheme: LabelScheme
) -> None:
    """Write a label map in ``geometry`` (atomically), postprocessed first unless ``postprocessing`` is none."""
    if not postprocessing.is_identity:
        labels = apply_postprocessing(labels, postprocessing, scheme)
    write_image(path, labels, geometry)


def _write_case(
    probabilities: torch.Tensor,
    props: CaseProperties,
    scheme: LabelScheme,
    labels_path: Path,
    probabilities_path: Path,
    postprocessing: Postprocessing,
) -> None:
    """Export one case's probabilities into ``probabilities_path`` and its label map, and write the label map
    postprocessed (atomically; a failed write raises WriteError naming it); the probabilities file is removed if
    the label map could not be written."""
    labels = export_prediction(probabilities, props, scheme, probabilities_path)
    try:
        write_labels(labels_path, labels, props.geometry, postprocessing, scheme)
    except BaseException:
        probabilities_path.unlink(missing_ok=True)  # no probabilities without their label map
        raise


def prediction_inputs(workspace: Workspace, plans: Plans, inputs: str | Path, series: str | None) -> PredictionInputs:
    """The cases of ``inputs`` for this workspace's model, from their headers (``list_prediction_inputs``; the
    image dimension checked against the images trained on)."""
    image_dim = (
        Fingerprint.from_json(workspace.fingerprint_path).image_dim  # the images trained on: 2 or 3
        if workspace.fingerprint_path.is_file()
        else None
    )
    return list_prediction_inputs(inputs, len(plans.channel_names), None, image_dim, series)


def case_outputs(case: Case, output_dir: Path, save_probabilities: bool) -> list[Path]:
    """The label map (the case id with its image's ending; a DICOM series: .nii.gz), then, if asked, the
    probabilities ({case}.npz)."""
    ending = ".nii.gz" if case.series_uid is not None else supported_ending(case.image_paths[0].name)
    return [output_dir / f"{case.case_id}{ending}"] + (
        [output_dir / f"{case.case_id}.npz"] if save_probabilities else []
    )
