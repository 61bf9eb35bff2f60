"""Preprocessing every training case of a dataset for one configuration (``preprocess``): the cases not yet
complete, each by ``autoseg.preprocess.preprocessor.run_case``, in this process or in spawned worker processes,
and a report of each case's predicted and measured peak memory (``case_peak_bytes``, ``predicted_case_peaks``),
seconds and disk use.

A worker process that dies (the OS's out-of-memory killer) fails the run at once with the case(s) it held and
their predicted memory (``autoseg.core.workers.WorkerDiedError``); the cases completed so far are kept.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from autoseg.core.artifacts import remove_stale_temporaries, write_json
from autoseg.core.resources import process_rss_bytes
from autoseg.core.units import GiB, MiB
from autoseg.core.workers import run_in_processes
from autoseg.dataset.imageio import read_geometry
from autoseg.dataset.raw import Case, RawDataset
from autoseg.memory.host import WORKER_RUNTIME_BYTES, preprocess_worker_bytes
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.preprocess.precompute import PrecomputeConfig, augment_case_bytes
from autoseg.preprocess.preprocessor import CaseResult, CaseTask, run_case
from autoseg.preprocess.store import is_complete

log = logging.getLogger("autoseg")
PeaksOf = Callable[[set[str]], dict[str, int]]  # case ids -> predicted peak bytes


@dataclass(frozen=True)
class PreprocessOptions:
    """How ``preprocess`` runs: ``processes`` > 1 runs cases in that many spawned worker processes
    (``autoseg.preprocess.run`` sizes them with ``autoseg.core.resources.processes_for``); ``seed`` of the
    sampled foreground voxels and the augmented copies; ``precompute``: augmented copies per case;
    ``report_path``: a JSON of the per-case predicted and measured peak memory, seconds and disk use;
    ``cropped``: the cases' crops for the predictions (``predicted_case_peaks``)."""

    processes: int = 1
    seed: int = 0
    progress: bool = True
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    report_path: str | Path | None = None
    cropped: Mapping[str, tuple[int, ...]] | None = None


def case_peak_bytes(
    shape_zyx: tuple[int, ...],
    spacing_mm: tuple[float, float, float],
    config: ConfigurationPlan,
    num_channels: int,
    num_label_values: int,
    num_augmentations: int = 0,
    runtime_bytes: int = WORKER_RUNTIME_BYTES,
    cropped_zyx: tuple[int, ...] | None = None,
) -> int:
    """Predicted peak RAM of one worker on one case (``run_case``), from the image's shape and spacing and its crop
    to the nonzero box (the fingerprint's ``cropped_shape_zyx``; None: the whole image, an upper bound).

    With augmented copies the last phase holds the resampled case (float32 data, labels) plus
    ``augment_case_bytes``. ``runtime_bytes``: the process before the case (``preprocess_worker_bytes``).
    """
    after = config.resampled_shape(cropped_zyx or shape_zyx, spacing_mm)
    peak = preprocess_worker_bytes(shape_zyx, after, num_channels, runtime_bytes, cropped_zyx)["total"]
    if num_augmentations > 0:
        va = math.prod(after)
        held = num_channels * va * 4 + va
        augment = augment_case_bytes(after, num_channels, num_label_values + 1)  # + 1: the -1 label
        peak = max(peak, runtime_bytes + held + augment)
    return int(peak)


def predicted_case_peaks(
    cases: list[Case],
    plans: Plans,
    config: ConfigurationPlan,
    num_augmentations: int = 0,
    runtime_bytes: int = WORKER_RUNTIME_BYTES,
    cropped: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, int]:
    """``case_peak_bytes`` of each case, from the image headers (no voxel data read) and its crop in ``cropped``
    (case id -> the fingerprint's ``cropped_shape_zyx``; a case not in it: the whole image), in a process that
    holds ``runtime_bytes`` before it."""
    peaks = {}
    for case in cases:
        geometry = read_geometry(case.image_paths[0])
        peaks[case.case_id] = case_peak_bytes(
            geometry.shape_zyx,
            geometry.spacing_zyx,
            config,
            len(case.image_paths),
            plans.num_label_values,
            num_augmentations,
            runtime_bytes,
            (cropped or {}).get(case.case_id),
        )
    return peaks


def preprocess(
    dataset: RawDataset,
    plans: Plans,
    config_name: str,
    out_dir: str | Path,
    options: PreprocessOptions | None = None,
) -> Path:
    """Preprocess every training case of ``dataset`` for one configuration into ``out_dir``, as ``options``
    say (default ``PreprocessOptions()``: one process, seed 0, no augmented copies, no report).

    Complete cases are skipped, so a rerun after a crash finishes the job."""
    options = options or PreprocessOptions()
    config = plans.configuration(config_name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(out_dir)
    if stale:
        log.info("removed %d temporary file(s) of an interrupted run in %s", len(stale), out_dir)
    num_copies = options.precompute.num_copies
    todo = [c for c in dataset.cases if not is_complete(out_dir, c.case_id, num_copies)]
    tasks = [CaseTask(c, plans, config, out_dir, options.seed, options.precompute) for c in todo]
    # in this process, each case's peak is on top of what the process holds now, not a fresh worker's runtime
    runtime = process_rss_bytes() if _in_process(tasks, options) else WORKER_RUNTIME_BYTES

    def peaks_of(case_ids: set[str]) -> dict[str, int]:  # only when reporting: case_peak_bytes imports torch
        return predicted_case_peaks(
            [c for c in todo if c.case_id in case_ids], plans, config, num_copies, runtime, options.cropped
        )

    bar = tqdm(
        total=len(dataset.cases),
        initial=len(dataset.cases) - len(todo),
        desc=f"preprocess {config_name}",
        unit="case",
        disable=not options.progress,
    )
    t0 = time.perf_counter()
    results = _run_cases(tasks, options, bar, peaks_of, plans)
    seconds = time.perf_counter() - t0
    _report(
        results, peaks_of({r.case_id for r in results}), config_name, seconds, options.processes, options.report_path
    )
    return out_dir


def _in_process(tasks: list[CaseTask], options: PreprocessOptions) -> bool:
    """Cases run in this process for one process or at most one case (no worker to spawn)."""
    return options.processes <= 1 or len(tasks) <= 1


def _run_cases(
    tasks: list[CaseTask], options: PreprocessOptions, bar: tqdm, peaks_of: PeaksOf, plans: Plans
) -> list[CaseResult]:
    """Each task by ``run_case``, in this process or in ``options.processes`` spawned workers (at most one per
    task), advancing ``bar`` per case; a dead worker's error names its cases (``_describe_death``)."""
    try:
        if _in_process(tasks, options):
            results = []
            for task in tasks:
                results.append(run_case(task))
                bar.update()
        else:
            n = min(options.processes, len(tasks))
            results = run_in_processes(
                run_case,
                tasks,
                [t.case.case_id for t in tasks],
                n,
                on_result=lambda _: bar.update(),
                describe_death=lambda f: _describe_death(f, peaks_of, plans, n),
            )
    finally:
        bar.close()
    return results


def _describe_death(in_flight: dict[str, int | None], peaks_of: PeaksOf, plans: Plans, processes: int) -> str:
    """The message for a dead worker: the case(s) it held, their predicted peaks, the RAM budget."""
    peaks = peaks_of(set(in_flight))

    def describe(case_id: str, code: int | None) -> str:
        how = "" if code is None else (f", killed by signal {-code}" if code < 0 else f", exit code {code}")
        return f"{case_id} (predicted peak {peaks.get(case_id, 0) / MiB:.0f} MiB{how})"

    described = ", ".join(describe(c, code) for c, code in sorted(in_flight.items())) or "an unknown case"
    return (
        f"a preprocessing worker process died while working on {described}; usually the OS killed it "
        f"for lack of memory. {processes} processes were running under a host RAM budget of "
        f"{plans.host_ram_bytes / GiB:.1f} GiB. Rerun with fewer --processes (e.g. --processes 1) or "
        "with more free memory; the cases completed so far are kept and skipped."
    )


def _report(
    results: list[CaseResult],
    peaks: dict[str, int],
    config_name: str,
    seconds: float,
    processes: int,
    report_path: str | Path | None,
) -> None:
    """Log the run's summary (and write the per-case report if asked)."""
    if not results:
        log.info("preprocess %s: every case already complete", config_name)
        return
    measured = [r for r in results if r.peak_rss_bytes]
    worst = max(measured, key=lambda r: r.peak_rss_bytes or 0) if measured else None
    disk = sum(r.disk_bytes for r in results)
    augmented = sum(r.augmented_disk_bytes for r in results)
    log.info(
        "preprocess %s: %d case(s) in %.1f s (%.2f cases/s, %d process(es)); disk %.1f MiB "
        "(augmented copies %.1f MiB); peak RAM per case predicted max %.0f MiB%s",
        config_name,
        len(results),
        seconds,
        len(results) / max(seconds, 1e-9),
        processes,
        disk / MiB,
        augmented / MiB,
        max(peaks.values(), default=0) / MiB,
        f", measured max {worst.peak_rss_bytes / MiB:.0f} MiB ({worst.case_id})" if worst else "",
    )
    if report_path is not None:
        write_json(
            report_path,
            {
                "config": config_name,
                "seconds": seconds,
                "processes": processes,
                "disk_bytes": disk,
                "augmented_disk_bytes": augmented,
                "cases": [
                    {
                        "case_id": r.case_id,
                        "seconds": r.seconds,
                        "disk_bytes": r.disk_bytes,
                        "predicted_peak_bytes": peaks.get(r.case_id),
                        "measured_peak_rss_bytes": r.peak_rss_bytes,
                    }
                    for r in results
                ],
            },
        )
