"""A checkpoint's network as a checked ONNX graph (``autoseg.model.onnx_graph``), as the model archive holds it
beside each fold's checkpoint (``graph_member``) and as ``predict -w`` gets it from the machine cache
(``cached_graph``, keyed by the checkpoint file's sha256 digest; never written to the workspace).

Every graph made here passed the agreement check on tiles of a training case (``check_tiles``: patch-sized tiles of
the configuration's first preprocessed case): its logits differ from torch's by at most
``MAX_DIFFERENCE_OF_RANGE`` of their range and its argmax agrees on at least ``MIN_ARGMAX_AGREEMENT`` of the
voxels, else ``checked_graph`` raises ``RunError`` naming the fold and the figures.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from autoseg.core.errors import InputError, RunError
from autoseg.core.machine import MachineCache, torch_version
from autoseg.core.workspace import Workspace
from autoseg.model.onnx_graph import OPSET, available_runtime, check_agreement, export_graph
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.networks import load_trained_network
from autoseg.preprocess import store

log = logging.getLogger("autoseg")
GRAPH_FILE = "network.onnx"  # beside checkpoint_<which>.pt in the archive: results/<config>/fold_<k>/network.onnx
CACHE_FOLDER = "onnx_graphs"  # in the machine cache: onnx_graphs/<checkpoint sha256>-torch<version>-opset<n>.onnx
CHECK_TILES = 2  # tiles of the case the agreement check runs: its centre and its first corner


def graph_member(checkpoint_member: str) -> str:
    """The archive member of the graph of the checkpoint member ``checkpoint_member`` (same folder)."""
    return checkpoint_member.rsplit("/", 1)[0] + "/" + GRAPH_FILE


def check_tiles(workspace: Workspace, config: ConfigurationPlan) -> torch.Tensor:
    """``CHECK_TILES`` tiles ``(CHECK_TILES, C, *patch)`` float32 of ``config``'s first complete preprocessed case
    (zero-padded where the case is smaller than the patch; 2D: its middle slice). Channels the case lacks (a cascade
    stage's previous-stage labels) are zero. Without a preprocessed case (a model archive holds none), standard
    normal noise (seed 0), what normalized intensities look like: the check then compares the computation on inputs
    of a case's scale, not on a case."""
    folder = workspace.preprocessed(config.data_configuration)  # a cascade stage trains on another's cases
    cases = store.list_complete_cases(folder) if folder.is_dir() else []
    patch = tuple(config.patch_size)
    if not cases:
        log.info("%s: no preprocessed case; the ONNX graphs of %s are checked on noise tiles", folder, config.name)
        noise = np.random.default_rng(0).standard_normal((CHECK_TILES, config.network.in_channels, *patch))
        return torch.from_numpy(noise.astype(np.float32))
    data = np.load(store.case_files(folder, cases[0]).data, mmap_mode="r")  # (C, Z, Y, X)
    if config.network.dim == 2:
        data = data[:, data.shape[1] // 2]
    channels = np.zeros((config.network.in_channels, *data.shape[1:]), np.float32)
    channels[: min(len(data), len(channels))] = data[: len(channels)]
    padded = np.pad(channels, [(0, 0)] + [(0, max(0, p - s)) for p, s in zip(patch, channels.shape[1:])])
    starts = [tuple(max(0, (s - p) // 2) for s, p in zip(padded.shape[1:], patch)), (0,) * len(patch)]
    tiles = [padded[(slice(None), *(slice(a, a + p) for a, p in zip(start, patch)))] for start in starts]
    return torch.from_numpy(np.stack(tiles[:CHECK_TILES]))


def checked_graph(
    checkpoint_path: Path, plans: Plans, config: ConfigurationPlan, tiles: torch.Tensor, what: str
) -> bytes:
    """The ONNX graph of the network in ``checkpoint_path`` (``config``'s), checked against torch on ``tiles``
    ``(B, C, *patch)``; ``what`` names the fold in the refusal ("fold 0 of 3d_fullres")."""
    runtime = available_runtime()
    if runtime is None:
        raise InputError(
            f"checking the ONNX graph of {what} needs ONNX Runtime or OpenVINO; install one "
            '(`pip install "autoseg[onnx]"` or `pip install "autoseg[openvino]"`)'
        )
    network = load_trained_network(checkpoint_path, plans, config, "cpu")
    graph = export_graph(network, tiles[:1])
    agreement = check_agreement(network, graph, tiles, runtime)
    if not agreement.passed:
        raise RunError(
            f"the ONNX graph of {what} ({checkpoint_path}) does not compute what torch computes: "
            f"{agreement.describe()}; export the model without the onnx extra, or report this network"
        )
    log.info("ONNX graph of %s: %s", what, agreement.describe())
    return graph


def file_digest(path: Path) -> str:
    """The sha256 hex digest of the file at ``path``, read once per (path, size, modification time) in a process: a
    prediction asks it of a checkpoint for its graph, its bf16 verdicts and auto's timings."""
    stat = path.stat()
    return _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of ``path``, read in 1 MiB pieces; ``size`` and ``mtime_ns`` key the cache (a rewritten file is read
    again)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cached_graph(
    workspace: Workspace, plans: Plans, config: ConfigurationPlan, checkpoint_path: Path, cache: MachineCache
) -> bytes:
    """The checked graph of ``checkpoint_path`` (a fold of ``config`` in ``workspace``) from ``cache``, made and kept
    there on first use; keyed by the checkpoint file's sha256 digest (a changed checkpoint gets a new graph), torch's
    version and the opset."""
    key = f"{file_digest(checkpoint_path)}-torch{torch_version()}-opset{OPSET}.onnx"
    what = f"{checkpoint_path.parent.name.replace('_', ' ')} of {config.name}"
    graph, where = cache.kept_file(
        CACHE_FOLDER, key, lambda: checked_graph(checkpoint_path, plans, config, check_tiles(workspace, config), what)
    )
    log.info("ONNX graph of %s: %s", what, where)
    return graph
