"""The bf16 agreement check as an artifact and the verdict ``--precision auto`` asks of it, on hand-made checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest

from autoseg.core.errors import InputError
from autoseg.predict.precision_check import (
    BF16_DICE_TOLERANCE,
    CheckedCheckpoint,
    PrecisionCheck,
    bf16_verdict,
    checkpoint_bf16_verdict,
)

SHA = "ab" * 32
IDENTITY = CheckedCheckpoint("3d_fullres", 0, "final", SHA, ("a", "b", "c"), ("organ", "lesion"), "4")


def _check(organ: float, lesion: float, runtime: str = "torch") -> PrecisionCheck:
    return PrecisionCheck.of(IDENTITY, {"organ": 0.9, "lesion": 0.8}, {runtime: {"organ": organ, "lesion": lesion}})


def test_a_check_within_the_tolerance_allows_bf16_and_says_by_how_much() -> None:
    check = _check(0.9015, 0.7990)
    assert check.passed == {"torch": True}
    allowed, reason = bf16_verdict(check, "torch", SHA)
    assert allowed
    assert "0.0015, organ" in reason and "fold 0 of 3d_fullres" in reason


def test_one_class_0_003_off_refuses_bf16_naming_the_class_and_the_difference() -> None:
    check = _check(0.9005, 0.8030)
    assert check.passed == {"torch": False}
    allowed, reason = bf16_verdict(check, "torch", SHA)
    assert not allowed
    assert "lesion" in reason and "0.0030" in reason and f"more than {BF16_DICE_TOLERANCE}" in reason
    assert "organ" not in reason


def test_no_check_a_stale_check_or_an_unchecked_runtime_refuses_bf16_saying_why() -> None:
    allowed, reason = bf16_verdict(None, "torch", SHA)
    assert not allowed and "carries no bf16 agreement check" in reason
    allowed, reason = bf16_verdict(_check(0.9, 0.8), "torch", "cd" * 32)  # the fold was trained again
    assert not allowed and "another checkpoint" in reason and SHA[:12] in reason
    allowed, reason = bf16_verdict(_check(0.9, 0.8), "openvino", SHA)
    assert not allowed and "ran bf16 with torch, not openvino" in reason


def test_a_class_defined_in_one_precision_only_fails_and_undefined_in_both_agrees() -> None:
    check = PrecisionCheck.of(IDENTITY, {"organ": 0.9, "lesion": math.nan}, {"torch": {"organ": 0.9, "lesion": 0.0}})
    assert check.fp32_dice["lesion"] is None
    allowed, reason = bf16_verdict(check, "torch", SHA)
    assert not allowed and "lesion" in reason and "undefined" in reason
    both = PrecisionCheck.of(
        IDENTITY, {"organ": 0.9, "lesion": math.nan}, {"torch": {"organ": 0.9, "lesion": math.nan}}
    )
    assert bf16_verdict(both, "torch", SHA)[0]


def test_the_check_round_trips_through_json_and_an_unknown_schema_fails_naming_the_file(tmp_path: Path) -> None:
    check = PrecisionCheck.of(IDENTITY, {"organ": 0.9, "lesion": math.nan}, {"torch": {"organ": 0.9, "lesion": 0.8}})
    path = tmp_path / "precision_check.json"
    check.to_json(path)
    assert json.loads(path.read_text())["fp32_dice"]["lesion"] is None  # standard JSON: no NaN
    assert PrecisionCheck.from_json(path) == check
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 99}))
    with pytest.raises(InputError, match=f"{path}.*schema_version 99"):
        PrecisionCheck.from_json(path)


def test_the_verdict_of_a_checkpoint_reads_the_check_beside_it_and_its_sum(tmp_path: Path) -> None:
    checkpoint = tmp_path / "fold_0" / "checkpoint_final.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    allowed, reason = checkpoint_bf16_verdict(checkpoint, "torch")
    assert not allowed and "carries no bf16 agreement check" in reason
    identity = dataclasses.replace(IDENTITY, sha256=hashlib.sha256(b"weights").hexdigest())
    PrecisionCheck.of(identity, {"organ": 0.9, "lesion": 0.8}, {"torch": {"organ": 0.9, "lesion": 0.8}}).to_json(
        checkpoint.parent / "precision_check.json"
    )
    assert checkpoint_bf16_verdict(checkpoint, "torch")[0]
    checkpoint.write_bytes(b"weights trained again")
    allowed, reason = checkpoint_bf16_verdict(checkpoint, "torch")
    assert not allowed and "another checkpoint" in reason
