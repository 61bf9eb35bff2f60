"""Versioned JSON artifacts and crash-safe file writes.

Every artifact autoseg writes (fingerprint, plans, case properties, splits, summaries) is a frozen
dataclass serialised as JSON with a ``schema_version``. Reading an unknown version or an unknown key
fails loudly with the file's path. Every write goes to a temporary name in the same folder and is
renamed into place, so a crash never leaves a half-written file that a later run would trust.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from autoseg.core.errors import InputError

T = TypeVar("T")


class ArtifactError(InputError):
    """An artifact file is missing, malformed or of an unknown schema version."""


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts get the usual permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


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
    if origin in (typing.Union, types.UnionType):
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


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Delete the temporary files ``atomic_path`` names (``.<name>.*.tmp*``) that a killed run left in ``out_dir``;
    returns them."""
    stale = sorted(Path(out_dir).glob(".*.tmp*"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
