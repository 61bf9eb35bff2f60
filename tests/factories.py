"""Hand-written test inputs shared by several test modules (no planner run)."""

from __future__ import annotations

import dataclasses

from autoseg.plans import ConfigurationPlan, IntensityProperties, NetworkTopology, Plans
from autoseg.workspace import Workspace

GiB = 1024**3


def tiny_plans(host_ram_bytes: int = 8 * GiB, spacing_mm: tuple[float, ...] = (2.75, 0.9, 0.9)) -> Plans:
    """A hand-written plan: one 3D configuration (2 stages, 8-16 features, patch 8x16x16), z-score in the body."""
    topology = NetworkTopology(dim=3, in_channels=1, num_classes=3, features_per_stage=(8, 16),
                               kernel_sizes=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2)))
    config = ConfigurationPlan(name="3d_fullres", spacing_mm=spacing_mm, median_shape_zyx=(12, 28, 28),
                               patch_size=(8, 16, 16), batch_size=2, accumulation_steps=1, network=topology)
    labels = {"background": 0, "organ": 1, "lesion": 2}
    return Plans(dataset_name="Tiny", channel_names=("MRI",), labels=labels, file_ending=".nii.gz",
                 normalization=("zscore",), use_nonzero_mask=(True,),
                 intensity_properties=(IntensityProperties(100.0, 20.0, 50.0, 200.0),),
                 configurations={"3d_fullres": config}, gpu_memory_bytes=8 * GiB,
                 host_ram_bytes=host_ram_bytes)


def tiny_topology(num_classes: int) -> NetworkTopology:
    """A 2-stage 3D U-Net with 4 and 8 features: a training step takes milliseconds."""
    return NetworkTopology(dim=3, in_channels=1, num_classes=num_classes, features_per_stage=(4, 8),
                           kernel_sizes=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2)))


def set_configuration(workspace: Workspace, name: str, **changes) -> None:
    """Rewrite configuration ``name`` of the workspace's plans.json with ``changes``."""
    plans = Plans.from_json(workspace.plans_path)
    config = plans.configuration(name).with_(**changes)
    dataclasses.replace(plans, configurations={**plans.configurations, name: config}).to_json(workspace.plans_path)
