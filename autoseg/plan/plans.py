"""The plan: everything training and inference need, as a hand-editable, versioned JSON artifact.

All spatial tuples are in array order. A 3D configuration has 3-tuples (z, y, x); a 2D configuration
has 2-tuples (y, x) for the patch and network, while its ``spacing_mm`` keeps 3 entries (z, y, x),
z being the original slice spacing (slices are never resampled along z for 2D).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from autoseg.core.artifacts import Artifact
from autoseg.core.errors import InputError
from autoseg.core.spacing import compute_new_shape
from autoseg.dataset.labels import LabelScheme, LabelValue
from autoseg.model.tiles import GAUSSIAN_CENTRES
from autoseg.model.topology import PLAIN_UNET, NetworkTopology, validate_topology
from autoseg.plan.iteration_target import DEFAULT_TARGET, IterationTarget

TILE_CHOICES = ("planned", "patch")  # ConfigurationPlan.inference_tile, autoseg predict --tile
INFERENCE_ONLY_KEYS = ("inference_patch_size",)  # configuration keys training does not read (resume ignores them)
# Plans keys that say where a figure came from, not what the plan decides: a re-plan for a 3h budget that aims at the
# same seconds per iteration as a 2h one plans the same
PROVENANCE_KEYS = ("cpu_rates_source", "time_budget_seconds", "iteration_reason")
# Plans.image_resampling: whose image resampling autoseg.preprocess.resampling reproduces (its docstring)
IMAGE_RESAMPLING = ("sitk", "skimage")
# Plans.export_space: what prediction resamples back to the input's grid: the probabilities (autoseg's), or the
# averaged logits, the activation applied after (nnU-Net v2's order, for a model imported from it)
EXPORT_SPACES = ("probabilities", "logits")
# Plans.gaussian_centre: where the sliding window's Gaussian weight peaks on an axis of n voxels (GAUSSIAN_CENTRES in
# autoseg.model.tiles): "middle" ((n - 1) / 2, symmetric), or "floor" (n // 2, nnU-Net v2's, for an imported model)


@dataclass(frozen=True)
class IntensityProperties:
    """Foreground intensity statistics of one channel (from the fingerprint), used by CT normalization."""

    mean: float
    std: float
    percentile_00_5: float
    percentile_99_5: float


@dataclass(frozen=True)
class ConfigurationPlan:
    name: str  # "3d_fullres", "3d_lowres", "3d_cascade_fullres", "2d"
    spacing_mm: tuple[float, float, float]  # (z, y, x) target spacing
    median_shape_zyx: tuple[int, int, int]  # median cropped shape after resampling to spacing_mm
    patch_size: tuple[int, ...]  # (z, y, x) for 3D, (y, x) for 2D
    batch_size: int  # micro-batch per step
    accumulation_steps: int  # micro-batches per optimizer step
    network: NetworkTopology
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast on CUDA; fp32 master weights)
    checkpointing: bool = False  # activation checkpointing per stage
    device: str = "cpu"  # the device this configuration was planned for: "cpu" | "cuda"
    memory: dict[str, float] = field(default_factory=dict)  # predicted bytes by term
    predicted_seconds_per_iteration: float | None = None
    flops_per_iteration: float | None = None  # one optimizer step: all micro-batches, recomputation included
    # what stopped the plan from growing: "memory", "time" (CPU), "median_shape" (the patch covers the
    # median image, the batch is limited by memory), "batch_cap" (... by the 5%-of-the-dataset rule),
    # "nothing_fits"; "" for plans written by hand
    limited_by: str = ""
    notes: tuple[str, ...] = ()
    # training-data worker processes (CUDA; 0 on CPU) and the finished batches each holds ahead, sized by
    # the host RAM budget and the CPU count from one worker's bytes (autoseg.memory.loader_worker.worker_bytes)
    loader_workers: int = 0
    loader_queue_depth: int = 2
    loader_worker_bytes: float = 0.0
    # the largest sliding-window tile at prediction (autoseg.plan.inference_tile; each image's is tile_for_image):
    # a valid shape for the network, at least the patch, larger where memory allows; (): the training patch
    inference_patch_size: tuple[int, ...] = ()
    # a cascade stage (3d_cascade_fullres): the configuration whose predicted label map, one-hot
    # (``LabelScheme.one_hot``), is the network's extra input channels ("3d_lowres"); "" for any other
    previous_stage: str = ""
    # the configuration whose preprocessed cases it trains on ("3d_fullres" for the cascade); "": its own
    preprocessed_as: str = ""

    @property
    def dim(self) -> int:
        return self.network.dim

    @property
    def data_configuration(self) -> str:
        """The name of the ``preprocessed/<name>/`` folder this configuration trains on."""
        return self.preprocessed_as or self.name

    def inference_tile(self, tile: str = "planned") -> tuple[int, ...]:
        """The sliding window's tile: ``tile`` "planned" (``inference_patch_size``, or the patch where none is
        planned) or "patch" (the training patch; ``autoseg predict --tile patch``)."""
        if tile not in TILE_CHOICES:
            raise InputError(f"tile {tile!r} is not one of {list(TILE_CHOICES)} (--tile)")
        return tuple(self.inference_patch_size or self.patch_size) if tile == "planned" else tuple(self.patch_size)

    def case_spacing_mm(self, spacing_mm: tuple[float, float, float]) -> tuple[float, float, float]:
        """The spacing a case of ``spacing_mm`` is resampled to: the plan's; 2D configurations keep the slices."""
        if self.dim == 2:
            return (spacing_mm[0], *self.spacing_mm[1:])
        return tuple(self.spacing_mm)

    def resampled_shape(self, shape_zyx: Sequence[int], spacing_mm: tuple[float, float, float]) -> tuple[int, int, int]:
        """(Z, Y, X) of a case of ``shape_zyx`` and ``spacing_mm`` after preprocessing resamples it."""
        return compute_new_shape(shape_zyx, spacing_mm, self.case_spacing_mm(spacing_mm))

    def with_(self, **changes) -> ConfigurationPlan:
        return replace(self, **changes)


def upgrade_network_payload(network: dict) -> None:
    """A configuration's ``network`` as plans schema 2-4 wrote it, in place, to schema 5: ``num_classes`` is
    ``num_outputs`` (schema 3), it names its architecture (there was one: schema 3) and its residual blocks per
    stage (none: schema 5). A schema 5 payload is left as it is."""
    if "num_classes" in network:
        network["num_outputs"] = network.pop("num_classes")
    network.setdefault("architecture", PLAIN_UNET)
    network.setdefault("blocks_per_stage", [])


def _plans_2_to_5(payload: dict) -> dict:
    return _plans_3_to_5(payload)


def _plans_3_to_5(payload: dict) -> dict:
    """Schema 4 records the inference tile; a plan from before predicts with its training patch, as it did."""
    for config in payload.get("configurations", {}).values():
        if "patch_size" in config:
            config.setdefault("inference_patch_size", config["patch_size"])
    return _plans_4_to_5(payload)


def _plans_4_to_5(payload: dict) -> dict:
    """Schema 5: the network may be a residual encoder U-Net (``blocks_per_stage``); every earlier plan's is plain."""
    for config in payload.get("configurations", {}).values():
        upgrade_network_payload(config.get("network", {}))
    return _plans_9_to_10(payload)


def _plans_5_to_6(payload: dict) -> dict:
    """Schema 6 adds the cascade's ``previous_stage`` and ``preprocessed_as``; an earlier plan has no cascade."""
    return _plans_9_to_10(payload)


def _plans_6_to_7(payload: dict) -> dict:
    """Schema 7 adds ``cpu_rates_source``; an earlier plan does not say where its CPU rates came from ("")."""
    return _plans_9_to_10(payload)


def _plans_8_to_9(payload: dict) -> dict:
    """Schema 9 adds ``gaussian_centre``; an earlier plan weighs its tiles by the symmetric Gaussian ("middle")."""
    return _plans_9_to_10(payload)


def _plans_9_to_10(payload: dict) -> dict:
    """Schema 10 records the CPU plan's seconds-per-iteration target and the time budget it was chosen for; an earlier
    CPU plan was sized to the default (1 s) without one. Every earlier upgrade ends here (they add no other key)."""
    if any(c.get("device", "cpu") == "cpu" for c in payload.get("configurations", {}).values()):
        payload.setdefault("cpu_seconds_per_iteration", DEFAULT_TARGET.seconds)
        payload.setdefault("iteration_reason", DEFAULT_TARGET.reason)
    return payload


def _plans_7_to_8(payload: dict) -> dict:
    """Schema 8 adds ``image_resampling`` and ``export_space``; an earlier plan resamples as SimpleITK does ("sitk")
    and exports probabilities, the defaults."""
    return _plans_9_to_10(payload)


@dataclass(frozen=True)
class Plans(Artifact):
    # 2: loader workers per configuration; 3: network.architecture, network.num_outputs; 4: inference_patch_size;
    # 5: network.blocks_per_stage (architecture residual_encoder_unet); 6: previous_stage, preprocessed_as (cascade);
    # 7: cpu_rates_source; 8: image_resampling, export_space; 9: gaussian_centre; 10: cpu_seconds_per_iteration,
    # time_budget_seconds, iteration_reason
    SCHEMA_VERSION = 10
    # a workspace planned by an earlier version still trains, predicts (5 -> 6 -> ... -> 9 change no key, and each
    # upgrade ends with 9 -> 10, which gives a CPU plan the default target it was sized to)
    UPGRADES = {
        2: _plans_2_to_5,
        3: _plans_3_to_5,
        4: _plans_4_to_5,
        5: _plans_5_to_6,
        6: _plans_6_to_7,
        7: _plans_7_to_8,
        8: _plans_8_to_9,
        9: _plans_9_to_10,
    }
    KIND = "plans"

    dataset_name: str
    channel_names: tuple[str, ...]
    labels: dict[str, LabelValue]  # as in dataset.json; a region's values as a tuple
    file_ending: str
    normalization: tuple[str, ...]  # per channel: "ct" | "zscore" | "rescale" | "none"
    use_nonzero_mask: tuple[bool, ...]  # per channel: normalize only inside the crop region
    intensity_properties: tuple[IntensityProperties, ...]  # per channel
    configurations: dict[str, ConfigurationPlan]
    gpu_memory_bytes: int
    host_ram_bytes: int
    preprocessing_processes: int = 1
    host_memory: dict[str, float] = field(default_factory=dict)  # the figures behind the process counts
    regions_class_order: tuple[int, ...] = ()  # region-based labels: the value painted for each region
    cpu_flops_per_second: float | None = None  # CPU plans: the measured throughput the patches were sized for
    cpu_elements_per_second: float | None = None  # ... and its feature-map element rate (None: FLOPs alone)
    cpu_mapped_bytes_per_second: float | None = None  # ... and the rate it maps fresh pages at (None: not counted)
    # CPU plans: where those rates came from: "measured now, ...", "cached in PATH, measured DATE", "... fallback to
    # ..." (no calibration was kept), "--cpu-flops"; "" for CUDA plans and plans of schema 6 and earlier
    cpu_rates_source: str = ""
    # whose image resampling preprocessing reproduces (IMAGE_RESAMPLING): "sitk" (SimpleITK's
    # B-spline, what autoseg plans), "skimage" (nnU-Net v2's, for a model imported from it: autoseg.nnunet)
    image_resampling: str = "sitk"
    # what prediction resamples to the input's grid (EXPORT_SPACES): "probabilities", or "logits" (nnU-Net v2's
    # order, for a model imported from it: the label map is the argmax of the resampled logits)
    export_space: str = "probabilities"
    # where the sliding window's Gaussian weight peaks (GAUSSIAN_CENTRES): "middle", or "floor" (nnU-Net v2's, for a
    # model imported from it: on an even tile the two differ by half a voxel, and so do the blends of overlapping tiles)
    gaussian_centre: str = "middle"
    # CPU plans: the seconds an iteration was sized to (autoseg.plan.iteration_target), the time budget it was chosen
    # for (None: none given) and why (Plans.iteration); None / "" for CUDA plans
    cpu_seconds_per_iteration: float | None = None
    time_budget_seconds: float | None = None
    iteration_reason: str = ""

    @property
    def iteration(self) -> IterationTarget | None:
        """The seconds a CPU plan's iterations were sized to, for which time budget and why; None for a CUDA plan."""
        if self.cpu_seconds_per_iteration is None:
            return None
        return IterationTarget(self.cpu_seconds_per_iteration, self.iteration_reason, self.time_budget_seconds)

    @property
    def label_scheme(self) -> LabelScheme:
        """What the labels mean for the network, loss, sampling and export (``autoseg.dataset.labels``)."""
        scheme = LabelScheme.from_labels(self.labels, self.regions_class_order, where="plans.json labels")
        return replace(scheme, resample_logits=self.export_space == "logits")

    @property
    def num_label_values(self) -> int:
        """Highest label value + 1, ignore included: sizes label maps and per-value counts. The network's
        output channels are ``label_scheme.num_outputs``."""
        return self.label_scheme.num_label_values

    def previous_stage_values(self, config: ConfigurationPlan) -> tuple[int, ...]:
        """The label values one-hot encoded into ``config``'s extra input channels, in channel order: for a cascade
        stage every foreground value a prediction holds (``LabelScheme.predicted_values``), else none."""
        return self.label_scheme.predicted_values if config.previous_stage else ()

    def input_channels(self, config: ConfigurationPlan) -> int:
        """The network's input channels for ``config``: the image's, then ``previous_stage_values``' one-hot."""
        return len(self.channel_names) + len(self.previous_stage_values(config))

    def default_configuration(self) -> str:
        """The configuration commands use when none is named: 3d_fullres if planned, else the first."""
        return "3d_fullres" if "3d_fullres" in self.configurations else next(iter(self.configurations))

    @classmethod
    def from_payload(cls, data, where: str) -> Plans:
        """Read and check a (possibly hand-edited) plan: a value the pipeline cannot run is refused here,
        naming the file, the configuration and the key, before any stage starts."""
        plans = super().from_payload(data, where)
        plans.check(where)
        return plans

    def check(self, where: str = "plans.json") -> None:
        """Raise ``InputError`` for values no stage could run: networks, patches, batches, precisions and
        channel counts that do not fit each other (``check_step_arguments``, ``validate_topology``)."""
        from autoseg.memory.step_record import check_step_arguments

        channels = len(self.channel_names)
        for key in ("normalization", "use_nonzero_mask", "intensity_properties"):
            if len(getattr(self, key)) != channels:
                raise InputError(
                    f"{where}: {key} has {len(getattr(self, key))} entries for {channels} channel(s) "
                    f"{list(self.channel_names)}; give one per channel"
                )
        if self.gaussian_centre not in GAUSSIAN_CENTRES:
            raise InputError(
                f"{where}: gaussian_centre {self.gaussian_centre!r} is not one of {list(GAUSSIAN_CENTRES)}"
            )
        if self.export_space not in EXPORT_SPACES:
            raise InputError(f"{where}: export_space {self.export_space!r} is not one of {list(EXPORT_SPACES)}")
        if self.image_resampling not in IMAGE_RESAMPLING:
            raise InputError(
                f"{where}: image_resampling {self.image_resampling!r} is not one of {list(IMAGE_RESAMPLING)}"
            )
        outputs = self.label_scheme.num_outputs
        for name, config in self.configurations.items():
            at = f"{where}: configuration {name!r}"
            try:
                validate_topology(config.network)
                check_step_arguments(
                    config.network,
                    config.batch_size,
                    config.patch_size,
                    config.precision,
                    "sgd",
                    config.accumulation_steps,
                )
            except InputError as e:
                raise InputError(f"{at}: {e}") from None
            inputs = self.input_channels(config)
            if config.network.in_channels != inputs or config.network.num_outputs != outputs:
                cascade = (
                    f" + {inputs - channels} one-hot channel(s) of {config.previous_stage}'s prediction"
                    if config.previous_stage
                    else ""
                )
                raise InputError(
                    f"{at}: network.in_channels {config.network.in_channels} and num_outputs "
                    f"{config.network.num_outputs} must be the {channels} channel(s){cascade} and "
                    f"{outputs} output(s) of the dataset's channel_names and labels"
                )
            self._check_stages(config, at)
            _check_inference_tile(config, at)
            if len(config.spacing_mm) != 3 or min(config.spacing_mm) <= 0:
                raise InputError(f"{at}: spacing_mm {list(config.spacing_mm)} must be 3 positive values (z, y, x)")
            if config.device not in ("cpu", "cuda") or config.loader_workers < 0 or config.loader_queue_depth < 1:
                raise InputError(
                    f"{at}: device {config.device!r} must be 'cpu' or 'cuda', loader_workers >= 0 and "
                    f"loader_queue_depth >= 1 (found {config.loader_workers}, "
                    f"{config.loader_queue_depth})"
                )

    def _check_stages(self, config: ConfigurationPlan, at: str) -> None:
        """A cascade's previous stage and the data it trains on are planned, are no cascades themselves, and the data
        is at its spacing."""
        for key in ("previous_stage", "preprocessed_as"):
            other = self.configurations.get(getattr(config, key))
            if getattr(config, key) and (other is None or other.previous_stage or other.preprocessed_as):
                raise InputError(
                    f"{at}: {key} {getattr(config, key)!r} must name another planned configuration "
                    f'that is no cascade stage ({list(self.configurations)}), or be ""'
                )
        source = self.configurations.get(config.preprocessed_as)
        if source is not None and (tuple(source.spacing_mm) != tuple(config.spacing_mm) or source.dim != config.dim):
            raise InputError(
                f"{at}: preprocessed_as {config.preprocessed_as!r} has spacing_mm "
                f"{list(source.spacing_mm)}, not this configuration's {list(config.spacing_mm)}; "
                "a configuration trains on data preprocessed at its own spacing"
            )

    def configuration(self, name: str) -> ConfigurationPlan:
        if name not in self.configurations:
            raise InputError(f"no configuration {name!r} in the plans; available: {sorted(self.configurations)}")
        return self.configurations[name]


def _check_inference_tile(config: ConfigurationPlan, at: str) -> None:
    """``inference_patch_size`` must be empty (the patch) or a tile the network can run: one size per axis of the
    patch, each at least the patch's and a multiple of the strides' product."""
    tile = config.inference_patch_size
    divisor = config.network.patch_divisor()
    if tile and (
        len(tile) != len(config.patch_size) or any(t < p or t % d for t, p, d in zip(tile, config.patch_size, divisor))
    ):
        raise InputError(
            f"{at}: inference_patch_size {list(tile)} must have {len(config.patch_size)} sizes, each at "
            f"least the patch_size {list(config.patch_size)} and a multiple of {list(divisor)} (the "
            "product of the network's strides); set it to the patch_size to predict with the patch"
        )
