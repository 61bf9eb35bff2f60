"""Prediction of new scans: preprocess, sliding window over every fold's network, export in the
input's exact geometry (size, spacing, origin, direction).

Export streams one output channel at a time: each class's probability map is resampled back to the
cropped original shape and folded into a running argmax (plain labels), or each region's map is
resampled, thresholded at 0.5 and painted with its ``regions_class_order`` value over the regions before
it (region-based labels; ``autoseg.dataset.labels``). Host memory grows with the volume (one resampled map, best
score fp32, labels), not with volume x channels. ``--save-probabilities`` streams the same resampled maps, one
at a time as float16, into ``{case}.npz`` (``ProbabilityFile``).

A case whose input is bad (``InputError`` or an unreadable file while it is read) is listed and skipped; the
run goes on and ends with ``CasesFailedError`` listing them (exit status 2). Any other failure (a full disk,
a bug) stops the run: the next case would meet it too.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.artifacts import atomic_path, check_writable_folder, remove_stale_temporaries
from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.core.resources import available_ram_bytes, choose_cpu_threads
from autoseg.core.workspace import Workspace
from autoseg.dataset.cropping import uncrop
from autoseg.dataset.imageio import Geometry, supported_ending, write_image
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case, PredictionInputs, list_prediction_inputs, load_case
from autoseg.memory.inference import InferencePlan, plan_inference
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.sliding_window import parse_tta, sliding_window_predict
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.preprocess.preprocessor import preprocess_case
from autoseg.preprocess.resampling import resample_channel
from autoseg.preprocess.store import CaseProperties

log = logging.getLogger("autoseg")

PROBABILITY_DTYPE = np.float16  # 2 bytes a voxel per output; 1e-3 relative precision, ample for averaging folds


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
    verbose: bool = False  # log each case's inference plan (tile batch, accumulator, predicted peak)


def load_trained_network(checkpoint_path: Path, config: ConfigurationPlan, device: str) -> torch.nn.Module:
    if not checkpoint_path.is_file():
        raise InputError(f"{checkpoint_path} not found; train this fold first (`autoseg train fold N`)")
    state = read_checkpoint_file(checkpoint_path, "predict with --checkpoint naming another one (best, final, "
                                 "latest), or train this fold again")
    network = build_network(config.network)
    network.load_state_dict(state["network"])
    return network.to(device).eval()


def export_segmentation(probabilities: torch.Tensor, props: CaseProperties, scheme: LabelScheme | None = None,
                        on_output: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
    """(K, Z', Y', X') probabilities in preprocessed space -> label map (Z, Y, X) of label values
    (``scheme.export_dtype()``) in the original image's array space. ``scheme`` None: plain classes
    0 .. K-1 (``LabelScheme.for_outputs``). Peak extra memory: one resampled channel + best score (plain
    labels only) + labels."""
    num_outputs = probabilities.shape[0]
    scheme = scheme or LabelScheme.for_outputs(num_outputs)
    if scheme.num_outputs != num_outputs:
        raise InputError(f"{num_outputs} probability maps for labels with {scheme.num_outputs} outputs")
    best_score = None
    labels = np.zeros(props.shape_after_crop, dtype=scheme.export_dtype())
    for k in range(num_outputs):
        channel = probabilities[k].numpy().astype(np.float32, copy=False)
        resampled = resample_channel(channel, props.shape_after_crop, props.target_spacing_mm, order=1, order_z=0)
        if on_output is not None:
            on_output(k, resampled)
        if scheme.has_regions:
            scheme.paint_region(labels, k, resampled)  # later regions overwrite earlier ones
        elif best_score is None:
            best_score = resampled
        else:
            better = resampled > best_score
            labels[better] = k
            np.maximum(best_score, resampled, out=best_score)
            del better
        del resampled  # not alive while the next channel is resampled (autoseg.memory.host.export_bytes)
    return uncrop(labels, props.crop_bbox, props.shape_before_crop, fill=0)


def predict_case(case: Case, networks: list[torch.nn.Module], plans: Plans, config: ConfigurationPlan, *,
                 mirror: bool, tile_batch_size: int | None, device: str, step_fraction: float = 0.5,
                 probabilities_path: Path | None = None) -> tuple[np.ndarray, CaseProperties]:
    data, _, geometry = load_case(case)
    return predict_image(data, geometry, case.case_id, networks, plans, config, mirror=mirror,
                         tile_batch_size=tile_batch_size, device=device, step_fraction=step_fraction,
                         probabilities_path=probabilities_path)


def predict_image(data: np.ndarray, geometry: Geometry, case_id: str, networks: list[torch.nn.Module], plans: Plans,
                  config: ConfigurationPlan, *, mirror: bool, tile_batch_size: int | None, device: str,
                  step_fraction: float = 0.5, probabilities_path: Path | None = None, tta: str | None = None,
                  verbose: bool = False) -> tuple[np.ndarray, CaseProperties]:
    """Label map (Z, Y, X) of ``data`` (C, Z, Y, X) float32 in its own grid; with ``probabilities_path``
    the probabilities are written there too (``ProbabilityFile``, atomically). ``tta``: the ``--tta`` flag
    (all, none, or the first N mirror variants; None: ``default_tta(device)``); ``mirror`` False: none.
    ``tile_batch_size`` None: the largest batch, and the accumulator's place, that ``plan_inference``
    predicts to fit (``inference_plan``)."""
    data, _, props = preprocess_case(data, None, geometry, plans, config, case_id)
    mirror_axes = tuple(range(config.dim)) if mirror else ()
    variants = parse_tta((tta or default_tta(device)) if mirror else "none", len(mirror_axes))
    scheme = plans.label_scheme
    precision = effective_precision(config.precision, device)
    window = inference_plan(config, data.shape[1:], scheme.num_outputs, device, precision, mirror_axes, variants,
                            step_fraction, tile_batch_size)
    (log.info if verbose else log.debug)("case %s, input %s: %s", case_id, "x".join(map(str, data.shape[1:])),
                                         window.describe())
    probabilities = None
    for network in networks:  # fold ensemble: mean of softmax (classes) / sigmoid (regions) probabilities
        p = sliding_window_predict(network, data, config.patch_size, scheme.num_outputs, step_fraction=step_fraction,
                                   mirror_axes=mirror_axes, tta=variants, tile_batch_size=window.tile_batch_size,
                                   device=device, accumulator_device=window.accumulator_device, precision=precision,
                                   activation="sigmoid" if scheme.has_regions else "softmax")
        probabilities = p if probabilities is None else probabilities.add_(p)
    assert probabilities is not None
    probabilities /= len(networks)
    if probabilities_path is None:
        return export_segmentation(probabilities, props, scheme), props
    with ProbabilityFile.open(probabilities_path, props, scheme) as file:
        return export_segmentation(probabilities, props, scheme, on_output=file.write_output), props


@dataclass
class ProbabilityFile:
    """``{case}.npz``, what an ensembling tool needs to average several models' predictions of a case:

    - ``probabilities``: float16 (K, Z, Y, X), the image's own array grid (Z = 1 for a 2D image), as the label
      map; K outputs: the softmax of every class 0 .. K-1 (plain labels; background 1 outside the crop box) or
      the sigmoid of every region (region labels; 0 outside). float16 halves the file and the memory; the
      label map is the argmax (or the regions painted at 0.5) of the float32 maps, so ties in float16 may
      differ from it.
    - ``names``: the output names (``background`` and the classes by value, or the regions in order);
      ``activation``: ``softmax`` or ``sigmoid``.

    Written as a zip (``np.load`` reads it) one output at a time, so only one output's map is held; under a
    temporary name, renamed when complete (``atomic_path``).
    """

    props: CaseProperties
    scheme: LabelScheme
    stream: IO[bytes] | None = None

    @classmethod
    @contextmanager
    def open(cls, path: Path, props: CaseProperties, scheme: LabelScheme) -> Iterator[ProbabilityFile]:
        names = scheme.names if scheme.has_regions else ("background", *scheme.names)
        shape = (scheme.num_outputs, *props.shape_before_crop)
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(PROBABILITY_DTYPE)), "fortran_order": False,
                  "shape": shape}
        try:
            with atomic_path(path, suffix=".npz") as tmp, \
                    zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
                with archive.open("probabilities.npy", "w", force_zip64=True) as stream:
                    np.lib.format.write_array_header_1_0(stream, header)
                    try:
                        yield cls(props, scheme, stream)
                    except BaseException as e:  # not a write error: the file is dropped, the error goes on
                        raise _Abandoned(e) from e
                for name, value in (("names", np.array(names)),
                                    ("activation", np.array("sigmoid" if scheme.has_regions else "softmax"))):
                    with archive.open(f"{name}.npy", "w") as f:
                        np.lib.format.write_array(f, value, allow_pickle=False)
        except _Abandoned as abandoned:
            raise abandoned.error from None

    def write_output(self, k: int, resampled: np.ndarray) -> None:
        """Output ``k``'s map (the cropped original shape, float32), uncropped one z-slice at a time: one
        float16 (Y, X) plane held beyond it."""
        assert self.stream is not None
        fill = 1.0 if k == 0 and not self.scheme.has_regions else 0.0
        (z0, z1), (y0, y1), (x0, x1) = self.props.crop_bbox
        plane = np.empty(self.props.shape_before_crop[1:], dtype=PROBABILITY_DTYPE)
        for z in range(self.props.shape_before_crop[0]):
            plane.fill(fill)
            if z0 <= z < z1:
                plane[y0:y1, x0:x1] = resampled[z - z0]
            self.stream.write(memoryview(plane.reshape(-1)).cast("B"))


class _Abandoned(Exception):  # noqa: N818 (not an error of its own: carries one through atomic_path)
    """Carries an error raised while a ``ProbabilityFile`` was open past ``atomic_path`` (which would report
    it as a write error)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


# --tta when none is given: on CPU the first 4 mirror variants (identity, z, y, x flips): on the demo model they
# scored 0.9650 mean Dice in 10.7 s against 0.9653 in 23.5 s with all 8 and 0.9631 in 2.6 s with none
# (docs/prediction.md); on CUDA, where the batched variants cost little, all of them.
DEFAULT_TTA = {"cpu": "4", "cuda": "all"}


def default_tta(device: str) -> str:
    return DEFAULT_TTA["cuda" if device.startswith("cuda") else "cpu"]


def inference_plan(config: ConfigurationPlan, image_shape_zyx: tuple[int, ...], num_outputs: int, device: str,
                   precision: str, mirror_axes: tuple[int, ...], variants: int, step_fraction: float,
                   tile_batch_size: int | None) -> InferencePlan:
    """How the sliding window runs on this image, chosen before it starts (``plan_inference``) within
    ``inference_budget_bytes(device)``; a given ``tile_batch_size`` caps the batch at that number."""
    return plan_inference(config.network, config.patch_size, tuple(image_shape_zyx), num_outputs,
                          inference_budget_bytes(device), device, precision, mirror_axes, variants, step_fraction,
                          max_tile_batch=tile_batch_size)


def inference_budget_bytes(device: str) -> int:
    """The memory one sliding window may use: 90% of the CUDA device's memory, or half the host RAM available
    now on CPU (the rest for reading, resampling and export)."""
    if device.startswith("cuda"):
        return int(0.9 * torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return available_ram_bytes() // 2


def predict(workspace: Workspace, inputs: str | Path, output_dir: str | Path, *, config_name: str | None = None,
            folds: tuple[int, ...] | None = None, checkpoint: str = "final", mirror: bool = True,
            tile_batch_size: int | None = None, device: str = "cpu", progress: bool = True,
            options: PredictOptions = PredictOptions(), tta: str | None = None) -> list[Path]:
    """Segment every case in ``inputs`` (folder, file or folder of DICOM series) with the trained folds; write
    into ``output_dir``; the label maps written. ``config_name`` None: the plan's default configuration
    (3d_fullres if planned, else the first). Cases with bad input are skipped and listed at the end
    (``CasesFailedError``) unless ``options.fail_fast``."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config_name = config_name or plans.default_configuration()
    config = plans.configuration(config_name)
    if folds is None:
        folds = workspace.trained_folds(config_name, checkpoint)
        if not folds:
            raise InputError(f"{workspace.root / 'results' / config_name}: no trained fold with "
                                    f"checkpoint_{checkpoint}.pt; run `autoseg train fold 0` first")
    tta = (tta or default_tta(device)) if mirror else "none"
    parse_tta(tta, config.dim)  # a bad --tta fails before any work, not once per case
    output_dir = check_writable_folder(output_dir, "-o/--output")  # before any work
    networks = [load_trained_network(workspace.checkpoint(config_name, f, checkpoint), config, device)
                for f in folds]
    image_dim = (Fingerprint.from_json(workspace.fingerprint_path).image_dim  # the images trained on: 2 or 3
                 if workspace.fingerprint_path.is_file() else None)
    found = list_prediction_inputs(inputs, len(plans.channel_names), None, image_dim, options.series)  # headers
    if options.fail_fast:
        found.raise_problems()
    remove_stale_temporaries(output_dir, [p.name for case in found.cases  # left by a killed run
                                          for p in _outputs(case, output_dir, save_probabilities=True)])
    threads = torch.get_num_threads()
    if device == "cpu":
        _choose_cpu_threads(networks[0], config, tile_batch_size or 1)
    segment = partial(predict_image, networks=networks, plans=plans, config=config, mirror=mirror,
                      tile_batch_size=tile_batch_size, device=device, tta=tta, verbose=options.verbose)
    try:
        return _predict_cases(found, segment, output_dir, options, progress)
    finally:
        torch.set_num_threads(threads)


def _choose_cpu_threads(network: torch.nn.Module, config: ConfigurationPlan, tile_batch_size: int) -> None:
    """All CPUs unless one thread measures faster for a tile batch (cores busy with another process)."""
    x = torch.zeros(tile_batch_size, config.network.in_channels, *config.patch_size)

    def forward() -> None:
        with torch.inference_mode():
            network(x)

    choose_cpu_threads(forward, "a tile batch")


def _predict_cases(found: PredictionInputs, segment: Callable[..., tuple[np.ndarray, CaseProperties]],
                   output_dir: Path, options: PredictOptions, progress: bool) -> list[Path]:
    """``segment`` (``predict_image`` with the networks and window settings bound) every case that is not done
    and has no problem; write its outputs; raise CasesFailedError at the end listing the bad cases."""
    written: list[Path] = []
    failed = dict(found.problems)  # case id -> why
    done = [c for c in found.cases if options.skip_existing and c.case_id not in failed
            and all(p.is_file() for p in _outputs(c, output_dir, options.save_probabilities))]
    if done:
        log.info("--continue: %d of %d case(s) already have their output(s); not predicted again",
                 len(done), len(found.cases))
    todo = [c for c in found.cases if c not in done and c.case_id not in failed]
    try:
        for case in tqdm(todo, desc="predict", unit="case", disable=not progress):
            try:
                data, _, geometry = load_case(case)
            except (InputError, OSError) as e:  # this case's input: the others go on
                if options.fail_fast:
                    raise
                failed[case.case_id] = str(e) if isinstance(e, InputError) else f"{e.filename}: {e.strerror}"
                log.warning("case %s not predicted: bad input (listed at the end)", case.case_id)
                continue
            labels_path, *probabilities_path = _outputs(case, output_dir, options.save_probabilities)
            labels, props = segment(data, geometry, case.case_id,
                                    probabilities_path=probabilities_path[0] if probabilities_path else None)
            del data
            try:
                write_image(labels_path, labels, props.geometry)  # atomic; a failed write raises WriteError naming it
            except BaseException:
                for p in probabilities_path:  # no probabilities without their label map
                    p.unlink(missing_ok=True)
                raise
            written.append(labels_path)
    except BaseException:
        if failed:  # the error itself is reported by the caller
            log.error("before this error, %d case(s) were not predicted for bad input:\n  %s", len(failed),
                      "\n  ".join(f"{k}: {v}" for k, v in failed.items()))
        raise
    if failed:
        raise CasesFailedError(
            f"{len(failed)} of {len(found.cases)} case(s) not predicted for bad input ({len(written)} written to "
            f"{output_dir}{f', {len(done)} already done' if done else ''}); fix them and rerun with --continue:\n  "
            + "\n  ".join(f"{k}: {v}" for k, v in sorted(failed.items())))
    return written


def _outputs(case: Case, output_dir: Path, save_probabilities: bool) -> list[Path]:
    """The label map (the case id with its image's ending; a DICOM series: .nii.gz), then, if asked, the
    probabilities ({case}.npz)."""
    ending = ".nii.gz" if case.series_uid is not None else supported_ending(case.image_paths[0].name)
    return [output_dir / f"{case.case_id}{ending}"] + ([output_dir / f"{case.case_id}.npz"] if save_probabilities
                                                       else [])
