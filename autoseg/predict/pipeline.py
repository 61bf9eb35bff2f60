"""Many cases as a pipeline: while the network predicts case i, background threads read and preprocess the
next cases and write the previous ones (with ``--save-probabilities``: export them too), like nnU-Net's
``-npp``/``-nps`` processes but sized from the host-RAM budget before the first case starts (``plan_pipeline``)
and bounded: at most
``preprocess_workers`` cases are read ahead and ``export_workers`` cases wait for their export, so the host
holds a known number of preprocessed images and probability maps.

Threads, not processes: reading (isal's inflate), resampling (scipy.ndimage), normalization (numpy) and the
compressed writes release the GIL, so they run beside the network's forward passes (torch releases it too);
a thread shares the probabilities with the main thread instead of copying hundreds of MiB through a pipe,
and costs no second interpreter (about 150 MiB RSS each, ``WORKER_RUNTIME_BYTES``). A kill takes them with
the process; every output is written under a temporary name (``atomic_path``), so nothing half-written stays.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from autoseg.core.resources import available_ram_bytes, cpu_count, process_rss_bytes, processes_for
from autoseg.core.units import MiB
from autoseg.dataset.imageio import Geometry, read_dicom_series_geometry, read_geometry
from autoseg.dataset.labels import LabelScheme
from autoseg.dataset.raw import Case
from autoseg.memory.device import CPU_RUNTIME_BYTES
from autoseg.memory.host import (
    cascade_input_bytes,
    dicom_seg_bytes,
    export_bytes,
    prediction_preprocess_bytes,
    rtstruct_bytes,
    slab_export_bytes,
)
from autoseg.memory.inference_plan import InferencePlan
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.predict.postprocessing import largest_component_bytes

log = logging.getLogger("autoseg")

MAX_BACKGROUND_WORKERS = 4  # per stage; beyond this the GIL-holding parts (Python loops, SimpleITK calls) queue

Item = TypeVar("Item")
Ready = TypeVar("Ready")


@dataclass(frozen=True)
class PipelinePlan:
    """How many cases are read ahead and exported behind the one being predicted, and what the host holds.

    ``case_bytes``: ``runtime`` (the process before the first case: interpreter, libraries, networks) and, for
    the largest case, ``preprocess`` (peak of reading and preprocessing it), ``input`` (its preprocessed image,
    held until predicted), ``predict`` (the sliding window's host tensors) and ``export`` (peak of exporting it,
    its probabilities included).
    ``peak_bytes``: the predicted host peak of the process with these workers busy at once.
    """

    preprocess_workers: int  # 0: the main thread reads each case when it needs it
    export_workers: int  # 0: the main thread exports each case before predicting the next
    case_bytes: dict[str, int]
    peak_bytes: int
    budget_bytes: int

    def describe(self) -> str:
        """One line for ``--verbose``."""
        b = {k: f"{v / MiB:.0f}" for k, v in self.case_bytes.items()}
        return (
            f"{self.preprocess_workers} case(s) read ahead, {self.export_workers} exported behind (threads); "
            f"runtime {b['runtime']} MiB; largest case: preprocess {b['preprocess']} MiB, input {b['input']} "
            f"MiB, predict {b['predict']} MiB, export {b['export']} MiB; predicted host peak "
            f"{self.peak_bytes / MiB:.0f} MiB of {self.budget_bytes / MiB:.0f} MiB"
        )


def pipeline_peak_bytes(case_bytes: dict[str, int], preprocess_workers: int, export_workers: int) -> int:
    """Host peak of the process: its ``runtime`` (what it held before the first case), plus, while the main
    thread predicts a case, the sliding window (``predict``) and its input, every case read ahead at the larger
    of its preprocessing peak and its input, and every export at its peak. Serial (0, 0): the largest of the
    three stages, one at a time."""
    b = case_bytes
    if preprocess_workers == 0 and export_workers == 0:
        return b["runtime"] + max(b["predict"] + b["input"], b["preprocess"], b["export"])
    ahead = preprocess_workers * max(b["preprocess"], b["input"])
    return b["runtime"] + b["predict"] + b["input"] + ahead + export_workers * b["export"]


def plan_pipeline(
    case_bytes: dict[str, int],
    num_cases: int,
    budget_bytes: int,
    preprocess_workers: int | None = None,
    export_workers: int | None = None,
) -> PipelinePlan:
    """Workers per stage (threads): the same number for reading ahead and exporting behind, as many as
    ``budget_bytes`` holds beside the prediction (``processes_for``), at most ``MAX_BACKGROUND_WORKERS``, the
    CPU count and the cases after the first; 0 when one case, or the budget, leaves no room. A given count
    is used as given (``--preprocess-workers``, ``--export-workers``)."""
    cap = min(MAX_BACKGROUND_WORKERS, cpu_count(), max(num_cases - 1, 0))
    auto = 0
    if cap > 0:
        base = case_bytes["runtime"] + case_bytes["predict"] + case_bytes["input"]
        per_pair = max(case_bytes["preprocess"], case_bytes["input"]) + case_bytes["export"]
        auto = processes_for(budget_bytes - base, per_pair, cap, minimum=0)
    pre = auto if preprocess_workers is None else preprocess_workers
    exp = auto if export_workers is None else export_workers
    peak = pipeline_peak_bytes(case_bytes, pre, exp)
    return PipelinePlan(
        preprocess_workers=pre,
        export_workers=exp,
        case_bytes=dict(case_bytes),
        peak_bytes=peak,
        budget_bytes=budget_bytes,
    )


class Pipeline(Generic[Item, Ready]):
    """Runs ``prepare(item)`` up to ``ahead`` items in advance on background threads (in the caller's thread
    when 0) and ``finish(...)`` calls on ``behind`` threads (in the caller's thread when 0), at most ``behind``
    waiting at once. Use as a context manager: leaving it waits for the exports still running and raises the
    first export error; leaving it by an error cancels what has not started."""

    def __init__(self, prepare: Callable[[Item], Ready], ahead: int, behind: int) -> None:
        self._prepare, self._ahead, self._behind = prepare, ahead, behind
        self._pending: deque[Future] = deque()
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None

    def __enter__(self) -> Pipeline[Item, Ready]:
        if self._ahead:
            self._readers = ThreadPoolExecutor(self._ahead, thread_name_prefix="autoseg-read")
        if self._behind:
            self._writers = ThreadPoolExecutor(self._behind, thread_name_prefix="autoseg-export")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failed = exc_type is not None
        try:
            while self._pending and not failed:
                self._pending.popleft().result()  # an export error surfaces here
        finally:
            for pool in (self._readers, self._writers):
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)

    def prepared(self, items: Sequence[Item]) -> Iterator[tuple[Item, Callable[[], Ready]]]:
        """Each item with a call that returns its prepared value (or raises its error), in order; the next
        ``ahead`` items are being prepared meanwhile."""
        if self._readers is None:
            for item in items:
                yield item, (lambda item=item: self._prepare(item))
            return
        futures: deque[tuple[Item, Future]] = deque()
        todo = iter(items)
        for item in todo:
            futures.append((item, self._readers.submit(self._prepare, item)))
            if len(futures) > self._ahead:
                break
        while futures:
            item, future = futures.popleft()
            yield item, future.result
            nxt = next(todo, None)
            if nxt is not None:
                futures.append((nxt, self._readers.submit(self._prepare, nxt)))

    def finish(self, work: Callable[[], object]) -> None:
        """Run ``work`` behind (or now, with no export threads); first waits for the oldest if ``behind`` are
        waiting, raising its error."""
        if self._writers is None:
            work()
            return
        while len(self._pending) >= self._behind:
            self._pending.popleft().result()
        self._pending.append(self._writers.submit(work))


@dataclass(frozen=True)
class LabelWrite:
    """How each label map is written, for what writing it holds (``held_bytes``): postprocessed first
    (``--postprocessing``, inference.json's), in which format (``--output-format``), and what its review holds beside
    it after the write (``reviewed``: ``CaseReview.held_bytes`` of its shape, for ``--preview``, ``--statistics``,
    the uncertainty; None: no review)."""

    postprocessed: bool = False
    output_format: str = "nifti"
    reviewed: Callable[[tuple[int, ...]], int] | None = None

    def held_bytes(self, shape_zyx: tuple[int, ...], scheme: LabelScheme) -> int:
        """What writing a label map of ``shape_zyx`` holds: the label map and its writer's bytes (SimpleITK's copy of
        it; a DICOM SEG's ``dicom_seg_bytes``, an RTSTRUCT's ``rtstruct_bytes``); postprocessed, the label map beside
        the postprocessing, then the written copy and its writer's bytes beside both; reviewed, after the write, the
        label map and its review, where that holds more."""
        written = self._write_bytes(shape_zyx, scheme)
        if self.reviewed is None:
            return written
        labels = math.prod(shape_zyx) * np.dtype(scheme.export_dtype()).itemsize
        return max(written, labels + self.reviewed(shape_zyx))

    def _write_bytes(self, shape_zyx: tuple[int, ...], scheme: LabelScheme) -> int:
        """``held_bytes`` without the review: the write alone."""
        voxels, itemsize = math.prod(shape_zyx), np.dtype(scheme.export_dtype()).itemsize
        labels = voxels * itemsize
        if self.output_format == "dicom-seg":
            writer = dicom_seg_bytes(shape_zyx, len(scheme.names), scheme.has_regions)["total"]
        elif self.output_format == "rtstruct":
            writer = rtstruct_bytes(shape_zyx)["total"]
        else:
            writer = labels  # SimpleITK's copy
        if self.postprocessed:  # the label map beside the postprocessing, then the written copy beside both
            return labels + max(largest_component_bytes(voxels, itemsize), labels + writer)
        return labels + writer


def case_memory(
    cases: list[Case],
    plans: Plans,
    config: ConfigurationPlan,
    window: Callable[..., InferencePlan],
    probability_bytes: int | None,
    write: LabelWrite = LabelWrite(),
    previous: tuple[ConfigurationPlan, Callable[..., InferencePlan]] | None = None,
    first_call_bytes: int = 0,
) -> dict[str, int]:
    """``PipelinePlan.case_bytes`` for the largest of ``cases`` (by its header): the process's RSS now and what the
    runtime's first forward will add to it (``first_call_bytes``: ``runtime_memory.torch_first_call_bytes`` where
    torch runs on the CPU) as ``runtime``; reading and preprocessing (``prediction_preprocess_bytes``), its input and
    its export, the crop taken as the whole image; the sliding window's host tensors (``window``: ``inference_plan``
    for a resampled shape) of the case whose window holds the most (``_largest_window``). ``probability_bytes``
    None: the export runs slab by slab inside the prediction (``slab_export_bytes`` for the window's deepest slab,
    counted in ``predict``) and what runs behind is the label map's write; else the probabilities are held whole
    (``probability_bytes`` per value) and exported behind (``export_bytes``). ``write``: how each label map is
    written (``LabelWrite``: postprocessed first, in which format, its review). ``previous``: a cascade stage's
    previous stage and its (streamed) window (``autoseg.predict.cascade``): each case is preprocessed for both and
    held so until predicted; the previous stage's sliding window and slab export run first, then
    ``cascade_input_bytes`` builds the (C + K)-channel input that the cascade's window reads beside the image."""
    runtime = process_rss_bytes() + first_call_bytes
    geometries = [_header_geometry(c) for c in cases]
    if not geometries:
        return {"runtime": runtime, "preprocess": 0, "input": 0, "predict": 0, "export": 0}
    largest = max(geometries, key=lambda g: math.prod(g.shape_zyx))
    shape, spacing = largest.shape_zyx, largest.spacing_zyx
    after = config.resampled_shape(shape, spacing)
    scheme = plans.label_scheme
    preprocess = prediction_preprocess_bytes(shape, after, len(plans.channel_names), spacing, plans.image_resampling)
    on_host, slabs = _largest_window(geometries, config, window, scheme, streamed=probability_bytes is None)
    previous_predict = 0
    if previous is not None:
        preprocess, previous_predict, cascade_input = _with_previous_stage(previous, plans, config, largest, preprocess)
        on_host += cascade_input  # the cascade's window reads the (C + K)-channel input beside the image
    write_bytes = write.held_bytes(shape, scheme)
    if probability_bytes is None:
        return {
            "runtime": runtime,
            "preprocess": preprocess["total"],
            "input": preprocess["result"],
            "predict": max(on_host + slabs, previous_predict),
            "export": write_bytes,
        }
    return {
        "runtime": runtime,
        "preprocess": preprocess["total"],
        "input": preprocess["result"],
        "predict": max(on_host, previous_predict),
        "export": max(export_bytes(shape, after, scheme, probability_bytes)["total"], write_bytes),
    }


def _largest_window(
    geometries: list[Geometry],
    config: ConfigurationPlan,
    window: Callable[..., InferencePlan],
    scheme: LabelScheme,
    streamed: bool,
) -> tuple[int, int]:
    """(the sliding window's host bytes, its streamed export's slab bytes) of the case that holds the most. Each
    case's tile is fitted to its image, so a smaller image may run a larger tile than the largest image does (a
    44x161x155 case a 44x112x112 tile, a 49x155x165 one 32x96x112): every distinct resampled shape is planned
    (``window``; its tile's simulation or measurement is made once and kept, as predicting the case would)."""
    largest_of: dict[tuple[int, ...], tuple[int, ...]] = {}  # resampled shape -> the largest original shape
    for g in geometries:
        after = tuple(config.resampled_shape(g.shape_zyx, g.spacing_zyx))
        largest_of[after] = max(largest_of.get(after, g.shape_zyx), g.shape_zyx, key=math.prod)
    best = (0, 0)
    for after, shape in largest_of.items():
        plan = window(after)
        terms = (_window_host_bytes(plan), _slab_bytes(shape, after, scheme, plan) if streamed else 0)
        best = max(best, terms, key=sum)
    return best


def _header_geometry(case: Case) -> Geometry:
    """``case``'s geometry from its headers: its first channel's file, or its DICOM series' slices."""
    if case.series_uid is None:
        return read_geometry(case.image_paths[0])
    return read_dicom_series_geometry(case.image_paths[0], case.series_uid)


def _with_previous_stage(
    previous: tuple[ConfigurationPlan, Callable[..., InferencePlan]],
    plans: Plans,
    config: ConfigurationPlan,
    largest: Geometry,
    preprocess: dict[str, int],
) -> tuple[dict[str, int], int, int]:
    """A cascade stage's case (``case_memory``'s ``previous``): ``preprocess`` (the cascade's own) with the previous
    stage's preprocessing beside it, what the previous stage's window and slab export (then the input built) hold
    beside both preprocessed images, and the (C + K)-channel input's bytes (``cascade_input_bytes``)."""
    stage, stage_window = previous
    shape, spacing, scheme = largest.shape_zyx, largest.spacing_zyx, plans.label_scheme
    after, low_after = config.resampled_shape(shape, spacing), stage.resampled_shape(shape, spacing)
    low = prediction_preprocess_bytes(shape, low_after, len(plans.channel_names), spacing, plans.image_resampling)
    low_plan = stage_window(low_after)
    values = plans.previous_stage_values(config)
    cascade = cascade_input_bytes(
        shape, after, len(plans.channel_names), len(values), spacing, np.dtype(scheme.export_dtype()).itemsize
    )
    # the previous stage's window and slab export, then the input built, each beside both preprocessed images
    previous_predict = _window_host_bytes(low_plan) + _slab_bytes(shape, low_after, scheme, low_plan)
    previous_predict = max(previous_predict, cascade["total"])
    preprocess = {
        "total": max(low["total"], low["result"] + preprocess["total"]),
        "result": preprocess["result"] + low["result"],
    }
    return preprocess, previous_predict, cascade["input"]


def _window_host_bytes(plan: InferencePlan) -> int:
    """What a sliding window adds to the host's RSS. CUDA: its output, and the accumulator if it lives there; CPU:
    its whole predicted peak but the runtime and the networks' parameters, which the process holds already."""
    if plan.host_accumulator_bytes:
        return plan.host_accumulator_bytes
    return max(plan.peak_bytes - CPU_RUNTIME_BYTES - plan.parameter_bytes, 0)


def _slab_bytes(
    shape_zyx: tuple[int, ...], after_zyx: tuple[int, ...], scheme: LabelScheme, plan: InferencePlan
) -> int:
    """The host bytes of a streamed export (``slab_export_bytes`` for the window's deepest slab), with each slab's
    copy to the host when the accumulator is on the device."""
    slabs = slab_export_bytes(shape_zyx, after_zyx, scheme, plan.slab_depth)["total"]
    if plan.accumulator_device != "cpu":  # each slab is copied to the host first
        slabs += scheme.num_outputs * plan.slab_depth * after_zyx[1] * after_zyx[2] * 4
    return slabs


def pipeline_budget_bytes() -> int:
    """Host RAM the whole prediction may hold: what the process holds now and 90% of the RAM still available."""
    return process_rss_bytes() + int(0.9 * available_ram_bytes())
