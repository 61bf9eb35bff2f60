"""The checkpoint file format, for the trainer that writes and resumes it and the predictor that reads it.

A checkpoint is one ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts with a ``version``
(so ``torch.load(weights_only=True)`` reads it), written under a temporary name and renamed. Reading a file
that is empty, truncated, corrupt or of another version raises ``InputError`` naming it and the fold's other
checkpoints a user could fall back to. What the dict holds is the trainer's (``autoseg.train.checkpoint``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from autoseg.core.artifacts import atomic_path
from autoseg.core.errors import InputError

CHECKPOINT_VERSION = 2


def write_checkpoint_file(path: Path, state: dict[str, Any]) -> None:
    """``state`` (with ``version`` added) to ``path``, atomically; ``WriteError`` names ``path`` on failure."""
    with atomic_path(path, suffix=".pt") as tmp:
        torch.save({"version": CHECKPOINT_VERSION, **state}, tmp)


def read_checkpoint_file(path: Path, fix: str, mmap: bool = False) -> dict[str, Any]:
    """The dict ``write_checkpoint_file`` wrote, on the CPU. ``fix``: what the caller's user can do instead
    (e.g. "predict with --checkpoint best"), said after what is wrong and which other checkpoints exist.
    ``mmap``: map the file instead of reading it, so only the tensors the caller touches are read (prediction copies
    the network's weights and never reads the optimizer state, so its load peaks lower: docs/prediction.md, "Many
    cases"). The tensors are then
    views of the file (copy-on-write): for callers that only copy them out (a file is replaced by rename, never
    rewritten in place, so the mapped pages stay valid)."""
    if path.is_file() and path.stat().st_size == 0:
        raise InputError(f"{path} is empty (0 bytes: a copy or a disk that ran out?); {_others(path)}{fix}")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except (RuntimeError, OSError):
            if not mmap:
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # e.g. a file system without mmap
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise InputError(
            f"{path} is not a readable checkpoint, probably truncated or corrupt ({reason}); {_others(path)}{fix}"
        ) from e
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise InputError(
            f"{path} was not written by this version of autoseg (checkpoint version {version!r}, "
            f"expected {CHECKPOINT_VERSION}); {fix}"
        )
    return state


def _others(path: Path) -> str:
    """Which other checkpoints of the same fold exist (the ones a user can fall back to)."""
    others = sorted(p.name for p in path.parent.glob("checkpoint_*.pt") if p.name != path.name)
    return f"this fold also has {', '.join(others)}; " if others else "this fold has no other checkpoint; "
