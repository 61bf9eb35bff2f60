"""Versioned JSON artifacts and crash-safe file writes.

Every artifact autoseg writes (fingerprint, plans, case properties, splits, summaries) is a frozen
dataclass serialised as JSON with a ``schema_version``. Reading an unknown version or an unknown key
fails loudly with the file's path. Every write goes to a temporary name in the same folder and is
renamed into place, so a crash never leaves a half-written file that a later run would trust. A write that
fails (disk full, file-size limit, read-only folder) raises ``WriteError`` naming the file, keeps its previous
version and leaves no temporary file; one that a library reports as done but left short (SimpleITK's NIfTI
writer only prints "wrote only N of M bytes") is caught before the rename (``_check_complete``).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import logging
import os
import shutil
import sys
import tempfile
import types
import typing
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from autoseg.core.errors import InputError, RunError

T = TypeVar("T")


class ArtifactError(InputError):
    """An artifact file is missing, malformed or of an unknown schema version."""


class WriteError(RunError):
    """A file could not be written (disk full, file-size limit, read-only or missing folder); its previous
    version, if any, is unchanged. ``path``: the file autoseg meant to write."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(
            f"{path}: could not write it ({reason}); its previous version, if any, is kept and nothing "
            "half-written is left. Free disk space, fix the folder's permissions or choose another "
            "folder, then rerun"
        )
        self.path, self.reason = Path(path), reason

    def __reduce__(self) -> tuple:  # raised in a worker process, re-raised in the parent
        return (type(self), (self.path, self.reason))


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}, errno {error.errno}"
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds and the
    file is complete. The block must only write: an ``OSError`` (or a library's ``RuntimeError``, as
    torch.save and SimpleITK raise for a failed write) inside it becomes ``WriteError`` naming ``path``."""
    path = Path(path)
    tmp_path: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + suffix, dir=path.parent)
        tmp_path = Path(tmp)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts get the usual permissions
        yield tmp_path
        _check_complete(tmp_path)
        os.replace(tmp_path, path)
    except WriteError:
        raise
    except (OSError, RuntimeError) as e:
        raise WriteError(path, _reason(e) + _diagnosis(tmp_path)) from e
    finally:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


def _diagnosis(tmp: Path | None) -> str:
    """Why a write failed when its writer did not say (numpy: "10000 requested and 496 written")."""
    try:
        if tmp is not None and tmp.exists():
            _check_complete(tmp)
    except OSError as e:
        return f": {e.strerror}"
    return ""


def _check_complete(tmp: Path) -> None:
    """Raise ``OSError`` if ``tmp`` was left short by a writer that did not say so: a gzip stream that ends
    early, a file as large as the file-size limit allows, or a file system with no block left."""
    if sys.platform != "win32":
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and tmp.stat().st_size >= limit:
            raise OSError(27, f"the file reached the file-size limit of {limit} bytes (ulimit -f)")
        fs = os.statvfs(tmp.parent)
        if (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) == 0:
            raise OSError(28, "no space left on device (the file system filled up while writing it)")
    if tmp.name.endswith(".gz"):
        try:
            with gzip.open(tmp, "rb") as f:
                while f.read(1 << 20):  # the CRC and length in the trailer are checked at the end
                    pass
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise OSError(5, f"the written gzip stream is incomplete ({e})") from e


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as a .npy file (memory-mappable later) under a temporary name, then rename."""
    with atomic_path(path, suffix=".npy") as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); delete it and rerun the stage that writes it") from e


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def to_dict(obj: Any) -> Any:
    """Dataclasses, tuples and numpy scalars to plain JSON-able values (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from ``data``; unknown or missing keys raise with ``where`` named."""
    return _convert(cls, data, where)


def _convert(tp: Any, value: Any, where: str) -> Any:
    if isinstance(tp, str):
        raise TypeError(f"unresolved annotation {tp!r}")
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, where)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ArtifactError(f"{where}: expected a list, found {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ArtifactError(f"{where}: expected {len(args)} values, found {len(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_convert(arg, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        karg, varg = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ArtifactError(f"{where}: expected an object, found {value!r}")
        return {_convert(karg, k, where): _convert(varg, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArtifactError(f"{where}: expected a number, found {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArtifactError(f"{where}: expected an integer, found {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ArtifactError(f"{where}: expected {tp.__name__}, found {value!r}")
        return value
    return value


def _convert_dataclass(tp: Any, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ArtifactError(f"{where}: expected an object for {tp.__name__}, found {type(value).__name__}")
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = set(value) - set(fields)
    if unknown:
        raise ArtifactError(f"{where}: unknown key(s) {sorted(unknown)} for {tp.__name__}")
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ArtifactError(f"{where}: missing key {name!r} for {tp.__name__}")
    return tp(**kwargs)


def _convert_union(tp: Any, value: Any, where: str) -> Any:
    """The first of the union's types that ``value`` converts to (None where the union allows it)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, where)
        except (ArtifactError, TypeError, ValueError):
            continue
    raise ArtifactError(f"{where}: value {value!r} does not match {tp}")


class Artifact:
    """Mixin for frozen dataclasses stored as JSON with a ``schema_version``.

    Subclasses set ``SCHEMA_VERSION`` (class attribute) and ``KIND`` (a short name used in errors), and may
    read older versions through ``UPGRADES``.
    """

    SCHEMA_VERSION: typing.ClassVar[int] = 1
    KIND: typing.ClassVar[str] = "artifact"
    # older schema version -> a function turning such a payload into the current one (read only; written anew)
    UPGRADES: typing.ClassVar[dict[int, typing.Callable[[dict], dict]]] = {}

    def to_json(self, path: str | os.PathLike) -> None:
        payload = {"schema_version": self.SCHEMA_VERSION, **to_dict(self)}
        write_json(path, payload)

    @classmethod
    def from_json(cls: type[T], path: str | os.PathLike) -> T:
        data = read_json(path)
        return cls.from_payload(data, str(path))  # type: ignore[attr-defined]

    @classmethod
    def from_payload(cls: type[T], data: Any, where: str) -> T:
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: expected a JSON object")
        version = data.get("schema_version")
        if version != cls.SCHEMA_VERSION and version in cls.UPGRADES:  # type: ignore[attr-defined]
            data = cls.UPGRADES[version](dict(data))  # type: ignore[attr-defined]
            version = data["schema_version"] = cls.SCHEMA_VERSION  # type: ignore[attr-defined]
        if version != cls.SCHEMA_VERSION:  # type: ignore[attr-defined]
            raise ArtifactError(
                f"{where}: {cls.KIND} schema_version {version!r} is not the supported "  # type: ignore[attr-defined]
                f"{cls.SCHEMA_VERSION}; rerun the stage that writes it with this autoseg version"  # type: ignore[attr-defined]
            )
        body = {k: v for k, v in data.items() if k != "schema_version"}
        return from_dict(cls, body, where)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (a newline is added) to a log-like file; if the write fails the file is cut back to
    its previous length (no half line for a later reader) and ``WriteError`` names it."""
    path = Path(path)
    data = (line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise WriteError(path, _reason(e)) from e
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError as e:
        os.ftruncate(fd, start)
        raise WriteError(path, _reason(e)) from e
    finally:
        os.close(fd)


def check_writable_folder(folder: str | os.PathLike, what: str) -> Path:
    """Create ``folder`` if needed and prove a file can be created in it, before any work is done.
    ``what``: the flag or role named in the error (e.g. "-o/--output")."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{what} {folder} is a file, not a folder; give a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".autoseg-write-check.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise WriteError(folder, _reason(e)) from e
    return folder


class LogFile(logging.FileHandler):
    """A log file whose failed write stops the run with ``WriteError`` naming it (``logging`` would print a
    traceback on stderr and carry on)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self.failed = True
            raise WriteError(self.baseFilename, _reason(error)) from error
        super().handleError(record)

    def close(self) -> None:
        """Close; the lines still buffered failing to reach the file is a ``WriteError`` too, unless one was
        already raised (the failure is being reported)."""
        try:
            super().close()
        except OSError as e:
            if not self.failed:
                raise WriteError(self.baseFilename, _reason(e)) from e


def remove_stale_temporaries(out_dir: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Delete the temporary files ``atomic_path`` names (``.<name>.*.tmp*``) that a killed run left in ``out_dir``
    (not below it); only those of ``names`` when given (a user's folder may hold other dot files). Returns them."""
    patterns = [".*.tmp*"] if names is None else [f".{glob.escape(name)}.*.tmp*" for name in names]
    stale = sorted({p for pattern in patterns for p in Path(out_dir).glob(pattern)})
    for p in stale:
        if p.is_dir():  # a MetaImage pair's temporary folder (autoseg.dataset.imageio)
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale
