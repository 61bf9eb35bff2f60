"""Hand-written test inputs shared by several test modules (no planner run)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import Geometry
from autoseg.model.topology import NetworkTopology
from autoseg.plan.fingerprint import CaseFingerprint, Fingerprint
from autoseg.plan.plans import ConfigurationPlan, IntensityProperties, Plans
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.postprocessing import Postprocessing
from autoseg.preprocess import store


def tiny_plans(host_ram_bytes: int = 8 * GiB, spacing_mm: tuple[float, ...] = (2.75, 0.9, 0.9)) -> Plans:
    """A hand-written plan: one 3D configuration (2 stages, 8-16 features, patch 8x16x16), z-score in the body."""
    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(8, 16),
        kernel_sizes=((3, 3, 3), (3, 3, 3)),
        strides=((1, 1, 1), (2, 2, 2)),
    )
    config = ConfigurationPlan(
        name="3d_fullres",
        spacing_mm=spacing_mm,
        median_shape_zyx=(12, 28, 28),
        patch_size=(8, 16, 16),
        batch_size=2,
        accumulation_steps=1,
        network=topology,
        inference_patch_size=(8, 16, 16),
    )
    labels = {"background": 0, "organ": 1, "lesion": 2}
    return Plans(
        dataset_name="Tiny",
        channel_names=("MRI",),
        labels=labels,
        file_ending=".nii.gz",
        normalization=("zscore",),
        use_nonzero_mask=(True,),
        intensity_properties=(IntensityProperties(100.0, 20.0, 50.0, 200.0),),
        configurations={"3d_fullres": config},
        gpu_memory_bytes=8 * GiB,
        host_ram_bytes=host_ram_bytes,
    )


def tiny_topology(num_outputs: int) -> NetworkTopology:
    """A 2-stage 3D U-Net with 4 and 8 features: a training step takes milliseconds."""
    return NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=num_outputs,
        features_per_stage=(4, 8),
        kernel_sizes=((3, 3, 3), (3, 3, 3)),
        strides=((1, 1, 1), (2, 2, 2)),
    )


def set_configuration(workspace: Workspace, name: str, **changes) -> None:
    """Rewrite configuration ``name`` of the workspace's plans.json with ``changes``; a new ``patch_size`` is the
    inference tile too unless ``inference_patch_size`` is given (the planned tile was for the old patch)."""
    plans = Plans.from_json(workspace.plans_path)
    if "patch_size" in changes:
        changes.setdefault("inference_patch_size", changes["patch_size"])
    config = plans.configuration(name).with_(**changes)
    dataclasses.replace(plans, configurations={**plans.configurations, name: config}).to_json(workspace.plans_path)


SHAPE_ZYX = (12, 20, 20)


def case_properties(case_id: str, shape_zyx: tuple[int, ...]) -> store.CaseProperties:
    """Properties of a case stored as it was read: 1 mm voxels, nothing cropped or resampled, no copies."""
    z, y, x = (int(s) for s in shape_zyx)
    geometry = Geometry(
        ndim=3,
        size_xyz=(x, y, z),
        spacing_xyz=(1.0, 1.0, 1.0),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )
    return store.CaseProperties(
        case_id=case_id,
        geometry=geometry,
        spacing_mm=(1.0, 1.0, 1.0),
        target_spacing_mm=(1.0, 1.0, 1.0),
        shape_before_crop=(z, y, x),
        crop_bbox=((0, z), (0, y), (0, x)),
        shape_after_crop=(z, y, x),
        shape_after_resample=(z, y, x),
    )


def write_case(folder: Path, case_id: str, data: np.ndarray, seg: np.ndarray) -> None:
    """A preprocessed case (``store.write_case``): data float32 (C, Z, Y, X), seg int8 (1, Z, Y, X), every
    voxel of classes 1 and 2 as its foreground locations, properties without copies."""
    locations = {str(c): np.argwhere(seg[0] == c).tolist() for c in (1, 2)}
    store.write_case(
        folder, case_properties(case_id, data.shape[1:]), data.astype(np.float32), seg.astype(np.int8), locations
    )


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


def box_case(two_d: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A raw image (Z, Y, X) float32 with known objects, and its labels (Z, Y, X) uint8: zeros around a body
    of 100 (crop-to-nonzero keeps y 2:13, x 1:15 and, in 3D, z 1:8), a box of 200 (label 1) and a box of 300
    (label 2). 3D: (9, 14, 16); ``two_d``: one slice (1, 14, 16), as a 2D image is read."""
    shape = (1, 14, 16) if two_d else (9, 14, 16)
    body_z, one_z, two_z = (slice(None),) * 3 if two_d else (slice(1, 8), slice(2, 5), slice(5, 7))
    image, labels = np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.uint8)
    image[body_z, 2:13, 1:15] = 100.0
    image[one_z, 4:9, 3:9], labels[one_z, 4:9, 3:9] = 200.0, 1
    image[two_z, 6:11, 8:13], labels[two_z, 6:11, 8:13] = 300.0, 2
    return image, labels


class IntensityClasses(torch.nn.Module):
    """Logits (N, 3, *spatial) from channel 0 of a z-scored input (N, C, *spatial): class 0 below ``low``,
    1 between ``low`` and ``high``, 2 above. A stand-in for a trained network whose answer is known at
    every voxel, in 2D and 3D."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.low, self.high = low, high

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x[:, :1]
        one = 10.0 * (v - self.low)
        return torch.cat([torch.zeros_like(v), one, one + 10.0 * (v - self.high)], dim=1)


def box_network(image: np.ndarray) -> IntensityClasses:
    """``IntensityClasses`` with thresholds at 150 and 250 of ``box_case``'s raw intensities, in the units of
    the plan's z-score with the nonzero mask (mean and std of the image's nonzero voxels)."""
    body = image[image != 0]
    mean, std = float(body.mean()), float(body.std())
    return IntensityClasses((150.0 - mean) / std, (250.0 - mean) / std)


def thick_slice_fingerprint(channel: str = "CT") -> Fingerprint:
    """20 thick-slice CT-like cases, about 100 x 400 x 400 voxels of 3 x 0.8 x 0.8 mm."""
    rng = np.random.default_rng(0)
    cases = []
    for i in range(20):
        shape = (int(rng.integers(80, 120)), int(rng.integers(380, 420)), int(rng.integers(380, 420)))
        cases.append(
            CaseFingerprint(
                case_id=f"case_{i:03d}",
                spacing_mm=(float(rng.uniform(2.5, 3.5)), 0.8, 0.8),
                shape_zyx=shape,
                cropped_shape_zyx=(shape[0] - 10, shape[1] - 60, shape[2] - 60),
                class_voxels=(1000, 100, 10),
            )
        )
    return Fingerprint(
        dataset_name="Dataset009_Synthetic",
        channel_names=(channel,),
        labels={"background": 0, "liver": 1, "tumour": 2},
        file_ending=".nii.gz",
        image_dim=3,
        cases=tuple(cases),
        foreground_intensity=(IntensityProperties(mean=60.0, std=40.0, percentile_00_5=-100.0, percentile_99_5=250.0),),
        median_relative_crop_volume=0.7,
    )


def inference_choice(
    configurations: tuple[str, ...], postprocessing: Postprocessing = Postprocessing()
) -> InferenceChoice:
    """An inference.json as `autoseg find-best` writes it, choosing ``configurations`` (fold 0, final checkpoint)
    and ``postprocessing``, its figures placeholders."""
    return InferenceChoice(
        configurations=configurations,
        folds=(0,),
        checkpoint="final",
        postprocessing=postprocessing,
        cv_dice=0.5,
        cv_dice_postprocessed=0.5,
        class_dice={},
        class_dice_postprocessed={},
        steps=(),
        candidates={},
        num_cases=1,
    )
