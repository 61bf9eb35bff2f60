"""Host RAM of a training-data loader worker and of a prediction's export: predicted vs measured (run by hand).

Loader workers: for each plan below, two preprocessed cases at least as large as the plan's largest read box are
written once (cached under ``--data-dir``), so that every sample reads a whole box. A fresh process stands in
for the trainer (the training modules imported, a U-Net's modules and optimizer built) and starts a real
``BatchLoader`` with one worker process (forked, as torch's DataLoader does on Linux), which builds the batches.
Predicted: ``loader_worker_bytes`` as the planner writes it into the plan (``autoseg.plan.sizing.loader_workers``,
its queue depth included). Two runs per plan: "as planned" (the plan's ``LoaderConfig``: 36 % of samples rotated
or scaled, ``--batches`` batches) and "worst" (every sample rotated to the angles and scaled by the factor that
give the largest read box, ``enlarged_patch_size``, every intensity transform applied, and enough batches for
the low-resolution caches to fill): the model is an upper bound, which a long run reaches.

Measured, of the worker: its peak RSS (VmHWM), and what that is made of: the trainer's pages it shares (anonymous
pages it has not written since the fork: ``Anonymous - Private_Dirty`` of smaps_rollup at the end), the pages
of the cases it maps (page cache, reclaimable and shared by the workers; RssFile at the end, more while a box is
read), and its own memory, which is what the model predicts (what each worker adds to the trainer's RAM): the
peak of its anonymous memory (polled every 5 ms from /proc/PID/statm) minus the shared pages, plus its slots
(shared memory, RssShmem).

Export: a fresh process holds the probabilities of a prediction (float16, as the predictor does) and exports
them to the label map in the original grid, either whole (``export_segmentation``, the ``--save-probabilities``
path; predicted by ``export_bytes``) or slab by slab as the sliding window hands them over (``SlabExport``;
predicted by ``slab_export_bytes`` for the slab depth, the slabs themselves held by the window). Measured: VmHWM
after the export minus the RSS before the probabilities (whole) or with them (slabs), the peak reset
(clear_refs) first; the predicted process peak is that RSS plus the model, as ``case_memory`` counts it.

    python benchmarks/host_memory.py [--batches 20] [--only loader|export] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import add_child_arguments, parse_or_serve_child

from autoseg.core.units import MiB

# name, patch, batch, image channels, stored case shape (z, y, x): each at least the plan's largest read box,
# worst-case batches (enough for the low-resolution caches to fill: low_resolution_cache_bytes)
LOADER_PLANS = [
    ("3d_fullres 8 GiB plan of the benchmark dataset (dummy 2D)", (56, 192, 192), 2, 1, (80, 390, 380), 200),
    ("3D 128^3, 2 channels", (128, 128, 128), 2, 2, (304, 310, 304), 20),
    ("2D 512^2, batch 12", (512, 512), 12, 1, (6, 1016, 1016), 150),
]
# name, original shape, resampled shape, outputs, slab depth
EXPORTS = [
    ("100x256x256, 3 classes", (100, 256, 256), (80, 190, 190), 3, 8),
    ("100x256x256, 8 classes", (100, 256, 256), (80, 190, 190), 8, 8),
    ("200x512x512, 5 classes", (200, 512, 512), (160, 380, 380), 5, 12),
]
POLL_S = 0.005
PAGE = os.sysconf("SC_PAGE_SIZE")


def write_cases(folder: Path, shape_zyx: tuple[int, ...], channels: int, count: int = 2) -> list[str]:
    """``count`` preprocessed cases (``autoseg.preprocess.store.write_case``): smooth float32 images, labels
    0 / 1 / 2 in blobs and -1 on the border; written once."""
    from autoseg.dataset.imageio import Geometry
    from autoseg.preprocess.store import CaseProperties, write_case

    ids = [f"case_{i}" for i in range(count)]
    marker = folder / ".complete"
    if marker.is_file():
        return ids
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    z, y, x = shape_zyx
    grid = np.ogrid[:z, :y, :x]
    for case_id in ids:
        data = np.empty((channels, z, y, x), np.float32)
        for c in range(channels):
            data[c] = sum(np.sin(g * rng.uniform(0.02, 0.1)) for g in grid) + rng.normal(size=(z, y, x))
        seg = np.zeros((1, z, y, x), np.int8)
        r2 = sum(((g - s / 2) / (s / 3)) ** 2 for g, s in zip(grid, shape_zyx, strict=True))
        seg[0][r2 < 1] = 1
        seg[0][r2 < 0.3] = 2
        seg[0, :, 0, :] = -1
        locations = {str(k): np.argwhere(seg[0] == k)[::97] for k in (1, 2)}
        geometry = Geometry(
            ndim=3,
            size_xyz=(x, y, z),
            spacing_xyz=(1.0, 1.0, 1.0),
            origin_xyz=(0.0, 0.0, 0.0),
            direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
        )
        props = CaseProperties(
            case_id=case_id,
            geometry=geometry,
            spacing_mm=(1.0, 1.0, 1.0),
            target_spacing_mm=(1.0, 1.0, 1.0),
            shape_before_crop=shape_zyx,
            crop_bbox=tuple((0, s) for s in shape_zyx),
            shape_after_crop=shape_zyx,
            shape_after_resample=shape_zyx,
        )
        write_case(folder, props, data, seg, locations)
    marker.write_text("")
    return ids


def configuration(patch: tuple[int, ...], batch: int):
    """A ``ConfigurationPlan`` with ``patch`` and ``batch`` (the network does not enter the loader's bytes)."""
    from autoseg.model.topology import NetworkTopology
    from autoseg.plan.plans import ConfigurationPlan

    dim = len(patch)
    network = NetworkTopology(
        dim=dim,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(8, 16),
        kernel_sizes=((3,) * dim,) * 2,
        strides=((1,) * dim, (2,) * dim),
    )
    return ConfigurationPlan(
        name="3d_fullres" if dim == 3 else "2d",
        spacing_mm=(1.0, 1.0, 1.0),
        median_shape_zyx=(100, 200, 200),
        patch_size=patch,
        batch_size=batch,
        accumulation_steps=1,
        network=network,
        device="cuda",
    )


def stand_in_trainer():
    """What a trainer holds in Python objects when it starts its loader: the training modules imported, a U-Net's
    modules of the planned size (6 stages, 32-320 features; on the meta device: on a GPU the tensors are not in
    host RAM) and their optimizer."""
    import torch

    import autoseg.train.trainer  # noqa: F401
    from autoseg.model.network import build_network
    from autoseg.model.topology import NetworkTopology

    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(32, 64, 128, 256, 320, 320),
        kernel_sizes=((3, 3, 3),) * 6,
        strides=((1, 1, 1),) + ((2, 2, 2),) * 5,
    )
    with torch.device("meta"):
        network = build_network(topology)
    return network, torch.optim.SGD(network.parameters(), lr=0.01, momentum=0.99, nesterov=True)


def worst_transform(config):
    """The ``PatchTransform`` whose read box is the largest (the angles on the grid ``enlarged_patch_size``
    searches, at the largest scale)."""
    from autoseg.data.augment_spatial import PatchTransform, read_size

    a = math.radians(config.rotation_deg_effective)
    steps = np.linspace(-a, a, 31)
    in_plane = config.dim == 2 or config.dummy_2d
    grid = (
        [(t,) for t in np.linspace(-a, a, 721)]
        if in_plane
        else [(u, v, w) for u in steps for v in steps for w in steps]
    )
    scale = max(config.scale_range)
    return max(
        (PatchTransform(tuple(float(t) for t in angles), scale) for angles in grid),
        key=lambda t: math.prod(read_size(config.patch_size, t, config.dummy_2d)),
    )


class WorkerMemory:
    """Peaks of a process's resident (all), anonymous (resident minus file and shared memory) and shared bytes,
    polled from /proc/PID/statm every ``POLL_S`` by a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_rss, self.peak_anon, self.shared_at_peak_anon = pid, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        path = f"/proc/{self.pid}/statm"
        while not self._stop.is_set():
            try:
                resident, shared = (int(v) * PAGE for v in Path(path).read_text().split()[1:3])
            except (OSError, ValueError):
                return
            self.peak_rss = max(self.peak_rss, resident)
            if resident - shared > self.peak_anon:
                self.peak_anon = resident - shared
            time.sleep(POLL_S)

    def __enter__(self) -> WorkerMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of ``pid`` in bytes."""
    from autoseg.core.resources import proc_field_bytes

    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
    return {k: proc_field_bytes(f"/proc/{pid}/status", k) or 0 for k in keys}


def child_loader(spec: dict) -> dict:
    """One real BatchLoader worker drawing ``batches`` batches; its memory and the plan's prediction."""
    import dataclasses

    import torch

    import autoseg.data.sampler as sampler_module
    from autoseg.data.loader import BatchLoader
    from autoseg.plan.budget import Budget
    from autoseg.plan.sizing import loader_workers
    from autoseg.plan.training_data import loader_config

    torch.set_num_threads(1)  # this process only receives batches
    _trainer = stand_in_trainer()  # alive when the worker forks, as the trainer's objects are
    planned = configuration(tuple(spec["patch"]), spec["batch"])
    sizing = loader_workers(planned, spec["channels"], Budget(host_ram_bytes=64 * 1024 * MiB, cpu_count=8))
    config = loader_config(planned, augment=True)
    if spec["worst"]:
        config = dataclasses.replace(
            config,
            p_noise=1.0,
            p_blur=1.0,
            p_brightness=1.0,
            p_contrast=1.0,
            p_low_res=1.0,
            p_gamma=1.0,
            p_gamma_inverted=1.0,
        )
        worst = worst_transform(config)
        sampler_module.draw_patch_transform = lambda rng, cfg: worst  # the worker forks with it
    parent = status(os.getpid())
    loader = BatchLoader(
        spec["folder"], spec["case_ids"], config, seed=0, num_workers=1, queue_depth=int(sizing["loader_queue_depth"])
    )
    next(loader)
    worker = loader._iterator._workers[0].pid  # torch's worker process
    t0 = time.perf_counter()
    with WorkerMemory(worker) as memory:
        for _ in range(spec["batches"]):
            next(loader)
        end = status(worker)
        rollup = {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in Path(f"/proc/{worker}/smaps_rollup").read_text().splitlines()[1:]
        }
    seconds = time.perf_counter() - t0
    loader.close()
    return {
        "predicted": sizing["loader_worker_bytes"],
        "depth": sizing["loader_queue_depth"],
        "box": list(config.enlarged_patch_size),
        "parent": parent,
        "worker": end,
        "peak_rss": memory.peak_rss,
        "rollup": rollup,
        "peak_anon": memory.peak_anon,
        "seconds": seconds,
    }


def child_export(spec: dict) -> dict:
    """A real export of float16 probabilities of ``spec``'s shapes: whole or slab by slab."""
    import torch

    from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
    from autoseg.dataset.imageio import Geometry
    from autoseg.dataset.labels import LabelScheme
    from autoseg.memory.host import export_bytes, slab_export_bytes
    from autoseg.predict.export import SlabExport, export_segmentation
    from autoseg.preprocess.store import CaseProperties

    torch.set_num_threads(1)
    original, resampled, outputs = tuple(spec["original"]), tuple(spec["resampled"]), spec["outputs"]
    spacing = (1.0, 0.8, 0.8)
    target = tuple(s * o / r for s, o, r in zip(spacing, original, resampled, strict=True))
    geometry = Geometry(
        ndim=3,
        size_xyz=tuple(reversed(original)),
        spacing_xyz=tuple(reversed(spacing)),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )
    props = CaseProperties(
        case_id="x",
        geometry=geometry,
        spacing_mm=spacing,
        target_spacing_mm=target,
        shape_before_crop=original,
        crop_bbox=tuple((0, s) for s in original),
        shape_after_crop=original,
        shape_after_resample=resampled,
    )
    scheme = LabelScheme.plain(outputs)
    runtime = process_rss_bytes()
    probabilities = torch.empty((outputs, *resampled), dtype=torch.float16)
    probabilities.uniform_(generator=torch.Generator().manual_seed(0))  # in place: no float32 temporary
    if spec["slab_depth"]:
        runtime = process_rss_bytes()  # the window holds the probabilities; the export holds beside them
        predicted = slab_export_bytes(original, resampled, scheme, spec["slab_depth"])
        reset_peak_rss()
        export = SlabExport(props, scheme, resampled)
        depth = spec["slab_depth"]
        for z in range(0, resampled[0], depth):
            export.add(z, min(z + depth, resampled[0]), probabilities[:, z : z + depth])
        labels = export.labels()
    else:
        predicted = export_bytes(original, resampled, scheme, probabilities.element_size())
        reset_peak_rss()
        labels = export_segmentation(probabilities, props, scheme)
    peak = peak_rss_bytes()
    assert labels.shape == original
    return {"runtime": runtime, "peak": peak, "predicted": predicted}


def run_child(spec: dict) -> dict:
    """``spec`` in a fresh interpreter (``--child``); its result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps({**spec, "out": out.name})]
        subprocess.run(cmd, check=True)
        return json.loads(Path(out.name).read_text())


def loader_table(root: Path, batches: int) -> list[str]:
    """One row per plan and run: the worker's peak RSS and what it is made of; the model against its own part."""
    lines = [
        "| plan | run | batches | read box | predicted | worker peak RSS (VmHWM) | shared with the trainer | "
        "case files mapped | own peak (private + slots) | predicted / own |",
        "|---" * 10 + "|",
    ]
    for name, patch, batch, channels, case_shape, worst_batches in LOADER_PLANS:
        folder = root / f"cases_{'x'.join(map(str, case_shape))}_{channels}ch"
        ids = write_cases(folder, case_shape, channels)
        for worst in (False, True):
            n = worst_batches if worst else batches
            r = run_child(
                {
                    "kind": "loader",
                    "folder": str(folder),
                    "case_ids": ids,
                    "patch": patch,
                    "batch": batch,
                    "channels": channels,
                    "worst": worst,
                    "batches": n,
                }
            )
            w, rollup = r["worker"], r["rollup"]
            shared = rollup["Anonymous"] - rollup["Private_Dirty"]  # the trainer's pages not written since the fork
            own = r["peak_anon"] - shared + w["RssShmem"]  # the slots stay mapped once written
            lines.append(
                f"| {name} | {'worst' if worst else 'as planned'} | {n} | {tuple(r['box'])} | "
                f"{r['predicted'] / MiB:.0f} MiB | {w['VmHWM'] / MiB:.0f} MiB | {shared / MiB:.0f} MiB | "
                f"{w['RssFile'] / MiB:.0f} MiB | {own / MiB:.0f} MiB | {r['predicted'] / own:.2f} |"
            )
            print(
                lines[-1],
                f"(trainer at fork: RSS {r['parent']['VmRSS'] / MiB:.0f} MiB, anon "
                f"{r['parent']['RssAnon'] / MiB:.0f} MiB; queue depth {r['depth']}; {n} batches in "
                f"{r['seconds']:.1f} s)",
                flush=True,
            )
    return lines


def export_table() -> list[str]:
    lines = [
        "| prediction | path | predicted | measured (peak - RSS before) | predicted / measured | "
        "process peak RSS: predicted, measured |",
        "|---|---|---|---|---|---|",
    ]
    for name, original, resampled, outputs, depth in EXPORTS:
        for slab_depth in (0, depth):
            r = run_child(
                {
                    "kind": "export",
                    "original": original,
                    "resampled": resampled,
                    "outputs": outputs,
                    "slab_depth": slab_depth,
                }
            )
            predicted, measured = r["predicted"]["total"], r["peak"] - r["runtime"]
            path = f"slabs of {slab_depth}" if slab_depth else "whole (float16)"
            lines.append(
                f"| {name} -> {'x'.join(map(str, resampled))} | {path} | {predicted / MiB:.0f} MiB | "
                f"{measured / MiB:.0f} MiB | {predicted / measured:.2f} | "
                f"{(r['runtime'] + predicted) / MiB:.0f}, {r['peak'] / MiB:.0f} MiB |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="batches each loader worker builds, measured")
    parser.add_argument("--only", choices=("loader", "export"), default=None)
    add_child_arguments(parser, "autoseg_host_memory_bench")
    args = parse_or_serve_child(parser, "kind", {"loader": child_loader, "export": child_export})
    if args is None:
        return
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    tables = []
    if args.only in (None, "loader"):
        tables.append(loader_table(root, args.batches))
    if args.only in (None, "export"):
        tables.append(export_table())
    print()
    for table in tables:
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
