"""Hand-written test inputs shared by several test modules (no planner run)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from autoseg.core.workspace import Workspace
from autoseg.model.topology import NetworkTopology
from autoseg.plan.plans import ConfigurationPlan, IntensityProperties, Plans

GiB = 1024**3


def tiny_plans(host_ram_bytes: int = 8 * GiB, spacing_mm: tuple[float, ...] = (2.75, 0.9, 0.9)) -> Plans:
    """A hand-written plan: one 3D configuration (2 stages, 8-16 features, patch 8x16x16), z-score in the body."""
    topology = NetworkTopology(dim=3, in_channels=1, num_outputs=3, features_per_stage=(8, 16),
                               kernel_sizes=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2)))
    config = ConfigurationPlan(name="3d_fullres", spacing_mm=spacing_mm, median_shape_zyx=(12, 28, 28),
                               patch_size=(8, 16, 16), batch_size=2, accumulation_steps=1, network=topology)
    labels = {"background": 0, "organ": 1, "lesion": 2}
    return Plans(dataset_name="Tiny", channel_names=("MRI",), labels=labels, file_ending=".nii.gz",
                 normalization=("zscore",), use_nonzero_mask=(True,),
                 intensity_properties=(IntensityProperties(100.0, 20.0, 50.0, 200.0),),
                 configurations={"3d_fullres": config}, gpu_memory_bytes=8 * GiB,
                 host_ram_bytes=host_ram_bytes)


def tiny_topology(num_outputs: int) -> NetworkTopology:
    """A 2-stage 3D U-Net with 4 and 8 features: a training step takes milliseconds."""
    return NetworkTopology(dim=3, in_channels=1, num_outputs=num_outputs, features_per_stage=(4, 8),
                           kernel_sizes=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2)))


def set_configuration(workspace: Workspace, name: str, **changes) -> None:
    """Rewrite configuration ``name`` of the workspace's plans.json with ``changes``."""
    plans = Plans.from_json(workspace.plans_path)
    config = plans.configuration(name).with_(**changes)
    dataclasses.replace(plans, configurations={**plans.configurations, name: config}).to_json(workspace.plans_path)


SHAPE_ZYX = (12, 20, 20)


def write_case(folder: Path, case_id: str, data: np.ndarray, seg: np.ndarray) -> None:
    """A preprocessed case: data float32 (C, Z, Y, X), seg int8 (1, Z, Y, X), every voxel of classes 1 and 2
    in ``<case>_locations.npy`` (int32 rows class, z, y, x), a ``<case>.json`` without copies."""
    np.save(folder / f"{case_id}_data.npy", data.astype(np.float32))
    np.save(folder / f"{case_id}_seg.npy", seg.astype(np.int8))
    rows = [(c, *v) for c in (1, 2) for v in np.argwhere(seg[0] == c).tolist()]
    np.save(folder / f"{case_id}_locations.npy", np.array(rows, dtype=np.int32).reshape(-1, 4))
    (folder / f"{case_id}.json").write_text(json.dumps({"case_id": case_id}))


def make_cases(
    folder: Path,
    num_cases: int = 2,
    shape_zyx: tuple[int, ...] = SHAPE_ZYX,
    num_channels: int = 1,
    foreground: str = "blob",
    seed: int = 0,
) -> list[str]:
    """Data = a ramp that encodes the voxel position (so a patch can be located); seg -1 on the y=0 rows."""
    rng = np.random.default_rng(seed)
    z, y, x = np.meshgrid(*(np.arange(s) for s in shape_zyx), indexing="ij")
    ids = []
    for i in range(num_cases):
        data = np.stack([1 + z * 10000 + y * 100 + x + 0.5 * c for c in range(num_channels)]) + 1000000 * i
        seg = np.zeros((1, *shape_zyx), dtype=np.int8)
        if foreground == "blob":  # a small cube in a corner: rarely hit by a uniform patch
            seg[0, -2:, -3:, -3:] = 1
        elif foreground == "scatter":  # 10 % of voxels, spread uniformly
            seg[0] = rng.random(shape_zyx) < 0.1
        seg[0, :, 0, :] = -1
        write_case(folder, f"case_{i}", data, seg)
        ids.append(f"case_{i}")
    return ids
