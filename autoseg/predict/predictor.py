"""Prediction of new scans: preprocess, sliding window over every fold's network, export in the
input's exact geometry (size, spacing, origin, direction).

Export streams one output channel at a time: each class's probability map is resampled back to the
cropped original shape and folded into a running argmax (plain labels), or each region's map is
resampled, thresholded at 0.5 and painted with its ``regions_class_order`` value over the regions before
it (region-based labels; ``autoseg.dataset.labels``). Host memory grows with the volume (one resampled map, best
score fp32, labels), not with volume x channels.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from autoseg.core.artifacts import check_writable_folder, remove_stale_temporaries
from autoseg.core.errors import InputError
from autoseg.core.precision import effective_precision
from autoseg.core.resources import choose_cpu_threads
from autoseg.core.workspace import Workspace
from autoseg.dataset.cropping import uncrop
from autoseg.dataset.imageio import supported_ending, write_image
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case, list_prediction_inputs, load_case
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.preprocess.preprocessor import preprocess_case
from autoseg.preprocess.resampling import resample_channel
from autoseg.preprocess.store import CaseProperties

log = logging.getLogger("autoseg")


def load_trained_network(checkpoint_path: Path, config: ConfigurationPlan, device: str) -> torch.nn.Module:
    if not checkpoint_path.is_file():
        raise InputError(f"{checkpoint_path} not found; train this fold first (`autoseg train fold N`)")
    state = read_checkpoint_file(checkpoint_path, "predict with --checkpoint naming another one (best, final, "
                                 "latest), or train this fold again")
    network = build_network(config.network)
    network.load_state_dict(state["network"])
    return network.to(device).eval()


def export_segmentation(probabilities: torch.Tensor, props: CaseProperties,
                        scheme: LabelScheme | None = None) -> np.ndarray:
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
                 mirror: bool, tile_batch_size: int, device: str,
                 step_fraction: float = 0.5) -> tuple[np.ndarray, CaseProperties]:
    data, _, geometry = load_case(case)
    data, _, props = preprocess_case(data, None, geometry, plans, config, case.case_id)
    mirror_axes = tuple(range(config.dim)) if mirror else ()
    scheme = plans.label_scheme
    probabilities = None
    for network in networks:  # fold ensemble: mean of softmax (classes) / sigmoid (regions) probabilities
        p = sliding_window_predict(network, data, config.patch_size, scheme.num_outputs, step_fraction=step_fraction,
                                   mirror_axes=mirror_axes, tile_batch_size=tile_batch_size, device=device,
                                   precision=effective_precision(config.precision, device),
                                   activation="sigmoid" if scheme.has_regions else "softmax")
        probabilities = p if probabilities is None else probabilities.add_(p)
    assert probabilities is not None
    probabilities /= len(networks)
    return export_segmentation(probabilities, props, scheme), props


def predict(workspace: Workspace, inputs: str | Path, output_dir: str | Path, *, config_name: str | None = None,
            folds: tuple[int, ...] | None = None, checkpoint: str = "final", mirror: bool = True,
            tile_batch_size: int = 1, device: str = "cpu", progress: bool = True) -> list[Path]:
    """Segment every case in ``inputs`` (folder or file) with the trained folds; write into ``output_dir``.
    ``config_name`` None: the plan's default configuration (3d_fullres if planned, else the first)."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config_name = config_name or plans.default_configuration()
    config = plans.configuration(config_name)
    if folds is None:
        folds = workspace.trained_folds(config_name, checkpoint)
        if not folds:
            raise InputError(f"{workspace.root / 'results' / config_name}: no trained fold with "
                                    f"checkpoint_{checkpoint}.pt; run `autoseg train fold 0` first")
    output_dir = check_writable_folder(output_dir, "-o/--output")  # before any work
    networks = [load_trained_network(workspace.checkpoint(config_name, f, checkpoint), config, device)
                for f in folds]
    image_dim = (Fingerprint.from_json(workspace.fingerprint_path).image_dim  # the images trained on: 2 or 3
                 if workspace.fingerprint_path.is_file() else None)
    cases = list_prediction_inputs(inputs, len(plans.channel_names), None, image_dim)  # headers checked
    remove_stale_temporaries(output_dir, [_output_name(case) for case in cases])  # left by a killed run
    threads = torch.get_num_threads()
    if device == "cpu":
        _choose_cpu_threads(networks[0], config, tile_batch_size)
    try:
        return _predict_cases(cases, networks, plans, config, output_dir, mirror, tile_batch_size, device, progress)
    finally:
        torch.set_num_threads(threads)


def _choose_cpu_threads(network: torch.nn.Module, config: ConfigurationPlan, tile_batch_size: int) -> None:
    """All CPUs unless one thread measures faster for a tile batch (cores busy with another process)."""
    x = torch.zeros(tile_batch_size, config.network.in_channels, *config.patch_size)

    def forward() -> None:
        with torch.inference_mode():
            network(x)

    choose_cpu_threads(forward, "a tile batch")


def _predict_cases(cases: list[Case], networks: list[torch.nn.Module], plans: Plans, config: ConfigurationPlan,
                   output_dir: Path, mirror: bool, tile_batch_size: int, device: str, progress: bool) -> list[Path]:
    written = []
    for case in tqdm(cases, desc="predict", unit="case", disable=not progress):
        labels, props = predict_case(case, networks, plans, config, mirror=mirror,
                                     tile_batch_size=tile_batch_size, device=device)
        out = output_dir / _output_name(case)
        write_image(out, labels, props.geometry)  # atomic; a failed or short write raises WriteError naming out
        written.append(out)
    return written


def _output_name(case: Case) -> str:
    """The segmentation's file name: the case id with its image's ending."""
    return f"{case.case_id}{supported_ending(case.image_paths[0].name)}"
