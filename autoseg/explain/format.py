"""Text rendering of an ``autoseg.explain.explanation.Explanation``: aligned tables in MiB/GiB and sentences derived
from the numbers (nothing here is hard-coded about a particular network)."""

from __future__ import annotations

import math

from autoseg.core.units import format_bytes
from autoseg.explain.explanation import Explanation
from autoseg.memory.device import CUDA_FRAGMENTATION, DEVICE_TERMS
from autoseg.plan.throughput import StepRates

TERM_NAMES = {
    "parameters": "parameters",
    "gradients": "gradients (computed so far)",
    "optimizer_state": "optimizer state",
    "batch": "input batch",
    "saved_activations": "activations saved by the stages",
    "transient_activations": "transient (loss, backward temporaries)",
    "allocator_rounding": "allocator rounding (512 B blocks)",
    "fragmentation": "allocator fragmentation / cache",
    "conv_workspace": "convolution workspace",
    "cuda_context": "CUDA context",
    "runtime": "process runtime",
    "tile_prediction": "one tile batch (network, mirrors)",
    "padded_input": "padded input (C x volume)",
    "accumulator": "logit accumulator (K x z-window)",
    "weight_map": "weight map (z-window)",
    "gaussian": "Gaussian (patch)",
    "softmax_temp": "softmax of finished slices (z-window)",
    "output": "probabilities (K x volume, fp16)",
}
CPU_TERM_NAMES = {**TERM_NAMES, "fragmentation": "glibc's heap (freed blocks it keeps)"}
FIXED_TERMS = ("parameters", "gradients", "optimizer_state")


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape) if shape else "-"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return (
            indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        )

    return [line(header), indent + "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, rows)]


def _network_line(e: Explanation) -> list[str]:
    """E.g. "network: residual_encoder_unet, 6 stages of 32-64-128-256-320-320 features; encoder: stem + 1-3-4-6-6-6
    residual blocks per stage; decoder: 1 conv block(s) per stage; 102.35 M parameters"."""
    n = e.network
    if n is None:
        return []
    stem = "stem + " if n.encoder_block == "residual" else ""
    return [
        f"network: {n.architecture}, {len(n.features_per_stage)} stages of "
        f"{'-'.join(map(str, n.features_per_stage))} features; encoder: {stem}"
        f"{'-'.join(map(str, n.encoder_blocks_per_stage))} {n.encoder_block} blocks per stage; decoder: "
        f"{n.decoder_convs_per_stage} conv block(s) per stage; {n.parameters / 1e6:.2f} M parameters"
    ]


def _terms_table(terms: dict[str, int], total: int, device: str) -> list[str]:
    names = CPU_TERM_NAMES if device == "cpu" else TERM_NAMES
    rows = [[names.get(k, k), format_bytes(v), _pct(v, total)] for k, v in terms.items()]
    return _table(["term", "size", "share"], [*rows, ["total", format_bytes(total), "100.0%"]])


def _headline(e: Explanation) -> list[str]:
    amp = "" if e.precision == e.planned_precision else f" (planned {e.planned_precision}; AMP runs on CUDA only)"
    verdict = (
        f"headroom {format_bytes(e.headroom_bytes)} ({_pct(e.headroom_bytes, e.budget_bytes)})"
        if e.headroom_bytes >= 0
        else f"OVER BUDGET by {format_bytes(-e.headroom_bytes)}"
    )
    return [
        f"autoseg explain: configuration {e.config_name!r} on {e.device}",
        f"plan: patch {_shape(e.patch_size)}, batch {e.batch_size} x {e.accumulation_steps} accumulation "
        f"step(s), precision {e.precision}{amp}, checkpointing {'on' if e.checkpointing else 'off'}",
        *_time_line(e),
        *_network_line(e),
        "",
        f"TRAINING STEP: predicted peak {format_bytes(e.training_total_bytes)} of "
        f"{format_bytes(e.budget_bytes)} {e.budget_name}, {verdict}; "
        f"the peak falls in the {e.peak_phase}.",
    ]


def _time_line(e: Explanation) -> list[str]:
    """The plan's seconds per iteration and, on CPU, the measured throughput they come from."""
    if e.predicted_seconds_per_iteration is None:
        return []
    source = (
        ""
        if e.cpu_flops_per_second is None
        else " at the CPU throughput the plan was made for, "
        + StepRates(e.cpu_flops_per_second, e.cpu_elements_per_second, e.cpu_mapped_bytes_per_second).describe()
        + (f" ({e.cpu_rates_source})" if e.cpu_rates_source else "")
    )
    lines = [f"time: predicted {e.predicted_seconds_per_iteration:.2f} s per iteration{source}"]
    if e.iteration is not None:
        why = f" ({e.iteration.reason})" if e.iteration.reason else ""
        lines.append(f"time target: {e.iteration.seconds:.2f} s per iteration{why}")
    return lines


def _stage_table(e: Explanation) -> list[str]:
    saved = sum(s.activation_bytes for s in e.stages)
    rows = [
        [
            s.name,
            str(s.features) if s.features else "-",
            _shape(s.shape),
            format_bytes(s.activation_bytes),
            f"{s.map_copies:.1f}" if s.features else "-",
            _pct(s.activation_bytes, saved),
        ]
        for s in e.stages
    ]
    return [
        "",
        "Activations each stage keeps for backward (end of the forward, whole batch):",
        *_table(["stage", "features", "map size", "saved", "fp32 maps/sample", "share"], rows),
        "  fp32 maps/sample: saved bytes / (batch x features x map voxels x 4 B): how many feature maps"
        " of that size the stage keeps per sample (a bf16 map counts 0.5)",
    ]


def _training_findings(e: Explanation) -> list[str]:
    t, total = e.training_terms, e.training_total_bytes
    activations = t["saved_activations"] + t["transient_activations"] + t["batch"]
    fixed = sum(t[k] for k in FIXED_TERMS)
    device = sum(v for k, v in t.items() if k in DEVICE_TERMS)
    voxels = math.prod(e.patch_size)
    out = [
        f"activations and the input batch are {_pct(activations, total)} of the peak: they scale with "
        f"batch x patch voxels ({e.batch_size} x {voxels:,}); parameters, gradients and optimizer state "
        f"are only {_pct(fixed, total)}; the device's own terms (allocator, workspace, runtime) "
        f"{_pct(device, total)}."
    ]
    if e.stages:
        big = max(e.stages, key=lambda s: s.activation_bytes)
        saved = sum(s.activation_bytes for s in e.stages)
        full = sum(s.activation_bytes for s in e.stages if s.shape and s.shape == e.stages[0].shape)
        out.append(
            f"the largest stage is {big.name} ({big.features} features x {_shape(big.shape)}): "
            f"{format_bytes(big.activation_bytes)}, {big.map_copies:.1f} feature maps per sample; "
            f"the full-resolution stages hold {_pct(full, saved)} of what the forward saves."
        )
    one = next(
        (
            w
            for w in e.what_ifs
            if w.batch_size == 1
            and w.patch_size == e.patch_size
            and w.precision == e.precision
            and w.checkpointing == e.checkpointing
        ),
        None,
    )
    if one is not None and e.batch_size > 1:
        per_sample = (total - one.total_bytes) / (e.batch_size - 1)
        out.append(
            f"at batch 1 the step would still need {format_bytes(one.total_bytes)}: each sample adds "
            f"about {format_bytes(per_sample)} at this patch (its activations, with the allocator's "
            f"share), on top of about {format_bytes(one.total_bytes - per_sample)} that no batch size "
            "removes (weights, gradients, optimizer state, the runtime)."
        )
    elif e.batch_size == 1:
        levers = (
            ["a smaller patch"]
            + (["AMP"] if e.precision == "fp32" and e.device == "cuda" else [])
            + ([] if e.checkpointing else ["checkpointing"])
        )
        out.append(
            f"this plan is already at batch 1: {format_bytes(activations)} is one sample's "
            f"activations at a {voxels:,}-voxel patch; only {' or '.join(levers)} lowers it."
        )
    if e.device == "cuda":
        out.append(
            "the caching allocator keeps freed blocks for reuse: the memory reserved (what nvidia-smi "
            "shows) stays near this peak for the whole run; it is not a leak. Fragmentation is "
            f"modelled as {100 * (CUDA_FRAGMENTATION - 1):.0f}% of the tensors "
            f"({format_bytes(t.get('fragmentation', 0))})."
        )
    return ["", "Why:", *(f"  - {line}" for line in out)]


def _what_if_table(e: Explanation) -> list[str]:
    base = e.training_total_bytes
    rows = [
        [
            w.change,
            str(w.batch_size),
            _shape(w.patch_size),
            w.precision,
            "on" if w.checkpointing else "off",
            format_bytes(w.total_bytes),
            f"{100 * (w.total_bytes - base) / base:+.1f}%" if base else "-",
            "yes" if w.fits else "NO",
        ]
        for w in e.what_ifs
    ]
    return [
        "",
        f"What moves the peak (predicted {e.device} peak; fits: within {format_bytes(e.budget_bytes)}):",
        *_table(["change", "batch", "patch", "precision", "ckpt", "peak", "vs plan", "fits"], rows),
    ]


def _inference_section(e: Explanation) -> list[str]:
    t = e.inference_terms
    out = [
        "",
        f"INFERENCE on the median image {_shape(e.inference_image_shape_zyx)} (tile batch 1, "
        f"mirroring on every axis, {e.inference_precision}): predicted peak "
        f"{format_bytes(e.inference_total_bytes)}, in the {e.inference_phase} phase.",
        *_terms_table(t, e.inference_total_bytes, e.device),
    ]
    volume = t.get("output", 0)
    out.append(
        f"  the probabilities (one fp16 volume per class) are {_pct(volume, e.inference_total_bytes)} of "
        "it: they grow with the image, the tile term with the patch (the accumulator holds a z-window of "
        "the image; on CUDA the probabilities are on the host)."
    )
    return out


def _host_section(e: Explanation) -> list[str]:
    if e.loader_workers:
        what = f"training loader worker: one batch in flight + {e.loader_queue_depth + 1} shared batch slots"
        per = e.loader_worker["total"]
    else:
        what = "training loader in the trainer (no workers): one batch in flight"
        per = e.loader_worker["in_flight"]
    rows = [[what, str(max(e.loader_workers, 1)), format_bytes(per), format_bytes(max(e.loader_workers, 1) * per)]]
    for case in e.host_cases:
        worker = case.preprocess_worker["total"]
        rows.append(
            [
                f"preprocessing worker, {case.label} {_shape(case.shape_zyx_before)} -> {_shape(case.shape_zyx_after)}",
                str(e.preprocessing_processes),
                format_bytes(worker),
                format_bytes(e.preprocessing_processes * worker),
            ]
        )
        rows.append(
            [
                f"export (slab by slab), {case.label}",
                "1",
                format_bytes(case.export["total"]),
                format_bytes(case.export["total"]),
            ]
        )
    return [
        "",
        f"HOST RAM (budget {format_bytes(e.host_ram_bytes)}):",
        *_table(["stage", "processes", "each", "together"], rows),
    ]


def format_explanation(e: Explanation) -> str:
    """The explanation as text: headline, training terms, stages, why, what-ifs, inference, host."""
    lines = [
        *_headline(e),
        *_terms_table(e.training_terms, e.training_total_bytes, e.device),
        *_stage_table(e),
        *_training_findings(e),
        *_what_if_table(e),
        *_inference_section(e),
        *_host_section(e),
    ]
    return "\n".join(lines) + "\n"
