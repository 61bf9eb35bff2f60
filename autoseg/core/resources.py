"""What the machine offers and how work is spread over it: available host RAM (cgroup limits included), CUDA
memory, CPU count and the CPU time every process has spent on this process's CPUs (``cpu_busy_seconds``);
``processes_for`` (process and worker counts from a RAM budget); glibc's arenas
(``use_one_malloc_arena``). Torch's CPU threads: ``autoseg.core.machine.use_cpu_threads``."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from autoseg.core.units import GiB, KiB

log = logging.getLogger("autoseg")


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_limit_bytes() -> int | None:
    """The cgroup (v2 or v1) memory limit minus current usage, or None when unlimited/unknown."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_path)
        if limit is not None and limit < 1 << 60:
            usage = _read_int(usage_path) or 0
            return max(limit - usage, 0)
    return None


def proc_field_bytes(path: str, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file (meminfo, self/status) in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * KiB
    except OSError:
        return None
    return None


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux VmRSS; elsewhere its peak so far)."""
    rss = proc_field_bytes("/proc/self/status", "VmRSS")
    return rss if rss is not None else peak_rss_bytes() or 0


def reset_peak_rss() -> None:
    """Make ``peak_rss_bytes`` count from now (Linux: writing 5 to clear_refs resets VmHWM to the RSS)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory since it started or since ``reset_peak_rss`` (Linux VmHWM), else its
    peak since it started (ru_maxrss); None where neither is known."""
    peak = proc_field_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB
    except (ImportError, OSError):
        return None


M_ARENA_MAX = -8  # glibc's mallopt parameter: the most arenas malloc creates


def use_one_malloc_arena() -> bool:
    """From now on, threads allocate from glibc's main arena instead of an arena of their own; True where this is
    glibc and it took the setting. Each arena keeps what its thread freed for that thread's reuse: prediction's
    read-ahead and export threads (``autoseg.predict.pipeline``) would hold a large share of a case's peak RSS that
    way, beyond what the memory model predicts (docs/prediction.md, "Many cases"). Threads that have allocated
    already keep their arena, so call it before starting them."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def meminfo_available_bytes() -> int | None:
    return proc_field_bytes("/proc/meminfo", "MemAvailable")


def available_ram_bytes() -> int:
    """Host RAM this process may still use: the smaller of MemAvailable and the cgroup headroom."""
    candidates = [v for v in (meminfo_available_bytes(), cgroup_memory_limit_bytes()) if v is not None]
    if not candidates:
        return 8 * GiB
    return min(candidates)


def cpu_count() -> int:
    """CPUs this process may run on (affinity mask), at least 1."""
    return max(len(cpu_affinity()), 1)


# /proc/stat's per-CPU columns of time spent working (user, nice, system, irq, softirq, steal: what a hypervisor
# gave another guest); idle and iowait are not, guest time is already in user
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def cpu_busy_seconds(cpus: Iterable[int] | None = None, stat_path: str = "/proc/stat") -> float | None:
    """Seconds every process together has kept ``cpus`` (default: the ones this process may run on) busy since
    boot (Linux /proc/stat); None where that file is unreadable. Two readings around a measurement minus this
    process's own CPU seconds tell how much of the CPUs other processes took."""
    wanted = set(cpu_affinity() if cpus is None else cpus)
    try:
        lines = Path(stat_path).read_text().splitlines()
        ticks = sum(
            sum(int(fields[1 + c]) for c in _BUSY_COLUMNS)
            for fields in (line.split() for line in lines)
            if fields and fields[0].startswith("cpu") and fields[0][3:].isdigit() and int(fields[0][3:]) in wanted
        )
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no os.sysconf (Windows)
        return None


class OthersBusy:
    """The CPUs other processes kept busy on average while a ``with`` block ran: ``cpus`` once it is left (None
    where /proc/stat is unreadable): every process's busy CPU time (``cpu_busy_seconds``) less this process's own
    (``time.process_time``), over the block's wall seconds. What tells a timing disturbed (``busy_by_others``)."""

    def __init__(self) -> None:
        self.cpus: float | None = None
        self._start: tuple[float | None, float, float] = (None, 0.0, 0.0)

    def __enter__(self) -> OthersBusy:
        self._start = (cpu_busy_seconds(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = self._start
        busy_after = cpu_busy_seconds()
        own, wall = time.process_time() - own, time.perf_counter() - wall
        self.cpus = None if busy is None or busy_after is None else max(busy_after - busy - own, 0.0) / max(wall, 1e-9)


# a timing is kept only while other processes took at most this share of the CPUs (and at most a quarter of one)
OTHERS_CPU_SHARE = 0.1


def busy_by_others(others_cpus: float | None, cpus: int) -> str:
    """Why a timing on ``cpus`` CPUs is not kept, when other processes kept ``others_cpus`` of them busy on average
    meanwhile (more than ``OTHERS_CPU_SHARE`` of them, at least 0.25); "" when it is, or when that is unknown."""
    allowed = max(0.25, OTHERS_CPU_SHARE * cpus)
    if others_cpus is not None and others_cpus > allowed:
        return f"other processes kept {others_cpus:.2f} of {cpus} CPUs busy meanwhile (at most {allowed:.2f})"
    return ""


def cpu_affinity() -> list[int]:
    """The CPUs this process may run on (its affinity mask; where there is none, every CPU)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


# the device files of the GPU drivers torch's CUDA can run on (NVIDIA; AMD ROCm; WSL's GPU paravirtualization)
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_available(device_files: tuple[str, ...] = GPU_DEVICE_FILES) -> bool:
    """``torch.cuda.is_available()``, without importing torch (1-2 s) where the answer cannot be yes: on Linux
    with none of ``device_files`` there is no GPU driver for torch to use (a CPU-only plan then imports no torch)."""
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in device_files):
        return False
    import torch

    return torch.cuda.is_available()


def cuda_total_memory() -> int | None:
    """CUDA device 0's memory in bytes; None without a CUDA device."""
    if not cuda_available():
        return None
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def processes_for(budget_bytes: float, per_process_bytes: float, max_processes: int, minimum: int = 1) -> int:
    """The one sizing rule for parallel processes and workers: as many processes of ``per_process_bytes`` each
    as ``budget_bytes`` holds at once, between ``minimum`` and ``max_processes`` (e.g. the CPU count)."""
    if per_process_bytes <= 0 or max_processes < minimum:
        raise ValueError(
            f"need positive bytes per process and max_processes >= {minimum}; got "
            f"{per_process_bytes} and {max_processes}"
        )
    return max(minimum, min(int(max_processes), int(budget_bytes // per_process_bytes)))
