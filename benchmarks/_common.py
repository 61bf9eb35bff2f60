"""Helpers shared by the hand-run benchmarks: the generated dataset, process-tree memory, nnU-Net v2 runs.

Standard library only at import, so that a benchmark can run parts of itself in another venv's interpreter
(``--nnunet-python``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

NNUNET_DATASET_ID = 977


def make_dataset(root: Path, num_cases: int, shape_zyx: tuple[int, int, int]) -> Path:
    """The nnU-Net-layout dataset, generated once per (cases, shape)."""
    from autoseg.demo.data import make_demo_dataset

    tag = f"{num_cases}x{'x'.join(map(str, shape_zyx))}"
    dataset = root / f"Dataset{NNUNET_DATASET_ID:03d}_Bench{tag}"
    marker = dataset / ".complete"
    if not marker.is_file():
        t0 = time.perf_counter()
        make_demo_dataset(dataset, num_train=num_cases, num_test=0, shape_zyx=shape_zyx, seed=0)
        marker.write_text(tag)
        seconds = time.perf_counter() - t0
        print(f"generated {num_cases} cases of about {shape_zyx} in {seconds:.0f} s: {dataset}")
    return dataset


def run_autoseg(*args: str) -> float:
    """Run ``python -m autoseg ARGS`` (this interpreter, the checkout's autoseg when PYTHONPATH names it); its wall
    seconds. Exits with the command and its stderr's tail when it fails."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "autoseg", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"autoseg {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - t0


def _children(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def _memory(pid: int, with_pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process, 0 if it is gone. ``with_pss`` False: PSS is 0 and RSS comes from
    /proc/PID/statm, which costs nothing; smaps_rollup walks the page tables under the process's memory lock
    (polled every 0.1 s on a 2.7 GB process it took a quarter of a core and stalled the process's own faults)."""
    try:
        if not with_pss:
            return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"), 0
        rss = pss = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
        return rss, pss
    except (OSError, ValueError, IndexError):
        return 0, 0


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of ``pid`` and its living descendants (/proc/*/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _children(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15)
    return total


PSS_EVERY = 10  # polls: PSS (smaps_rollup, costly) once a second at the default interval, RSS every poll


class TreeMemoryPeak:
    """Peak summed RSS / PSS and process count of ``pid``'s process tree, polled every ``interval_s`` (PSS every
    ``PSS_EVERY`` polls).

    ``poll()`` takes one sample; as a context manager a thread polls until exit (for a process measuring
    itself and its workers)."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss_bytes = self.peak_pss_bytes = self.processes = 0
        self._polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        tree = _children(self.pid)
        usage = [_memory(p, with_pss=self._polls % PSS_EVERY == 0) for p in tree]
        self._polls += 1
        self.peak_rss_bytes = max(self.peak_rss_bytes, sum(u[0] for u in usage))
        self.peak_pss_bytes = max(self.peak_pss_bytes, sum(u[1] for u in usage))
        self.processes = max(self.processes, len(tree))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def __enter__(self) -> TreeMemoryPeak:
        self.poll()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()

    def as_dict(self) -> dict:
        return {
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_pss_bytes": self.peak_pss_bytes,
            "processes": self.processes,
        }


def run_measured(cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> dict:
    """Run ``cmd``; wall seconds and the peak summed RSS / PSS of its process tree (polled every 0.1 s)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    peak = TreeMemoryPeak(proc.pid)
    while proc.poll() is None:
        peak.poll()
        time.sleep(peak.interval_s)
    seconds = time.perf_counter() - t0
    if log_path:
        out.close()
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:] if log_path else ""
        raise SystemExit(f"{cmd[:3]} ... failed with exit code {proc.returncode}\n{tail}")
    return {"seconds": seconds, **peak.as_dict()}


def nnunet_python(requested: str | None) -> str | None:
    """The interpreter to run nnU-Net v2 with: ``requested``, else this one if it imports nnunetv2."""
    if requested:
        return requested
    try:
        import nnunetv2  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def nnunet_env(work: Path) -> dict[str, str]:
    """nnU-Net's folder variables under ``work`` (nnUNet_raw, nnUNet_preprocessed, nnUNet_results)."""
    return {
        "nnUNet_raw": str(work / "nnUNet_raw"),
        "nnUNet_preprocessed": str(work / "nnUNet_preprocessed"),
        "nnUNet_results": str(work / "nnUNet_results"),
    }


def run_nnunet(python: str, dataset: Path, work: Path, processes: int, configs: list[str]) -> dict:
    """nnUNetv2_plan_and_preprocess on the same files (linked into a fresh nnUNet_raw)."""
    folders = nnunet_env(work)
    for d in folders.values():
        shutil.rmtree(d, ignore_errors=True)
        Path(d).mkdir(parents=True)
    (Path(folders["nnUNet_raw"]) / dataset.name).symlink_to(dataset)
    entry = (
        "from nnunetv2.experiment_planning.plan_and_preprocess_entrypoints import "
        "plan_and_preprocess_entry; plan_and_preprocess_entry()"
    )
    cmd = [
        python,
        "-c",
        entry,
        "-d",
        str(NNUNET_DATASET_ID),
        "-c",
        *configs,
        "-np",
        *[str(processes)] * len(configs),
        "-npfp",
        str(processes),
        "--verify_dataset_integrity",
    ]
    return run_measured(cmd, env={**os.environ, **folders}, log_path=work / "nnunet.log")


def parse_or_serve_child(
    parser: argparse.ArgumentParser, key: str, handlers: dict[str, Callable[[dict], dict]]
) -> argparse.Namespace | None:
    """The benchmark's arguments; None when this process is one of its own children (``--child SPEC``, see
    ``add_child_arguments``), after running the handler that ``SPEC[key]`` names on the spec and writing its result
    as JSON to ``SPEC["out"]``."""
    args = parser.parse_args()
    if args.child is None:
        return args
    spec = json.loads(args.child)
    Path(spec["out"]).write_text(json.dumps(handlers[spec[key]](spec)))
    return None


def add_child_arguments(parser: argparse.ArgumentParser, data_dir_name: str) -> None:
    """``--data-dir`` (default: ``data_dir_name`` in the temporary folder) and the hidden ``--child SPEC`` of a
    benchmark that measures in its own child processes (``parse_or_serve_child``)."""
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / data_dir_name))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
