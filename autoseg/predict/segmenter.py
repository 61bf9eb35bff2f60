"""``Segmenter``: a trained model loaded once in this process, then images in memory segmented one call at a time
(``from autoseg import Segmenter``). ``autoseg predict`` holds one too: its loop over files (``autoseg.predict.
predictor.predict``) reads and preprocesses each case with ``Segmenter.prepare`` and runs the segmenter's networks.

``Segmenter.load`` takes what ``autoseg predict`` takes (``-m`` archive or ``-w`` workspace, ``-c``, ``--folds``,
``--checkpoint``, ``WindowOptions``, ``--threads``) and resolves it the same way (``opened_model``, ``followed_choice``,
``resolve_model``, then ``load_predictor``). ``predict`` runs in the caller's thread with torch's threads only (no
process, no thread of its own), the stages one after the other as ``plan_pipeline`` plans a single case (nothing read
ahead or exported behind), the sliding window planned by ``inference_plan`` within ``inference_budget_bytes`` as in
the CLI, and its export slab by slab (``predict_labels``): the image's probabilities are held only when asked for.
One call at a time per segmenter (a lock): torch's thread count is the process's, set for the call and restored.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import SimpleITK as sitk
import torch

from autoseg.core.errors import InputError
from autoseg.core.lock import refuse_while_held
from autoseg.core.machine import use_cpu_threads
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.raw import Case, load_case
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.cascade import CascadePrediction
from autoseg.predict.case import predict_labels, predict_probabilities
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.export import export_with_probabilities
from autoseg.predict.image_input import ImageInput, ModelInput, image_input, image_output, spatial_array
from autoseg.predict.networks import Predictor
from autoseg.predict.postprocessing import Postprocessing, apply_postprocessing, check_postprocessing
from autoseg.predict.probabilities import ProbabilityMaps
from autoseg.predict.runners import load_predictor
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.preprocessor import preprocess_case
from autoseg.preprocess.store import CaseProperties

READS = "`autoseg predict -w` reads the plan and the trained folds (`-m MODEL.zip` reads an exported model instead)"
IMAGE_ID = "image"  # an image in memory as the log names it


class Segmenter:
    """One configuration's trained folds loaded (``predictor``; a cascade stage's previous stage too), the
    postprocessing to apply, and what the model takes (``model_input``)."""

    def __init__(
        self,
        predictor: Predictor,
        cascade: CascadePrediction | None,
        postprocessing: Postprocessing,
        model_input: ModelInput,
    ) -> None:
        self.predictor = predictor
        self.cascade = cascade
        self.postprocessing = postprocessing
        self.model_input = model_input
        self.threads: int | None = None  # torch's CPU threads for each predict call; None: the process's as they are
        self._lock = threading.Lock()
        self._resources = ExitStack()  # an archive's unpacked folder: removed by close(), or when collected
        self._closer = weakref.finalize(self, self._resources.close)

    @classmethod
    def load(
        cls,
        model: str | Path,
        *,
        config: str | None = None,
        folds: Sequence[int | str] | None = None,
        checkpoint: str | None = None,
        window: WindowOptions = WindowOptions(),
        threads: int | None = None,
    ) -> Segmenter:
        """The model of ``model`` (a ``.zip`` from ``autoseg export-model``, or a workspace folder) as ``autoseg
        predict -m/-w`` loads it: ``config`` None follows inference.json where there is one (its configuration, folds,
        checkpoint and postprocessing; an ensemble of two is refused), else the plan's default configuration;
        ``folds`` None: every fold trained (an archive's); ``checkpoint`` None: "final" (an archive's own). ``window``:
        device, ``tta``/``mirror``, step, runtime and precision as ``autoseg predict``'s flags give them.
        ``threads``: torch's CPU threads while loading and predicting (None: every CPU on the CPU, as ``autoseg
        predict``; the process's on CUDA). Close it (``close``, or ``with``) to remove an archive's unpacked folder."""
        path = Path(model).expanduser()
        if not path.exists():
            raise InputError(
                f"{path}: no such file or folder; give a model archive (.zip from `autoseg export-model`) or a "
                "workspace folder with trained folds"
            )
        resources = ExitStack()
        try:
            given = None if folds is None else tuple(str(f) for f in folds)
            archive = path if path.is_file() else None
            workspace, config, given, checkpoint = resources.enter_context(
                opened_model(path, archive, config, given, checkpoint)
            )
            folds_asked = fold_numbers(given)
            postprocessing = Postprocessing()
            if (choice := followed_choice(workspace, config)) is not None:
                choice = choice.applied(folds_asked, checkpoint)
                if choice.is_ensemble:
                    raise InputError(
                        f"{workspace.inference_path}: an ensemble of {' and '.join(choice.configurations)}, which "
                        "Segmenter does not predict; load one of them (config=...) or use `autoseg predict`"
                    )
                config, folds_asked, checkpoint = choice.configurations[0], choice.folds, choice.checkpoint
                postprocessing = choice.postprocessing
            checkpoint = checkpoint or "final"
            plans, config_plan, folds_asked = resolve_model(
                workspace, config, folds_asked, checkpoint, window, postprocessing
            )
            with prediction_threads(window.device, threads) as count:
                segmenter = cls.of(workspace, plans, config_plan, folds_asked, checkpoint, window, postprocessing)
        except BaseException:
            resources.close()
            raise
        segmenter._resources.enter_context(resources)
        segmenter.threads = count if window.device == "cpu" or threads is not None else None
        return segmenter

    @classmethod
    def of(
        cls,
        workspace: Workspace,
        plans: Plans,
        config: ConfigurationPlan,
        folds: tuple[int | str, ...],
        checkpoint: str,
        window: WindowOptions,
        postprocessing: Postprocessing = Postprocessing(),
    ) -> Segmenter:
        """``config``'s ``folds`` of ``workspace`` (``checkpoint_<checkpoint>.pt``) loaded with ``window``
        (``load_predictor``, after prediction's threads are set); a cascade stage's previous stage too (the same
        folds, checkpoint and window: ``CascadePrediction``)."""
        predictor = load_predictor(workspace, plans, config, folds, checkpoint, window)
        cascade = None
        if config.previous_stage:  # a cascade stage: its previous stage predicts each image first
            cascade = CascadePrediction.load(workspace, predictor, folds, checkpoint, predict_labels, window)
        return cls(predictor, cascade, postprocessing, model_input(workspace, plans))

    @property
    def plans(self) -> Plans:
        return self.predictor.plans

    @property
    def config(self) -> ConfigurationPlan:
        return self.predictor.config

    def predict(
        self,
        image: object,
        *,
        spacing_mm: Sequence[float] | None = None,
        origin_mm: Sequence[float] | None = None,
        direction: Sequence[float] | Sequence[Sequence[float]] | None = None,
        probabilities: bool = False,
    ) -> np.ndarray | sitk.Image | tuple[np.ndarray | sitk.Image, np.ndarray]:
        """The label map of ``image`` in its own geometry: a SimpleITK image for SimpleITK input (one image, or a list
        of them, one per channel), a numpy array of the image's shape for numpy input ((Z, Y, X) or (C, Z, Y, X), its
        geometry in array order: ``spacing_mm`` (z, y, x), ``origin_mm``, ``direction``; ``autoseg.predict.
        image_input``). Postprocessed as inference.json says, where it was followed. ``probabilities``: also every
        output's probabilities, float16 (K, Z, Y, X) numpy in the image's grid (unpostprocessed), as ``predict
        --save-probabilities`` writes them. A wrong channel count, dimension, geometry or value raises
        ``InputError`` saying what was expected."""
        data, read = image_input(image, self.model_input, spacing_mm, origin_mm, direction)
        with self._lock, torch_threads(self.threads):
            prepared, props = self.prepare_image(data, read.geometry, IMAGE_ID)
            del data
            labels, maps = self._segment(prepared, props, probabilities)
        return _answer(labels, maps, read)

    def prepare(self, case: Case) -> tuple[object, CaseProperties]:
        """Read ``case`` and preprocess it (``prepare_image``)."""
        data, _, geometry = load_case(case)
        return self.prepare_image(data, geometry, case.case_id)

    def prepare_image(self, data: np.ndarray, geometry: Geometry, case_id: str) -> tuple[object, CaseProperties]:
        """``data`` (C, Z, Y, X) float32 preprocessed as in training: the (C, Z', Y', X') float32 input of the
        sliding window (a cascade stage: a ``CascadeCase``, preprocessed for both stages) and what export needs to go
        back to the original grid."""
        if self.cascade is not None:
            return self.cascade.prepare_image(data, geometry, case_id)
        data, _, props = preprocess_case(data, None, geometry, self.plans, self.config, case_id)
        return data, props

    def _segment(
        self, prepared: object, props: CaseProperties, probabilities: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The postprocessed label map (Z, Y, X) of a prepared image and, when asked, its probabilities
        (``ProbabilityMaps``)."""
        data = self.cascade.input_of(prepared, props, IMAGE_ID) if self.cascade is not None else prepared
        del prepared
        scheme, maps = self.plans.label_scheme, None
        if not probabilities:
            labels = predict_labels(data, props, IMAGE_ID, self.predictor)
        else:
            window_output = predict_probabilities(data, IMAGE_ID, self.predictor)
            del data
            maps = ProbabilityMaps.empty(props, scheme)
            weights = self.predictor.class_weights
            labels = export_with_probabilities(window_output, props, scheme, maps.write_output, weights)
        if not self.postprocessing.is_identity:
            labels = apply_postprocessing(labels, self.postprocessing, scheme)
        return labels, None if maps is None else maps.maps

    def close(self) -> None:
        """Remove what loading unpacked (an archive's folder); the networks stay usable, held in memory."""
        self._closer()

    def __enter__(self) -> Segmenter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(
    labels: np.ndarray, maps: np.ndarray | None, read: ImageInput
) -> np.ndarray | sitk.Image | tuple[np.ndarray | sitk.Image, np.ndarray]:
    """``Segmenter.predict``'s answer: the label map in the image's own form, with the probabilities if asked."""
    out = image_output(labels, read)
    return out if maps is None else (out, spatial_array(maps, read))


@contextmanager
def opened_model(
    workspace: str | Path,
    archive: str | Path | None,
    config_name: str | None,
    folds: tuple[str, ...] | None,
    checkpoint: str | None,
) -> Iterator[tuple[Workspace, str | None, tuple[str, ...] | None, str | None]]:
    """The workspace to predict with, the configuration, folds and checkpoint: a model ``archive`` checked and
    unpacked for the block (``open_model_archive``; its configuration, the requested folds if it holds them, its
    checkpoint: ``OpenedModel.select``), else ``workspace`` as asked, refused while `plan_and_preprocess
    --overwrite` replaces its plan and folds (``autoseg.core.lock``: each file is replaced whole, but not all at
    once)."""
    if archive is None:
        opened = Workspace.at(workspace)
        refuse_while_held(opened.plan_lock, opened.root, READS, only_replacing=True)
        yield opened, config_name, folds, checkpoint
        return
    with open_model_archive(archive, load_checkpoints=False) as model:  # predict loads them: read once
        config, selected = model.select(config_name, None if folds is None else list(folds))
        yield model.workspace, config, None if selected is None else tuple(selected), model.manifest.checkpoint


def followed_choice(workspace: Workspace, config_name: str | None) -> InferenceChoice | None:
    """``workspace``'s inference.json (``autoseg find-best``'s choice) when no configuration is asked and it has
    one: what prediction follows."""
    if config_name is None and workspace.inference_path.is_file():
        return InferenceChoice.from_json(workspace.inference_path)
    return None


def fold_numbers(folds: tuple[str, ...] | None) -> tuple[int | str, ...] | None:
    """``--folds`` as given (numbers, or "all") as fold keys: the numbers as ints."""
    return None if folds is None else tuple(int(f) if f.isdigit() else f for f in folds)


def resolve_model(
    workspace: Workspace,
    config_name: str | None,
    folds: tuple[int | str, ...] | None,
    checkpoint: str,
    window: WindowOptions,
    postprocessing: Postprocessing,
) -> tuple[Plans, ConfigurationPlan, tuple[int | str, ...]]:
    """The plan, the configuration (``config_name`` None: the plan's default, 3d_fullres if planned) and the folds
    (None: every fold trained with ``checkpoint``) to load, checked before any work: ``window`` against the
    configuration, ``postprocessing`` against the labels (an inference.json of other labels)."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config = plans.configuration(config_name or plans.default_configuration())
    if folds is None:
        folds = trained_folds(workspace, config.name, checkpoint)
    window.check(config)
    check_postprocessing(postprocessing, plans.label_scheme)
    return plans, config, folds


def trained_folds(workspace: Workspace, config_name: str, checkpoint: str) -> tuple[int, ...]:
    """Every fold of ``config_name`` trained with ``checkpoint_<checkpoint>.pt``; refused when there is none."""
    folds = workspace.trained_folds(config_name, checkpoint)
    if not folds:
        raise InputError(
            f"{workspace.root / 'results' / config_name}: no trained fold with "
            f"checkpoint_{checkpoint}.pt; run `{workspace.advice(f'train fold 0 -c {config_name}')}` first"
        )
    return folds


def model_input(workspace: Workspace, plans: Plans) -> ModelInput:
    """What ``workspace``'s model takes: the plan's channels and, from ``fingerprint.json`` where there is one, the
    dimension and median spacing of the images it was trained on."""
    trained = Fingerprint.from_json(workspace.fingerprint_path) if workspace.fingerprint_path.is_file() else None
    spacing = tuple(float(s) for s in np.median(trained.spacings, axis=0)) if trained and trained.cases else None
    return ModelInput(tuple(plans.channel_names), trained.image_dim if trained else None, spacing)


@contextmanager
def prediction_threads(device: str, requested: int | None) -> Iterator[int]:
    """Torch's CPU threads for a prediction, restored afterwards: on the CPU ``requested`` or every CPU
    (``use_cpu_threads``, which logs the count), set before the runners are built (a graph runtime compiles with
    it); elsewhere ``requested``, or the process's as they are. Yields the count."""
    before = torch.get_num_threads()
    if device == "cpu":
        use_cpu_threads(requested, "prediction")
    elif requested is not None:
        torch.set_num_threads(requested)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Torch's CPU threads set to ``count`` for the block and restored (None: left as they are)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
