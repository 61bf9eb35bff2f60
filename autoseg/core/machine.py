"""Per-machine measurements kept between runs, and how torch's CPU threads are set.

``MachineCache`` keeps a figure that takes seconds to measure (the CPU's training throughput) in a folder the
CLI resolves (``$AUTOSEG_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoseg``, else ``~/.cache/autoseg``), one JSON file
per measurement, each entry keyed by what changes the answer (``machine_key``: CPU model, the CPUs this process
may run on, torch's version and OpenMP wait policy). The second run on the same machine reads the figure instead of
timing it again, so it does not depend on how busy the machine is then; the entry records when it was measured,
and the run that reads it says so. Writes are atomic; an unreadable file is
ignored with a warning and rewritten.

Threads: ``use_cpu_threads`` gives torch every CPU this process may use, with OpenMP threads that sleep while they
wait (``OMP_WAIT_POLICY=PASSIVE``, set by ``passive_openmp_waiting`` before torch is imported). With libgomp's
default spinning, threads competing with a busy process for the cores make a U-Net training step many times
slower than one thread; sleeping threads run it as fast as one thread there, so no timing probe is needed
(docs/benchmarks.md, "Training step speed on CPU").
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoseg.core.artifacts import WriteError, atomic_path, atomic_write_text
from autoseg.core.resources import cpu_count

log = logging.getLogger("autoseg")

CACHE_VERSION = 1
MAX_ENTRIES = 16  # keys kept per measurement file (e.g. several torch versions in several environments)
WAIT_POLICY = "PASSIVE"


def passive_openmp_waiting(environ: MutableMapping[str, str], modules: Mapping[str, object] = sys.modules) -> bool:
    """Ask OpenMP (libgomp, as torch's CPU wheels use) to let waiting threads sleep instead of spin, unless the
    user chose a policy. libgomp reads it when loaded, with torch: the CLI calls this first thing, and it leaves
    ``environ`` alone once torch is in ``modules`` (too late; the log would claim a policy torch never read).
    Returns whether the policy is now passive."""
    if "OMP_WAIT_POLICY" not in environ and "torch" not in modules:
        environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return environ.get("OMP_WAIT_POLICY", "").upper() == WAIT_POLICY


# oneDNN keeps every convolution primitive it made (its JIT-compiled kernel, about 0.9 MiB each here) in a cache of
# 1,024 by default: a prediction whose tiles change shape from case to case held 364 MiB after 10 shapes of a 26-conv
# network, 151 MiB with 16 kept. 128 holds a network's convolutions for several tile shapes (no slower than 1,024;
# 16 made a 16x64x64 tile 25% slower) and bounds what the cache can hold at about 115 MiB (docs/memory.md)
ONEDNN_PRIMITIVES_KEPT = 128


def bounded_onednn_primitive_cache(
    environ: MutableMapping[str, str], modules: Mapping[str, object] = sys.modules
) -> str | None:
    """Ask oneDNN to keep at most ``ONEDNN_PRIMITIVES_KEPT`` primitives, unless the user chose a capacity
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). oneDNN reads it when it first makes a primitive, after torch is loaded;
    like ``passive_openmp_waiting`` the CLI calls this first thing, and ``environ`` is left alone once torch is in
    ``modules``. Returns the capacity oneDNN will read (None: its default)."""
    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    if name not in environ and "torch" not in modules:
        environ[name] = str(ONEDNN_PRIMITIVES_KEPT)
    return environ.get(name)


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_key(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a CPU measurement depends on: architecture, CPU model, the CPUs this process may run on (count and
    affinity), torch's version and OpenMP's wait policy (from ``environ``, default this process's, as libgomp
    read it when torch was imported)."""
    environ = os.environ if environ is None else environ
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = []
    return {
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
        "cpus": cpu_count(),
        "affinity": affinity,
        "torch": torch_version(),
        "omp_wait_policy": environ.get("OMP_WAIT_POLICY", "").upper(),
    }


@dataclass(frozen=True)
class Measurement:
    """A measured figure; ``keep``: whether it may be cached (False: measured while the cores were busy, say
    ``why_not_kept``); ``details``: the timings behind it, kept beside it in the cache."""

    value: float | dict[str, float | None]
    keep: bool = True
    why_not_kept: str = ""
    details: dict[str, float] = field(default_factory=dict)


class MachineCache:
    """Measurements of this machine in ``folder`` (None: keep nothing), one ``<name>.json`` per measurement."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = None if folder is None else Path(folder)

    def path(self, name: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{name}.json"

    def measured(self, name: str, key: Mapping[str, Any], measure: Callable[[], Measurement]) -> tuple[Any, str]:
        """The figure (a number, or a dict of them) cached under ``key``, else ``measure()``'s (cached when it may
        be); returns (value, where it came from), e.g. "cached in PATH, measured 2026-11-27 09:30 UTC" or "measured
        now, cached in PATH"."""
        path = self.path(name)
        entries = self._read(path)
        key_text = json.dumps(dict(key), sort_keys=True)
        cached = entries.get(key_text)
        if cached is not None:
            when = f", measured {cached['measured_at']}" if cached.get("measured_at") else ""
            return cached["value"], f"cached in {path}{when}"
        found = measure()
        if path is None:
            return found.value, "measured now (no cache folder)"
        if not found.keep:
            return found.value, f"measured now, not cached: {found.why_not_kept}"
        return found.value, self._write(path, name, entries, key_text, found.value, found.details, MAX_ENTRIES)

    def kept(
        self, name: str, key: Mapping[str, Any], compute: Callable[[], Any], max_entries: int = MAX_ENTRIES
    ) -> tuple[Any, str]:
        """A JSON value worth keeping between runs (e.g. a simulation's result, seconds to compute) cached under
        ``key``, else ``compute()``'s, cached; returns (value, where it came from). The newest ``max_entries``
        keys are kept."""
        path = self.path(name)
        entries = self._read(path)
        key_text = json.dumps(dict(key), sort_keys=True)
        if key_text in entries:
            return entries[key_text]["value"], f"cached in {path}"
        value = compute()
        if path is None:
            return value, "computed now (no cache folder)"
        return value, self._write(path, name, entries, key_text, value, {}, max_entries)

    def kept_file(self, name: str, key: str, compute: Callable[[], bytes]) -> tuple[bytes, str]:
        """Bytes worth keeping between runs (e.g. a network's ONNX graph, seconds to make) in the file
        ``<folder>/<name>/<key>``, else ``compute()``'s, written there (atomically); returns (bytes, where they came
        from). ``key`` names what the bytes depend on (e.g. a checkpoint's sha256 digest)."""
        path = None if self.folder is None else self.folder / name / key
        if path is not None and path.is_file():
            try:
                return path.read_bytes(), f"cached in {path}"
            except OSError as e:
                log.warning("%s: cannot be read (%s); making it again", path, e)
        value = compute()
        if path is None:
            return value, "made now (no cache folder)"
        try:
            with atomic_path(path) as tmp:
                tmp.write_bytes(value)
        except (OSError, WriteError) as e:
            return value, f"made now (could not cache it in {path}: {e})"
        return value, f"made now, cached in {path}"

    @staticmethod
    def _write(
        path: Path,
        name: str,
        entries: dict[str, dict[str, Any]],
        key_text: str,
        value: Any,
        details: dict[str, float],
        max_entries: int,
    ) -> str:
        """Put ``value`` first among ``entries``, dated now, and write the file (atomically); says where the value
        came from."""
        measured_at = utc_now_text()
        entries = {
            key_text: {"value": value, "details": details, "measured_at": measured_at},
            **{k: v for k, v in entries.items() if k != key_text},
        }
        payload = {
            "schema_version": CACHE_VERSION,
            "kind": name,
            "entries": [{"key": json.loads(k), **v} for k, v in list(entries.items())[:max_entries]],
        }
        try:
            atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
        except (OSError, WriteError) as e:
            return f"measured now (could not cache it in {path}: {e})"
        return f"measured now, cached in {path}"

    @staticmethod
    def _read(path: Path | None) -> dict[str, dict[str, Any]]:
        """The file's entries by key text; {} when there is none, or (with a warning) when it is unreadable."""
        if path is None or not path.is_file():
            return {}
        try:
            payload = json.loads(path.read_text())
            if payload.get("schema_version") != CACHE_VERSION:
                raise ValueError(f"schema_version {payload.get('schema_version')!r}, expected {CACHE_VERSION}")
            entries = {  # "measured_at": absent from entries written before it was recorded
                json.dumps(e["key"], sort_keys=True): {
                    "value": e["value"],
                    "details": e["details"],
                    "measured_at": e.get("measured_at", ""),
                }
                for e in payload["entries"]
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning(
                "%s: not a readable autoseg measurement cache (%s); measuring again and rewriting it",
                path,
                f"{type(e).__name__}: {e}",
            )
            return {}
        return entries


def utc_now_text() -> str:
    """Now, as a cache entry records when it was measured: e.g. "2026-11-27 09:30 UTC"."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


_kept_simulations: Path | None = None


def keep_simulations_in(folder: Path | None) -> None:
    """Keep memory simulations (training steps, prediction tiles) between runs under ``folder`` (the CLI's cache
    folder, for the length of one command); None: keep none. ``kept_simulations`` is what the simulations ask."""
    global _kept_simulations
    _kept_simulations = None if folder is None else Path(folder)


def kept_simulations(subfolder: str = "") -> MachineCache | None:
    """The cache memory simulations are kept in (``subfolder`` of it: one file an entry), as
    ``keep_simulations_in`` set it; None when none is."""
    return None if _kept_simulations is None else MachineCache(_kept_simulations / subfolder)


@functools.lru_cache(maxsize=1)
def torch_version() -> str:
    """The installed torch's version (as ``torch.__version__`` says it), read from its package metadata: a re-plan
    whose simulations are kept keys them by it without importing torch (about 1-2 s)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # torch not installed as a distribution (e.g. a source tree)
        import torch

        return torch.__version__


def simulation_key(modules: tuple[str, ...]) -> dict[str, str]:
    """What a simulation kept between runs is keyed by besides its own arguments: a digest of the code that runs it
    (``modules``, e.g. a simulation's ``SIMULATED_MODULES``: a change to it simulates again) and torch's version.
    Neither imports torch or those modules."""
    return {"code": source_digest(tuple(modules)), "torch": torch_version()}


@functools.lru_cache(maxsize=8)
def source_digest(modules: tuple[str, ...]) -> str:
    """A digest of these modules' source files: a result cached with it as part of its key (a simulation's) is
    reused only while the code that computed it is unchanged. The files are found, not imported: checking a kept
    simulation imports none of the code (nor torch) that would run it."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no source file for module {name!r} (in a simulation's SIMULATED_MODULES)")
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def use_cpu_threads(requested: int | None, what: str, environ: Mapping[str, str] | None = None) -> int:
    """Set torch's CPU threads for ``what`` (training, prediction) to ``requested`` or every CPU this process may
    use, and log where the count came from; returns it. The same count whatever the load: with passive OpenMP
    waiting (``passive_openmp_waiting``) extra threads cost next to nothing when another process holds a core."""
    import torch

    if requested is not None:
        threads, source = requested, "as requested"
    else:
        threads, source = cpu_count(), "every CPU this process may use"
    torch.set_num_threads(threads)
    policy = (os.environ if environ is None else environ).get("OMP_WAIT_POLICY", "")  # as libgomp read it
    if threads > 1 and policy.upper() != WAIT_POLICY:
        log.warning(
            "CPU threads for %s: %d (%s); OMP_WAIT_POLICY is %r, not PASSIVE: spinning OpenMP threads run "
            "several times slower than one thread while another process keeps a core busy (docs/benchmarks.md). "
            "The autoseg command sets it; from Python, set OMP_WAIT_POLICY=PASSIVE before importing torch",
            what,
            threads,
            source,
            policy or "unset",
        )
    else:
        log.info(
            "CPU threads for %s: %d (%s; OpenMP waits %s)",
            what,
            threads,
            source,
            "passively" if policy.upper() == WAIT_POLICY else "as set",
        )
    return threads
