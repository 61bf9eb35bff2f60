"""Training one fold from the plan: a plain loop (SGD Nesterov, poly LR, Dice + CE with deep supervision).

Per epoch: ``iterations_per_epoch`` optimizer steps (each ``accumulation_steps`` micro-batches),
a pseudo-Dice on validation patches, one log line, metrics.jsonl, progress.png and an atomic
checkpoint. At the end the fold's validation cases are predicted and evaluated.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from autoseg.artifacts import atomic_path
from autoseg.compute import fastest_thread_count, training_step_closure
from autoseg.loader import BatchLoader, LoaderConfig
from autoseg.loss import DeepSupervisionLoss, DiceCELoss, compute_loss, deep_supervision_weights
from autoseg.network import build_network
from autoseg.plans import ConfigurationPlan, Plans
from autoseg.progress import plot_progress
from autoseg.resources import cpu_count
from autoseg.workspace import Workspace, load_or_create_splits

log = logging.getLogger("autoseg.train")


@dataclass(frozen=True)
class RunConfig:
    """Knobs of one training run that are not part of the plan."""

    epochs: int = 1000
    iterations_per_epoch: int = 250
    val_iterations: int = 50
    initial_lr: float = 1e-2
    weight_decay: float = 3e-5
    momentum: float = 0.99
    grad_clip: float = 12.0
    seed: int = 0
    device: str = "cpu"
    loader_workers: int = 0
    validate: bool = True  # predict and evaluate the fold's validation cases at the end


def poly_lr(initial_lr: float, step: int, total_steps: int, exponent: float = 0.9) -> float:
    return initial_lr * (1 - step / max(total_steps, 1)) ** exponent


def fold_cases(workspace: Workspace, config_name: str, fold: int | str) -> tuple[list[str], list[str]]:
    """(train, val) case ids; fold "all" trains on every case and validates on all of them too."""
    folder = workspace.require(workspace.preprocessed(config_name), "plan_and_preprocess")
    case_ids = sorted(p.name[:-5] for p in folder.glob("*.json"))
    if not case_ids:
        raise FileNotFoundError(f"{folder}: no preprocessed cases; run `autoseg plan_and_preprocess` first")
    splits = load_or_create_splits(workspace, case_ids)
    if fold == "all":
        return case_ids, case_ids
    if not 0 <= int(fold) < len(splits.folds):
        raise ValueError(f"fold {fold} does not exist; {workspace.splits_path} has folds 0..{len(splits.folds) - 1}")
    split = splits.folds[int(fold)]
    return list(split.train), list(split.val)


def pseudo_dice_counts(logits: torch.Tensor, target: torch.Tensor, num_classes: int) -> np.ndarray:
    """(3, K-1) true positive, false positive, false negative voxel counts per foreground class."""
    pred = logits.argmax(1)
    tgt = target[:, 0]
    counts = np.zeros((3, num_classes - 1))
    for k in range(1, num_classes):
        p, t = pred == k, tgt == k
        counts[:, k - 1] = [(p & t).sum().item(), (p & ~t).sum().item(), (~p & t).sum().item()]  # syncs
    return counts


def save_checkpoint(path: Path, network, optimizer, epoch: int, metrics: list[dict], best_ema: float,
                    config_name: str) -> None:
    state = {"network": network.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
             "best_ema_dice": best_ema, "config": config_name, "metrics_json": json.dumps(metrics),
             "torch_rng": torch.get_rng_state()}
    with atomic_path(path, suffix=".pt") as tmp:
        torch.save(state, tmp)


def _loader(folder: Path, cases: list[str], config: ConfigurationPlan, run: RunConfig, seed: int,
            augment: bool) -> BatchLoader:
    cfg = LoaderConfig(patch_size=tuple(config.patch_size), batch_size=config.batch_size, augment=augment)
    return BatchLoader(folder, cases, cfg, seed=seed, num_workers=run.loader_workers if augment else 0)


def train(workspace: Workspace, config_name: str, fold: int | str, run: RunConfig, progress: bool = True) -> Path:
    """Train one fold; returns the fold's results folder."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    config = plans.configuration(config_name)
    train_ids, val_ids = fold_cases(workspace, config_name, fold)
    out = workspace.results(config_name, fold)
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    threads = torch.get_num_threads()
    try:
        return _train(workspace, plans, config, config_name, fold, train_ids, val_ids, out, run, progress)
    finally:
        torch.set_num_threads(threads)
        log.removeHandler(handler)
        handler.close()


@dataclass
class _Step:
    """What one optimizer step needs (built once per run)."""

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: torch.nn.Module
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype on CUDA, None for fp32
    accumulation_steps: int
    grad_clip: float

    def __call__(self, loader: BatchLoader) -> tuple[float, float]:
        """One optimizer step over ``accumulation_steps`` micro-batches; returns (loss, seconds waiting for data)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss, wait = 0.0, 0.0
        for _ in range(self.accumulation_steps):
            tw = time.perf_counter()
            batch = next(loader)
            wait += time.perf_counter() - tw
            x = batch["data"].to(self.device, non_blocking=True)
            y = batch["target"].to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                enabled=self.amp_dtype is not None):
                loss = compute_loss(self.network(x), y, self.loss_fn) / self.accumulation_steps
            self.scaler.scale(loss).backward()
            step_loss += loss.item()  # syncs with the device
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return step_loss, wait


def _make_step(config: ConfigurationPlan, run: RunConfig) -> _Step:
    device = torch.device(run.device)
    network = build_network(config.network, checkpointing=config.checkpointing).to(device)
    amp = device.type == "cuda" and config.precision in ("fp16", "bf16")
    amp_dtype = (torch.float16 if config.precision == "fp16" else torch.bfloat16) if amp else None
    return _Step(
        network=network,
        optimizer=torch.optim.SGD(network.parameters(), lr=run.initial_lr, momentum=run.momentum, nesterov=True,
                                  weight_decay=run.weight_decay),
        scaler=torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16),
        loss_fn=DeepSupervisionLoss(DiceCELoss(), deep_supervision_weights(config.network.num_stages - 1)),
        device=device, amp_dtype=amp_dtype, accumulation_steps=config.accumulation_steps, grad_clip=run.grad_clip,
    )


def _train(workspace: Workspace, plans: Plans, config: ConfigurationPlan, config_name: str, fold: int | str,
           train_ids: list[str], val_ids: list[str], out: Path, run: RunConfig, progress: bool) -> Path:
    if run.device == "cpu":
        _choose_cpu_threads(config)
    torch.manual_seed(run.seed)
    step = _make_step(config, run)
    folder = workspace.preprocessed(config_name)
    train_loader = _loader(folder, train_ids, config, run, seed=run.seed, augment=True)
    val_loader = _loader(folder, val_ids, config, run, seed=run.seed + 1, augment=False)
    total_steps = run.epochs * run.iterations_per_epoch
    metrics: list[dict] = []
    (out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run
    ema, best_ema = None, -1.0
    log.info("training %s fold %s: %d train / %d val cases, patch %s, batch %d x %d accumulation, %d epochs x %d it",
             config_name, fold, len(train_ids), len(val_ids), config.patch_size, config.batch_size,
             config.accumulation_steps, run.epochs, run.iterations_per_epoch)
    try:
        for epoch in range(run.epochs):
            t0, wait, losses = time.perf_counter(), 0.0, []
            step.network.train()
            bar = tqdm(range(run.iterations_per_epoch), desc=f"epoch {epoch}", unit="it", disable=not progress,
                       leave=False)
            for it in bar:
                lr = poly_lr(run.initial_lr, epoch * run.iterations_per_epoch + it, total_steps)
                for group in step.optimizer.param_groups:
                    group["lr"] = lr
                loss, waited = step(train_loader)
                losses.append(loss)
                wait += waited
                bar.set_postfix(loss=f"{loss:.3f}")
            val_loss, dice = _validate(step.network, val_loader, step.loss_fn, run, step.device, plans.num_classes)
            mean_dice = float(np.nanmean(dice)) if len(dice) else 0.0
            ema = mean_dice if ema is None else 0.9 * ema + 0.1 * mean_dice
            epoch_s = time.perf_counter() - t0
            row = {"epoch": epoch, "train_loss": float(np.mean(losses)), "val_loss": val_loss,
                   "pseudo_dice": [float(d) for d in dice], "ema_pseudo_dice": ema, "lr": lr,
                   "epoch_seconds": epoch_s, "data_wait_fraction": wait / max(epoch_s, 1e-9)}
            metrics.append(row)
            _log_epoch(row, out, metrics)
            if ema > best_ema:
                best_ema = ema
                save_checkpoint(out / "checkpoint_best.pt", step.network, step.optimizer, epoch, metrics, best_ema,
                                config_name)
            save_checkpoint(out / "checkpoint_latest.pt", step.network, step.optimizer, epoch, metrics, best_ema,
                            config_name)
    finally:
        train_loader.close()
        val_loader.close()
    save_checkpoint(out / "checkpoint_final.pt", step.network, step.optimizer, run.epochs - 1, metrics, best_ema,
                    config_name)
    (out / "run.json").write_text(json.dumps({"run": asdict(run), "fold": str(fold), "config": config_name}, indent=2))
    if run.validate:
        from autoseg.validation import validate_fold

        validate_fold(workspace, plans, config_name, step.network, val_ids, out / "validation", run.device, progress)
    return out


def _choose_cpu_threads(config: ConfigurationPlan) -> None:
    """Use all CPUs for training unless one thread measures faster (cores busy with another process)."""
    step = training_step_closure(config.network, tuple(config.patch_size), config.batch_size)
    threads, timings = fastest_thread_count(step, max_threads=cpu_count())
    torch.set_num_threads(threads)
    log.info("CPU threads: %d (a training step measured %s)", threads,
             ", ".join(f"{t:.2f} s with {n}" for n, t in timings.items()))


def _log_epoch(row: dict, out: Path, metrics: list[dict]) -> None:
    """One readable log line, a metrics.jsonl row and a fresh progress.png."""
    log.info("epoch %d  train loss %.4f  val loss %.4f  pseudo-Dice %s  (EMA %.4f)  lr %.2e  %.1f s  "
             "data wait %.0f%%", row["epoch"], row["train_loss"], row["val_loss"],
             [round(d, 4) for d in row["pseudo_dice"]], row["ema_pseudo_dice"], row["lr"], row["epoch_seconds"],
             100 * row["data_wait_fraction"])
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    plot_progress(metrics, out / "progress.png")


@torch.no_grad()
def _validate(network, loader: BatchLoader, loss_fn, run: RunConfig, device,
              num_classes: int) -> tuple[float, np.ndarray]:
    """Mean loss and pseudo-Dice per foreground class over ``val_iterations`` un-augmented patches."""
    network.eval()
    counts = np.zeros((3, num_classes - 1))
    losses = []
    for _ in range(run.val_iterations):
        batch = next(loader)
        x, y = batch["data"].to(device), batch["target"].to(device)
        out = network(x)
        losses.append(compute_loss(out, y, loss_fn).item())
        counts += pseudo_dice_counts(out[0] if isinstance(out, list) else out, y, num_classes)
    tp, fp, fn = counts
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = 2 * tp / (2 * tp + fp + fn)
    return float(np.mean(losses)), dice
