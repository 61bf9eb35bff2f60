"""Prediction as ``inference.json`` says (``autoseg find-best``'s choice, ``InferenceChoice``): one configuration,
or an ensemble of two; then the chosen postprocessing. ``autoseg predict`` without ``-c`` follows it.

An ensemble is predicted configuration by configuration, each as ``predict --save-probabilities`` into a scratch
folder ``{output}/.autoseg-ensemble/<config>/`` (its own pipeline, memory plan and folds), then case by case the
two ``{case}.npz`` are averaged (``mean_probabilities``), made a label map by export's rule, postprocessed and
written atomically into ``{output}``; each case's scratch files are removed once it is written, and the folder
when every case is. A killed run keeps the scratch outputs: ``--continue`` reuses them and skips the cases already
written; a run without ``--continue`` starts the scratch folder afresh. With ``--part I/N`` each part has a scratch
folder of its own (``scratch_name``), so parts sharing the output folder leave each other's alone.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from autoseg.core.artifacts import check_writable_folder
from autoseg.core.units import MiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.dicom_write import check_dicom_output, label_writer
from autoseg.dataset.imageio import read_geometry
from autoseg.plan.plans import Plans
from autoseg.predict.case_review import CaseReview
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.postprocessing import Postprocessing, check_postprocessing, largest_component_bytes
from autoseg.predict.predictor import (
    CasesFailedError,
    PredictOptions,
    case_outputs,
    every_output,
    predict,
    prediction_inputs,
    write_labels,
)
from autoseg.predict.probabilities import (
    ensemble_case_bytes,
    labels_from_probabilities,
    mean_probabilities,
    write_probabilities,
)
from autoseg.predict.segmenter import model_input
from autoseg.predict.window import WindowOptions

log = logging.getLogger("autoseg")

SCRATCH = ".autoseg-ensemble"  # inside the output folder: the configurations' own predictions of an ensemble


def predict_chosen(
    workspace: Workspace,
    choice: InferenceChoice,
    inputs: str | Path,
    output_dir: str | Path,
    *,
    folds: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
    window: WindowOptions = WindowOptions(),
    options: PredictOptions = PredictOptions(),
) -> list[Path]:
    """Segment every case of ``inputs`` as ``choice`` says, into ``output_dir``; the label maps written.
    ``folds`` / ``checkpoint`` None: the choice's. ``window``: how the sliding window runs, the same for each
    configuration. The choice's postprocessing replaces ``options.postprocessing``."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    check_postprocessing(choice.postprocessing, plans.label_scheme)
    options = replace(options, postprocessing=choice.postprocessing)
    choice = choice.applied(folds, checkpoint)
    if not choice.is_ensemble:
        return predict(
            workspace,
            inputs,
            output_dir,
            config_name=choice.configurations[0],
            folds=choice.folds,
            checkpoint=choice.checkpoint,
            window=window,
            options=options,
        )
    output_dir = check_writable_folder(output_dir, "-o/--output")
    # an ensemble of configurations has no per-case uncertainty (each configuration predicts its probabilities)
    options = replace(options, uncertainty=replace(options.uncertainty, enabled=False, save_map=False))
    scratch = output_dir / scratch_name(options.part)
    found = prediction_inputs(model_input(workspace, plans), inputs, options.series, options.part)
    check_dicom_output(found.cases, options.output_format)  # before any configuration predicts
    done = frozenset(
        c.case_id
        for c in found.cases
        if options.skip_existing and all(p.is_file() for p in every_output(c, output_dir, options))
    )
    if not options.skip_existing:
        shutil.rmtree(scratch, ignore_errors=True)  # another model's outputs may be there
    failed = _predict_configurations(workspace, choice, inputs, scratch, window, _configuration_options(options, done))
    cases = [
        c
        for c in found.cases
        if c.case_id not in done
        and all((scratch / config / f"{c.case_id}.npz").is_file() for config in choice.configurations)
    ]
    review = CaseReview(output_dir, plans.label_scheme, plans.channel_names, options.preview, options.statistics)
    written = _combine(cases, choice, (plans, review), scratch, output_dir, options)
    review.finish()
    if failed:
        raise CasesFailedError("\n".join(failed))
    shutil.rmtree(scratch, ignore_errors=True)
    return written


def _configuration_options(options: PredictOptions, done: frozenset[str]) -> PredictOptions:
    """How each configuration of an ensemble predicts: probabilities, neither postprocessed nor reviewed (the mean's
    label map is, ``_combine``), the cases ``done`` left out, resuming in the scratch folder."""
    return replace(
        options,
        save_probabilities=True,
        skip_existing=True,
        done_cases=done,
        postprocessing=Postprocessing(),
        preview=False,
        statistics=False,
        output_format="nifti",  # the scratch label maps: the mean's is written in the asked format
    )


def scratch_name(part: tuple[int, int] | None) -> str:
    """The scratch folder's name in the output folder: one per ``--part``, so that parts sharing ``-o`` neither
    start another's afresh nor remove it when done."""
    return SCRATCH if part is None else f"{SCRATCH}-part{part[0]}of{part[1]}"


def _predict_configurations(
    workspace: Workspace,
    choice: InferenceChoice,
    inputs: str | Path,
    scratch: Path,
    window: WindowOptions,
    options: PredictOptions,
) -> list[str]:
    """Each configuration of ``choice`` predicted with its folds and checkpoint into ``scratch/<config>``, one after
    the other; the failures of bad input (``CasesFailedError``), one line per configuration."""
    failed: list[str] = []
    for config in choice.configurations:
        log.info(
            "ensemble: predicting %s (%d of %d) into %s",
            config,
            choice.configurations.index(config) + 1,
            len(choice.configurations),
            scratch / config,
        )
        try:
            predict(
                workspace,
                inputs,
                scratch / config,
                config_name=config,
                folds=choice.folds,
                checkpoint=choice.checkpoint,
                window=window,
                options=options,
            )
        except CasesFailedError as e:  # the other configuration still predicts every good case
            failed.append(f"{config}: {e}")
    return failed


def _combine(
    cases: list,
    choice: InferenceChoice,
    model: tuple[Plans, CaseReview],
    scratch: Path,
    output_dir: Path,
    options: PredictOptions,
) -> list[Path]:
    """Each case: the mean of its configurations' probabilities, the label map, postprocessing, written (with the
    mean as ``{case}.npz`` when asked) and reviewed (``model``: the plan, and ``CaseReview``: --preview,
    --statistics); then its scratch files removed."""
    plans, review = model
    scheme, written = plans.label_scheme, []
    for case in tqdm(cases, desc="ensemble", unit="case", disable=not options.progress):
        labels_path, *probabilities_path = case_outputs(
            case, output_dir, options.save_probabilities, options.output_format
        )
        first = case_outputs(case, scratch / choice.configurations[0], True)[0]  # its geometry: the image's
        geometry = read_geometry(first)
        num_voxels = math.prod(geometry.shape_zyx)
        log.debug(
            "ensemble: case %s holds %.0f MiB (probabilities) then %.0f MiB (postprocessing)",
            case.case_id,
            ensemble_case_bytes(scheme.num_outputs, num_voxels) / MiB,
            largest_component_bytes(num_voxels, np.dtype(scheme.export_dtype()).itemsize) / MiB,
        )
        mean = mean_probabilities([scratch / c / f"{case.case_id}.npz" for c in choice.configurations], scheme)
        labels = labels_from_probabilities(mean, scheme)
        if probabilities_path:
            write_probabilities(probabilities_path[0], mean, scheme)
        del mean
        write = label_writer(case, options.output_format)
        labels = write_labels(labels_path, labels, geometry, choice.postprocessing, scheme, write)
        review.case(case, labels, geometry)  # nothing without --preview and --statistics
        written.append(labels_path)
        for config in choice.configurations:
            for path in case_outputs(case, scratch / config, True):
                path.unlink(missing_ok=True)
    return written
