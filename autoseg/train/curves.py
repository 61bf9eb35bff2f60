"""progress.png: the training curve a person looks at (losses, pseudo-Dice, learning rate, epoch time)."""

from __future__ import annotations

from pathlib import Path

from autoseg.core.artifacts import atomic_path


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
    ax2.plot(epochs, [sum(m["pseudo_dice"]) / max(len(m["pseudo_dice"]), 1) for m in metrics], color="tab:green",
             linestyle=":", label="pseudo-Dice")
    ax2.plot(epochs, [m["ema_pseudo_dice"] for m in metrics], color="tab:green", label="pseudo-Dice (EMA)")
    ax2.set_ylabel("pseudo-Dice")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="upper right")
    axes[1].plot(epochs, [m["lr"] for m in metrics], color="black")
    axes[1].set_ylabel("learning rate")
    axes[2].plot(epochs, [m["epoch_seconds"] for m in metrics], color="tab:purple", label="epoch time (s)")
    axes[2].plot(epochs, [m["epoch_seconds"] * m["data_wait_fraction"] for m in metrics], color="tab:orange",
                 label="waiting for data (s)")
    axes[2].set_ylabel("seconds")
    axes[2].set_xlabel("epoch")
    axes[2].legend(loc="upper right")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=80)
    plt.close(fig)
