"""What the machine offers: available host RAM (cgroup limits included), CUDA memory, CPU count."""

from __future__ import annotations

import os
from pathlib import Path


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_limit_bytes() -> int | None:
    """The cgroup (v2 or v1) memory limit minus current usage, or None when unlimited/unknown."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
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
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def meminfo_available_bytes() -> int | None:
    return proc_field_bytes("/proc/meminfo", "MemAvailable")


def available_ram_bytes() -> int:
    """Host RAM this process may still use: the smaller of MemAvailable and the cgroup headroom."""
    candidates = [v for v in (meminfo_available_bytes(), cgroup_memory_limit_bytes()) if v is not None]
    if not candidates:
        return 8 * 1024**3
    return min(candidates)


def cpu_count() -> int:
    """CPUs this process may run on (affinity mask), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:
        return max(os.cpu_count() or 1, 1)


def cuda_total_memory() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)
