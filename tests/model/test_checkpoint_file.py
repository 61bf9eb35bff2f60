"""The checkpoint file: a round trip, and an empty, truncated or foreign file refused by name with the fold's
other checkpoints listed (train's resume and predict both read through it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoseg.core.errors import InputError
from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file


def _fold(tmp_path: Path) -> Path:
    for which in ("latest", "best"):
        write_checkpoint_file(tmp_path / f"checkpoint_{which}.pt", {"network": {"w": torch.arange(3.0)}, "epoch": 4})
    return tmp_path / "checkpoint_latest.pt"


def test_round_trip(tmp_path: Path) -> None:
    state = read_checkpoint_file(_fold(tmp_path), "fix")
    assert state["epoch"] == 4 and torch.equal(state["network"]["w"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_latest.pt"]


@pytest.mark.parametrize("damage, found", [
    (lambda b: b"", "is empty"),
    (lambda b: b[: len(b) // 2], "truncated or corrupt"),
    (lambda b: b"not a checkpoint" * 10, "truncated or corrupt"),
])
def test_a_damaged_checkpoint_is_refused_naming_it_and_the_others(tmp_path: Path, damage, found: str) -> None:
    path = _fold(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=found) as info:
        read_checkpoint_file(path, "DO THIS")
    message = str(info.value)
    assert str(path) in message and "also has checkpoint_best.pt" in message and message.endswith("DO THIS")


def test_a_checkpoint_of_another_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_final.pt"
    torch.save({"version": 1, "network": {}}, path)
    with pytest.raises(InputError, match="checkpoint version 1, expected 2"):
        read_checkpoint_file(path, "train again")
