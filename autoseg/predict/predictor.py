"""``autoseg predict``'s loop over cases: every case of the input read and preprocessed ahead, predicted by one
configuration's folds (``autoseg.predict.case``), exported and written behind, and the bad ones listed at the end.

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
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.artifacts import check_writable_folder, remove_stale_temporaries
from autoseg.core.errors import InputError, RunError
from autoseg.core.resources import peak_rss_bytes, reset_peak_rss, use_one_malloc_arena
from autoseg.core.units import MiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.dicom_write import check_dicom_output, label_writer, write_nifti
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.inputs import PredictionInputs, list_prediction_inputs
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.predict import uncertainty as case_uncertainty
from autoseg.predict.case import (
    PROBABILITIES_BYTES,
    export_prediction,
    inference_plan,
    predict_labels,
    predict_probabilities,
)
from autoseg.predict.case_review import CaseReview, review_paths
from autoseg.predict.image_input import ModelInput
from autoseg.predict.networks import Predictor
from autoseg.predict.outputs import case_outputs, every_output
from autoseg.predict.pipeline import (
    LabelWrite,
    Pipeline,
    PipelinePlan,
    case_memory,
    pipeline_budget_bytes,
    plan_pipeline,
)
from autoseg.predict.postprocessing import Postprocessing, apply_postprocessing
from autoseg.predict.runtime_memory import torch_first_call_bytes
from autoseg.predict.segmenter import Segmenter, prediction_threads, resolve_model
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.store import CaseProperties

log = logging.getLogger("autoseg")


class CasesFailedError(InputError):
    """Some cases were not predicted because of their input; every other case was written."""


@dataclass(frozen=True)
class PredictOptions:
    """What ``predict`` does besides segmenting: save probabilities, skip finished cases, stop at the first
    bad case, which DICOM series to read, the postprocessing, the workers and the progress bars. (How the sliding
    window runs is ``WindowOptions``.)"""

    save_probabilities: bool = False  # {case}.npz beside the label map (ProbabilityFile)
    skip_existing: bool = False  # --continue: a case whose outputs all exist is done (they are written atomically)
    fail_fast: bool = False  # stop at the first bad case (inputs whose headers are bad: before predicting any)
    series: str | None = None  # the SeriesInstanceUID to read from a folder of several DICOM series
    part: tuple[int, int] | None = None  # --part I/N: only part I of N of the inputs (``PredictionInputs.part``)
    preprocess_workers: int | None = None  # cases read and preprocessed ahead (threads); None: plan_pipeline
    export_workers: int | None = None  # cases exported and written behind (threads); None: plan_pipeline
    done_cases: frozenset[str] = frozenset()  # case ids finished elsewhere (an ensemble's --continue): not predicted
    # applied to each label map before it is written (not to --save-probabilities' maps), as autoseg find-best chose
    postprocessing: Postprocessing = Postprocessing()
    progress: bool = True  # progress bars over the cases
    preview: bool = False  # --preview: preview/{case}.png beside each label map (``CaseReview``)
    statistics: bool = False  # --statistics: statistics/{case}.json, then statistics.csv and .json (``CaseReview``)
    output_format: str = "nifti"  # --output-format: nifti, or dicom-seg / rtstruct of a DICOM series (dicom_write)
    uncertainty: case_uncertainty.UncertaintyOptions = case_uncertainty.UncertaintyOptions()  # uncertainty.csv


def predict(
    workspace: Workspace,
    inputs: str | Path,
    output_dir: str | Path,
    *,
    config_name: str | None = None,
    folds: tuple[int, ...] | None = None,
    checkpoint: str = "final",
    window: WindowOptions = WindowOptions(),
    options: PredictOptions = PredictOptions(),
) -> list[Path]:
    """Segment every case in ``inputs`` (folder, file or folder of DICOM series) with the trained folds; write
    into ``output_dir``; the label maps written. ``config_name`` None: the plan's default configuration
    (3d_fullres if planned, else the first); ``folds`` None: every fold trained with ``checkpoint``. ``window``: how
    the sliding window runs (checked here, before any work). Cases are read ahead and exported behind on
    background threads (``plan_pipeline``). Cases with bad input are skipped and listed at the end
    (``CasesFailedError``) unless ``options.fail_fast``."""
    use_one_malloc_arena()  # before any thread of the pipeline (or torch's) allocates: no arena per thread
    plans, config, folds = resolve_model(workspace, config_name, folds, checkpoint, window, options.postprocessing)
    output_dir = check_writable_folder(output_dir, "-o/--output")  # before any work
    with prediction_threads(window.device, None):  # every CPU (autoseg.core.machine), no timing probe
        segmenter = Segmenter.of(workspace, plans, config, folds, checkpoint, window, options.postprocessing)
        review = CaseReview(output_dir, plans.label_scheme, plans.channel_names, options.preview, options.statistics)
        resolved = case_uncertainty.resolve(segmenter.predictor, options.uncertainty, options.save_probabilities)
        options = replace(options, uncertainty=resolved)
        segment, memory = _case_steps(segmenter, options, review)
        found = prediction_inputs(segmenter.model_input, inputs, options.series, options.part)
        check_dicom_output(found.cases, options.output_format)
        if options.fail_fast:
            found.raise_problems()
        remove_stale_temporaries(
            output_dir,
            [
                p.name
                for case in found.cases  # left by a killed run
                for p in case_outputs(case, output_dir, True, options.output_format)
            ],
        )
        case_uncertainty.remove_stale(output_dir, [c.case_id for c in found.cases])
        for folder in {p.parent for p in review_paths(output_dir, "case", options.preview, options.statistics)}:
            remove_stale_temporaries(folder)  # autoseg's own folders: every temporary there is a killed run's
        steps = (segmenter.prepare, segment, memory)
        try:
            written = _predict_cases(found, *steps, output_dir, options, window.verbose, review)
        except CasesFailedError:
            case_uncertainty.finish(review, output_dir, options.uncertainty)  # the cases written have their rows
            raise
        case_uncertainty.finish(review, output_dir, options.uncertainty)
        return written


def _case_steps(
    segmenter: Segmenter, options: PredictOptions, review: CaseReview
) -> tuple[Callable[..., Callable[[], None]], Callable[..., dict]]:
    """What each case goes through besides ``segmenter.prepare`` (read and preprocessed, ahead): ``segment``
    (``_segment_case`` with the predictor bound; a cascade stage's previous stage first: ``CascadePrediction``) and
    ``memory`` (``case_memory`` with the window's plan and what ``review`` holds bound)."""
    predictor, cascade = segmenter.predictor, segmenter.cascade
    plans, config = predictor.plans, predictor.config
    agreement = case_uncertainty.predictor_agreement(predictor, options.uncertainty)
    segment = partial(_segment_case, predictor=predictor, options=options)
    previous = None
    if cascade is not None:  # a cascade stage: its previous stage predicts each case first
        segment = cascade.segment_with(segment)
        previous = (cascade.stage, partial(inference_plan, cascade.previous, streamed=True))
    stages = [predictor] if cascade is None else [predictor, cascade.previous]
    memory = partial(
        case_memory,
        plans=plans,
        config=config,
        window=partial(inference_plan, predictor, streamed=not options.save_probabilities, agreement=agreement),
        write=LabelWrite(
            not options.postprocessing.is_identity,
            options.output_format,
            partial(case_uncertainty.held_beside, review, agreement) if review.active or agreement else None,
        ),
        previous=previous,
        first_call_bytes=_first_call_bytes(stages),
    )
    return segment, memory


def _first_call_bytes(stages: list[Predictor]) -> int:
    """What torch's first CPU forward adds to the process (``torch_first_call_bytes``, measured once per machine)
    where a fold runs through torch on the CPU; 0 elsewhere (a graph runtime's is in its measured tile bytes)."""
    on_cpu = any(isinstance(r, TorchTileRunner) and r.device.type == "cpu" for p in stages for r in p.runners)
    return torch_first_call_bytes(torch.get_num_threads()) if on_cpu else 0


def _predict_cases(
    found: PredictionInputs,
    prepare: Callable[[Case], tuple[Any, CaseProperties]],
    segment: Callable[..., Callable[[], None]],
    memory: Callable[..., dict[str, int]],
    output_dir: Path,
    options: PredictOptions,
    verbose: bool,
    review: CaseReview,
) -> list[Path]:
    """Every case that is not done and has no problem: read and preprocess it (``prepare``: ``prepare_case``, ahead),
    ``segment`` it (``_segment_case`` with the predictor bound) and write it (behind); raise CasesFailedError at the
    end listing the bad cases. ``memory``: ``case_memory`` of the cases to do, with its probabilities' bytes per
    value (None: streamed). ``verbose``: the pipeline's plan and its measured peak at INFO. ``review``: what each
    case's export writes beside its label map (``CaseReview``)."""
    failed = dict(found.problems)  # case id -> why
    done = _done_cases(found, output_dir, options, failed)
    todo = [c for c in found.cases if c not in done and c.case_id not in failed]
    streamed = not options.save_probabilities
    stages = plan_pipeline(
        memory(todo, probability_bytes=None if streamed else PROBABILITIES_BYTES),
        len(todo),
        pipeline_budget_bytes(),
        options.preprocess_workers,
        options.export_workers,
    )
    (log.info if verbose else log.debug)("pipeline: %s", stages.describe())
    reset_peak_rss()  # the measured peak below counts from here, as the predicted one does
    try:
        written = _run_pipeline(todo, prepare, segment, stages, (output_dir, review), options, failed)
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
        (log.info if verbose else log.debug)(
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


def _done_cases(found: PredictionInputs, output_dir: Path, options: PredictOptions, failed: dict) -> list[Case]:
    """The cases not to predict again: finished elsewhere (``options.done_cases``) or, with ``--continue``, whose
    outputs all exist (each is written atomically: an existing one is complete)."""
    done = [
        c
        for c in found.cases
        if c.case_id in options.done_cases
        or (
            options.skip_existing
            and c.case_id not in failed
            and all(p.is_file() for p in every_output(c, output_dir, options))
        )
    ]
    if done:
        log.info(
            "--continue: %d of %d case(s) already have their output(s); not predicted again",
            len(done),
            len(found.cases),
        )
    return done


def _run_pipeline(
    todo: list[Case],
    prepare: Callable[[Case], tuple[Any, CaseProperties]],
    segment: Callable[..., Callable[[], None]],
    stages: PipelinePlan,
    outputs: tuple[Path, CaseReview],
    options: PredictOptions,
    failed: dict[str, str],
) -> list[Path]:
    """``todo`` through the pipeline's threads (``stages``): each case prepared ahead, segmented here, written
    behind into ``outputs`` (the output folder, and what is written beside each label map); the label maps
    written. A case whose input is bad is added to ``failed`` (unless ``options.fail_fast``: then it raises) and the
    others go on."""
    written: list[Path] = []
    output_dir, review = outputs
    with Pipeline(prepare, stages.preprocess_workers, stages.export_workers) as pipeline:
        for case, prepared in tqdm(
            pipeline.prepared(todo), total=len(todo), desc="predict", unit="case", disable=not options.progress
        ):
            try:
                data, props = prepared()
            except (InputError, OSError) as e:  # this case's input: the others go on
                if options.fail_fast:
                    raise
                failed[case.case_id] = str(e) if isinstance(e, InputError) else f"{e.filename}: {e.strerror}"
                log.warning("case %s not predicted: bad input (listed at the end)", case.case_id)
                continue
            labels_path, *more = case_outputs(case, output_dir, options.save_probabilities, options.output_format)
            write_as = label_writer(case, options.output_format)
            try:
                write = segment(data, props, case.case_id, labels_path, more[0] if more else None, write_as)
            except RunError as e:  # e.g. a runtime failing on a tile: which case it was on
                raise RunError(f"case {case.case_id}: {e}") from e
            del data
            pipeline.finish(review.after(write, case, props.geometry))
            written.append(labels_path)
    return written


def _segment_case(
    data: np.ndarray,
    props: CaseProperties,
    case_id: str,
    labels_path: Path,
    probabilities_path: Path | None,
    write: Callable[..., None] = write_nifti,
    *,
    predictor: Predictor,
    options: PredictOptions,
) -> Callable[[], np.ndarray]:
    """Predict one preprocessed case and return what is left to do behind (an export thread), which returns the
    label map written: postprocess and write its label map (exported slab by slab already, ``predict_labels``), or,
    with ``probabilities_path``, export its probabilities into that file and the label map (``_write_case``), written
    by ``write`` (``label_writer``: its file format); the ``options``' postprocessing first and, where enabled, the
    uncertainty after (``case_uncertainty.write_after``)."""
    scheme, postprocessing = predictor.plans.label_scheme, options.postprocessing
    if probabilities_path is None:
        parts = case_uncertainty.start(predictor, options.uncertainty, props)
        labels = predict_labels(data, props, case_id, predictor, parts)
        written = partial(write_labels, labels_path, labels, props.geometry, postprocessing, scheme, write)
        return partial(case_uncertainty.write_after, written, (case_id, parts, props.geometry), labels_path.parent)
    probabilities = predict_probabilities(data, case_id, predictor)
    weights = predictor.class_weights
    return partial(
        _write_case, probabilities, props, scheme, labels_path, probabilities_path, postprocessing, write, weights
    )


def write_labels(
    path: Path,
    labels: np.ndarray,
    geometry: Geometry,
    postprocessing: Postprocessing,
    scheme: LabelScheme,
    write: Callable[..., None] = write_nifti,
) -> np.ndarray:
    """Write a label map in ``geometry`` (atomically, by ``write``: ``label_writer``'s file format), postprocessed
    first unless ``postprocessing`` is none; the label map written."""
    if not postprocessing.is_identity:
        labels = apply_postprocessing(labels, postprocessing, scheme)
    write(path, labels, geometry, scheme)
    return labels


def _write_case(
    probabilities: torch.Tensor,
    props: CaseProperties,
    scheme: LabelScheme,
    labels_path: Path,
    probabilities_path: Path,
    postprocessing: Postprocessing,
    write: Callable[..., None],
    class_weights: np.ndarray | None = None,
) -> np.ndarray:
    """Export one case's probabilities into ``probabilities_path`` and its label map (``class_weights``: the
    argmax's), and write the label map postprocessed (atomically, by ``write``; a failed write raises WriteError
    naming it); the label map written. The probabilities file is removed if the label map could not be written."""
    labels = export_prediction(probabilities, props, scheme, probabilities_path, class_weights)
    try:
        return write_labels(labels_path, labels, props.geometry, postprocessing, scheme, write)
    except BaseException:
        probabilities_path.unlink(missing_ok=True)  # no probabilities without their label map
        raise


def prediction_inputs(
    trained: ModelInput, inputs: str | Path, series: str | None, part: tuple[int, int] | None = None
) -> PredictionInputs:
    """The cases of ``inputs`` for the model that takes ``trained`` (``model_input``), from their headers
    (``list_prediction_inputs``; the channel count, and the image dimension and spacing against the images trained
    on); with ``part`` (I, N), only part I of N of them (``PredictionInputs.part``), said in the log."""
    found = list_prediction_inputs(
        inputs, len(trained.channel_names), None, trained.image_dim, series, trained.spacing_mm
    )
    if part is None:
        return found
    mine = found.part(*part)
    ids, every = mine.case_ids, len(found.case_ids)
    where = f": {ids[0]} to {ids[-1]} in case id order" if ids else ": none (fewer cases than parts)"
    log.info("--part %d/%d: %d of %d case(s)%s", *part, len(ids), every, where)
    return mine
