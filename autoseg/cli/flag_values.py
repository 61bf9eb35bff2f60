"""Flag values: what each flag's text becomes (bytes, whole numbers in a range, durations, folds, ``--tta``, devices),
checked when it is parsed so a bad one exits with status 2 and a message naming it, before any work is done; and
``-w/--workspace``, the flag the workspace commands share."""

from __future__ import annotations

import argparse
import math
import re

from autoseg.core.errors import InputError
from autoseg.core.resources import cuda_available


def parse_bytes(text: str) -> int:
    """'8GiB', '24 GiB', '80GB', '512MiB', or a plain number of GiB -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|[KMGT])?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a memory size; use e.g. 8GiB, 24GiB, 80GB or 8")
    value, unit = float(m.group(1)), (m.group(2) or "GiB").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    base = 1000 if unit.endswith("B") and "I" not in unit else 1024
    nbytes = int(value * base ** powers[unit[0]])
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no memory at all; give a positive size, e.g. 8GiB")
    return nbytes


def parse_part(text: str) -> tuple[int, int]:
    """``--part I/N``: (I, N) with 1 <= I <= N."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a part; give I/N with 1 <= I <= N, e.g. 2/8 for the second of 8 parts"
        )
    return int(m.group(1)), int(m.group(2))


def int_at_least(low: int, high: int | None = None):
    """An argparse type: a whole number in [low, high] (high: no limit when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            limits = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range; give a whole number {limits}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (refuses nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number above 0")
    return value


SEED = int_at_least(0, 2**32 - 1)  # numpy's and torch's seeds are non-negative


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device to train or predict on: ``requested`` if this machine has it, else the default."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch"
        )
    return requested or default_device()


def tta_value(text: str) -> str:
    """``--tta``: all, none or a whole number (checked against the network's mirror variants at prediction)."""
    if text.strip().lower() in ("all", "none") or text.strip().isdigit():
        return text.strip().lower()
    raise argparse.ArgumentTypeError(f"{text!r}: use all, none or a number of mirror variants, e.g. 4")


def tile_batch_value(text: str) -> int | None:
    """``--tile-batch-size``: auto (None: chosen from the memory model) or a whole number >= 1."""
    return None if text.strip().lower() == "auto" else int_at_least(1)(text)


def workers_value(text: str) -> int | None:
    """``--preprocess-workers`` / ``--export-workers``: auto (None: sized from the host RAM) or a whole number >= 0."""
    return None if text.strip().lower() == "auto" else int_at_least(0)(text)


def duration_value(text: str) -> float:
    from autoseg.train.schedule import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fold_name(text: str) -> str:
    """An argparse type: a fold number or 'all' (the folder results/<config>/fold_<name>)."""
    if not (text.isdigit() or text == "all"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fold; give fold numbers (0 1 2) or all")
    return text


def add_workspace(p: argparse.ArgumentParser) -> None:
    p.add_argument("-w", "--workspace", default=".", help="workspace folder (default: current directory)")
