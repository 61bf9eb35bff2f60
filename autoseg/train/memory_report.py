"""The memory check's result and how it reads: ``MemoryRow`` (one measured figure against its prediction),
``MemoryCheck`` (the rows of one configuration, with its verdict), the run's log line (``log_check``) and
``autoseg check-memory``'s table (``MemoryCheck.table``). What is measured and how: ``memory_probes``; the
comparison and the steps: ``memory_check``.

A row is off when it misses its prediction by more than ``TOLERANCE`` of it; the CPU peak RSS row carries
``RSS_SLACK_BYTES`` besides: the same steps' peak RSS spreads by about that much from one fresh process to the
next (glibc's heap layout), so on a small step a gap under it is the heap's layout, not the model's error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from autoseg.core.units import MiB, format_bytes

__all__ = ["RSS_SLACK_BYTES", "TOLERANCE", "MemoryCheck", "MemoryRow", "log_check"]

TOLERANCE = 0.10  # a row is off when |measured - predicted| > TOLERANCE x predicted
RSS_SLACK_BYTES = 64 * MiB  # the CPU peak RSS row also by more than this: its spread between fresh processes

log = logging.getLogger("autoseg.train.trainer")


@dataclass(frozen=True)
class MemoryRow:
    """One comparison: ``measured`` bytes (``source``: how) against ``predicted`` bytes (``model``: which terms)."""

    name: str
    measured_bytes: int
    predicted_bytes: int
    source: str
    model: str
    checked: bool = True
    slack_bytes: int = 0  # a gap of at most this many bytes is not off, whatever its share

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_bytes - self.predicted_bytes) / max(self.predicted_bytes, 1)

    def off(self, tolerance: float = TOLERANCE) -> bool:
        return (
            self.checked
            and abs(self.error) > tolerance
            and abs(self.measured_bytes - self.predicted_bytes) > self.slack_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured_bytes": self.measured_bytes,
            "predicted_bytes": self.predicted_bytes,
            "error": self.error,
            "checked": self.checked,
            "slack_bytes": self.slack_bytes,
            "source": self.source,
            "model": self.model,
        }


@dataclass(frozen=True)
class MemoryCheck:
    """The result of a check: the configuration that ran, how many steps, one ``MemoryRow`` per comparison."""

    device: str
    configuration: dict[str, Any]  # batch_size, accumulation_steps, patch_size, precision, checkpointing, optimizer
    steps: int
    rows: tuple[MemoryRow, ...]
    tolerance: float = TOLERANCE
    notes: tuple[str, ...] = ()

    @property
    def off_rows(self) -> list[MemoryRow]:
        return [r for r in self.rows if r.off(self.tolerance)]

    @property
    def ok(self) -> bool:
        return not self.off_rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "configuration": self.configuration,
            "steps": self.steps,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """One line: the configuration, each checked row as measured / predicted (error), the verdict."""
        c = self.configuration
        rows = ", ".join(
            f"{r.name} {format_bytes(r.measured_bytes)} / {format_bytes(r.predicted_bytes)} ({r.error:+.1%})"
            for r in self.rows
            if r.checked
        )
        verdict = (
            f"within {self.tolerance:.0%}"
            if self.ok
            else f"OFF by more than {self.tolerance:.0%}: {', '.join(r.name for r in self.off_rows)}"
        )
        return (
            f"memory check on {self.device} ({self.steps} steps, batch {c['batch_size']} x "
            f"{c['accumulation_steps']}, patch {'x'.join(map(str, c['patch_size']))}, {c['precision']}"
            f"{', checkpointing' if c['checkpointing'] else ''}): measured / predicted {rows}; {verdict}"
        )

    def warning(self) -> str | None:
        """What is off and what to do, or None when every checked row is within the tolerance."""
        if self.ok:
            return None
        what = "; ".join(
            f"{r.name}: measured {format_bytes(r.measured_bytes)}, predicted "
            f"{format_bytes(r.predicted_bytes)} ({r.error:+.1%}; {r.model})"
            for r in self.off_rows
        )
        return (
            f"the memory model is off by more than {self.tolerance:.0%} on this {self.device}: {what}. Plans for "
            "this machine may over- or under-fill it; please report this line (with `autoseg check-memory "
            "--json`'s output) so the device terms in autoseg/memory/device.py can be calibrated"
        )

    def table(self) -> str:
        """The comparison table of ``autoseg check-memory``."""
        header = [
            "term",
            "measured",
            "predicted",
            "error",
            f"within {self.tolerance:.0%}",
            "measured by / predicted as",
        ]
        body = [
            [
                r.name,
                format_bytes(r.measured_bytes),
                format_bytes(r.predicted_bytes),
                f"{r.error:+.2%}",
                (
                    "NO"
                    if r.off(self.tolerance)
                    else "yes"
                    if abs(r.error) <= self.tolerance
                    else f"yes (by < {format_bytes(r.slack_bytes)})"
                )
                if r.checked
                else "(not checked)",
                f"{r.source} / {r.model}",
            ]
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.rjust(w) if 0 < i < 5 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
            for row in [header, *body]
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join([self.describe(), *lines, *(f"note: {n}" for n in self.notes)])


def log_check(check: MemoryCheck, logger: logging.Logger = log) -> None:
    """The run's log line; a warning when a row is off."""
    warning = check.warning()
    logger.info("%s", check.describe())
    if warning is not None:
        logger.warning("%s", warning)
