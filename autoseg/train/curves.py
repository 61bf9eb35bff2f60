"""What a person reads after each epoch: the log line (with the run's elapsed and predicted time), metrics.jsonl
and progress.png (losses, pseudo-Dice, learning rate, epoch time)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from autoseg.core.artifacts import append_line, atomic_path
from autoseg.core.units import format_duration

log = logging.getLogger("autoseg.train.trainer")


def run_times(
    elapsed_seconds: float, epochs_done: int, epochs: int, epoch_seconds: list[float], planned_seconds: float | None
) -> dict[str, float | None]:
    """The run's time after ``epochs_done`` of ``epochs``: elapsed, the rest predicted from the measured epochs
    (their mean), and ``planned_seconds`` (the plan's prediction for the whole run, None if it has none)."""
    left = (epochs - epochs_done) * sum(epoch_seconds) / max(len(epoch_seconds), 1)
    return {
        "elapsed_seconds": elapsed_seconds,
        "predicted_run_seconds": elapsed_seconds + left,
        "planned_run_seconds": planned_seconds,
    }


def record_epoch(row: dict, out: Path, metrics: list[dict]) -> None:
    """One readable log line, a metrics.jsonl row and a fresh progress.png. ``row``: the epoch's figures and
    ``run_times``'."""
    planned = row.get("planned_run_seconds")
    log.info(
        "epoch %d  train loss %.4f  val loss %.4f  pseudo-Dice %s  (EMA %.4f)  lr %.2e  %.1f s  data wait %.0f%%"
        "  run %s of ~%s%s",
        row["epoch"],
        row["train_loss"],
        row["val_loss"],
        [round(d, 4) for d in row["pseudo_dice"]],
        row["ema_pseudo_dice"],
        row["lr"],
        row["epoch_seconds"],
        100 * row["data_wait_fraction"],
        format_duration(row["elapsed_seconds"]),
        format_duration(row["predicted_run_seconds"]),
        f" (planned ~{format_duration(planned)})" if planned else "",
    )
    append_line(out / "metrics.jsonl", json.dumps(row))  # a resumed run rewrites it from the checkpoint
    plot_progress(metrics, out / "progress.png")


def plot_progress(metrics: list[dict], path: Path) -> None:
    """Three panels over epochs: train/val loss with pseudo-Dice (right axis), learning rate, epoch
    time with the share of it spent waiting for data. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [m["epoch"] for m in metrics]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    ax = axes[0]
    ax.plot(epochs, [m["train_loss"] for m in metrics], color="tab:blue", label="train loss")
    ax.plot(epochs, [m["val_loss"] for m in metrics], color="tab:red", label="val loss")
    ax.set_ylabel("loss")
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(
        epochs,
        [sum(m["pseudo_dice"]) / max(len(m["pseudo_dice"]), 1) for m in metrics],
        color="tab:green",
        linestyle=":",
        label="pseudo-Dice",
    )
    ax2.plot(epochs, [m["ema_pseudo_dice"] for m in metrics], color="tab:green", label="pseudo-Dice (EMA)")
    ax2.set_ylabel("pseudo-Dice")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="upper right")
    axes[1].plot(epochs, [m["lr"] for m in metrics], color="black")
    axes[1].set_ylabel("learning rate")
    axes[2].plot(epochs, [m["epoch_seconds"] for m in metrics], color="tab:purple", label="epoch time (s)")
    axes[2].plot(
        epochs,
        [m["epoch_seconds"] * m["data_wait_fraction"] for m in metrics],
        color="tab:orange",
        label="waiting for data (s)",
    )
    axes[2].set_ylabel("seconds")
    axes[2].set_xlabel("epoch")
    axes[2].legend(loc="upper right")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=80)
    plt.close(fig)
