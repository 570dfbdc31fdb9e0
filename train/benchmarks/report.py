"""train.bench's result: one flat JSON record (appended with --json) and the human-readable block rank 0 prints."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch

from train.benchmarks import ab, floor, peer
from train.benchmarks.flops import mfu
from train.benchmarks.timing import Phase
from train.benchmarks.workload import Workload, bench_family
from train.runtime import engine, steptime

# Fields of the JSON record that are numbers > 0 in every run (the CI smoke test checks them).
NUMERIC_FIELDS = (
    "s_per_step",
    "median_s_per_step",
    "mean_over_median",
    "slowest_s",
    "slowest_step",
    "timed_steps",
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "flops_per_step",
    "peak_memory_gb",
    "area",
    "width",
    "height",
    "target_tokens",
    "text_tokens",
    "tokens_per_sample",
    "trainable_params",
    "total_params",
    "micro_batch",
    "gpu_count",
    "steps",
    "peak_tflops_per_gpu",
)
BASELINE_FIELDS = (
    "baseline_s_per_step",
    "baseline_median_s_per_step",
    "baseline_samples_per_s",
    "baseline_mfu",
    "baseline_peak_memory_gb",
    "ratio",
)


def machine(d: engine.Dist) -> dict:
    """Device name and software versions, for the record."""
    import deepspeed
    import diffusers

    if d.device.type == "cuda":
        name = torch.cuda.get_device_name(d.device)
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return {
        "gpu_name": name,
        "gpu_count": d.world_size,
        "device_type": d.device.type,
        "torch_version": torch.__version__,
        "deepspeed_version": deepspeed.__version__,
        "diffusers_version": diffusers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def rope_name(args: argparse.Namespace) -> str:
    """How the measured step rotates q and k: the family's real pairs unless --complex_rope or it has none."""
    return "complex (diffusers)" if args.complex_rope or bench_family(args.variant).real_rope is None else "real pairs"


# the options a record holds as they were given
RECORDED_OPTIONS = ("variant", "mode", "lora_rank", "lora_targets", "checkpointing", "compile", "compile_mode",
                    "zero_cond_t", "zero_stage", "fp8_base", "fp8_transposed", "fp8_fast_accum", "fused_swiglu",
                    "checkpoint_blocks", "text_mask", "steps", "warmup", "gc_every_steps")


def make_record(
    args: argparse.Namespace,
    w: Workload,
    model_info: dict,
    flops_per_gpu: float,
    project: Phase,
    baseline: Phase | None,
    d: engine.Dist,
    dtype: torch.dtype,
) -> dict:
    """The result as one flat JSON-able dict (global throughput = per GPU x world size)."""
    world = d.world_size
    flops = flops_per_gpu * world
    record = {
        **project.stats(w.micro_batch * world),  # mean, median, slowest, slow steps: steptime.step_time_stats
        "s_per_step": project.s_per_step,
        "samples_per_s": w.micro_batch * world / project.s_per_step,
        "tokens_per_s": w.micro_batch * world * w.tokens_per_sample / project.s_per_step,
        "mfu": mfu(flops, project.s_per_step, world, args.peak_tflops),
        "flops_per_step": flops,
        "peak_memory_gb": project.peak_memory_gb,
        "peak_memory_source": "torch.cuda.max_memory_allocated" if d.device.type == "cuda" else "ru_maxrss",
        "last_loss": project.last_loss,
        "losses": project.losses,
        "area": args.area,
        "width": w.width,
        "height": w.height,
        "refs": w.refs,
        "target_tokens": w.target_tokens,
        "reference_tokens": w.reference_tokens,
        "text_tokens": w.text_tokens,
        "tokens_per_sample": w.tokens_per_sample,
        "micro_batch": w.micro_batch,
        **model_info,
        "precision": str(dtype).removeprefix("torch."),
        **{name: getattr(args, name) for name in RECORDED_OPTIONS},
        "fp8_impl": args.fp8_impl if args.fp8_base else None,
        "rope": rope_name(args),
        "peak_tflops_per_gpu": args.peak_tflops,
        **machine(d),
    }
    if baseline is not None:
        record.update(baseline_fields(baseline, project, w.micro_batch * world, flops, world, args))
    return record


def baseline_fields(
    baseline: Phase, project: Phase, samples_per_step: int, flops: float, world: int, args: argparse.Namespace
) -> dict:
    """The plain loop's figures, its ratio to the project's step and how far apart the two loss curves are."""
    rel_diff = max_rel_diff(project.losses, baseline.losses)
    return {
        "baseline_s_per_step": baseline.s_per_step,
        "baseline_median_s_per_step": baseline.stats(1.0)["median_s_per_step"],
        "baseline_samples_per_s": samples_per_step / baseline.s_per_step,
        "baseline_mfu": mfu(flops, baseline.s_per_step, world, args.peak_tflops),
        "baseline_peak_memory_gb": baseline.peak_memory_gb,
        "ratio": baseline.s_per_step / project.s_per_step,
        "baseline_losses": baseline.losses,
        "loss_max_rel_diff": rel_diff,
        "loss_tolerance": args.loss_tolerance,
        "loss_within_tolerance": rel_diff <= args.loss_tolerance,
    }


def add_peer(record: dict, rows: list[dict], flops_per_gpu: float, peak_tflops: float) -> None:
    """The peer's rows (with MFU by the same FLOP count) and the ratio of its fastest to the project's step."""
    timed = [r for r in rows if "error" not in r]
    for r in timed:
        r["mfu"] = mfu(flops_per_gpu, r["s_per_step"], 1, peak_tflops)
    record.update(peer="diffsynth", peer_version=peer.version(), peer_rows=rows, peer_not_measured=peer.not_measured())
    if timed:
        fastest = min(timed, key=lambda r: r["s_per_step"])
        record.update(
            peer_fastest=fastest["variant"],
            peer_fastest_s_per_step=fastest["s_per_step"],
            peer_ratio=fastest["s_per_step"] / record["s_per_step"],
        )


def append_json(path: str, record: dict) -> None:
    """Append `record` as one JSON line to `path` (the --json option of the benchmarks)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """Largest |a_i - b_i| / |b_i| over two loss curves of the same steps and seeds."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def format_report(r: dict) -> str:
    """The human-readable block rank 0 prints."""
    lora = f"LoRA r{r['lora_rank']} ({r['lora_targets']})" if r["mode"] == "lora" else "full fine-tuning"
    lines = [
        "== train.bench: project step (forward_loss + engine.backward + engine.step, ZeRO-2; encoders excluded) ==",
        f"machine     {r['gpu_name']} x {r['gpu_count']}, torch {r['torch_version']}, deepspeed "
        f"{r['deepspeed_version']}, diffusers {r['diffusers_version']}, {r['date']}",
        f"workload    {r['width']}x{r['height']} target + {r['refs']} reference(s) of the same size + "
        f"{r['text_tokens']} text tokens = {r['tokens_per_sample']} tokens/sample, micro-batch {r['micro_batch']}",
        f"model       {r['model']} {r.get('variant', 'edit')}{' (2511: zero_cond_t)' if r['zero_cond_t'] else ''}, "
        f"{r['num_layers']} blocks, "
        f"{r['precision']}, {lora}: "
        f"{r['trainable_params']:,} trainable of {r['total_params']:,}",
        f"options     checkpointing {r['checkpointing']}, compile {r['compile']}"
        f"{' (' + r['compile_mode'] + ')' if r.get('compile_mode') else ''}, text mask {r['text_mask']}, "
        f"ZeRO stage {r['zero_stage']}, fp8 base {r['fp8_base']} ({r['fp8_impl'] or '-'}, transposed copy "
        f"{r['fp8_transposed']}{', fast accumulation' if r.get('fp8_fast_accum') else ''}"
        f"{', fused SwiGLU' if r.get('fused_swiglu') else ''}), "
        f"RoPE {r['rope']}, attention {r.get('attention', '-')}, "
        f"checkpointed blocks {r['checkpoint_blocks'] or 'all'}, "
        f"{r['steps']} timed steps after {r['warmup']} warm-up",
        f"s/step      {r['s_per_step']:.4f} (mean), median {r['median_s_per_step']:.4f} (mean "
        f"{r['mean_over_median']:.3f}x), slowest {r['slowest_s']:.4f} at step {r['slowest_step']}, {r['slow_steps']} "
        f"over {steptime.SLOW_FACTOR:g}x the median",
        f"samples/s   {r['samples_per_s']:.3f} (global)",
        f"tokens/s    {r['tokens_per_s']:.1f} (global)",
        f"FLOPs/step  {r['flops_per_step']:.4g} (global, model FLOPs)",
        f"MFU         {100 * r['mfu']:.2f}% of {r['peak_tflops_per_gpu']:g} TFLOP/s per GPU",
        f"peak memory {r['peak_memory_gb']:.2f} GB ({r['peak_memory_source']})",
    ]
    if "ratio" in r:
        lines += [
            f"baseline    {r['baseline_s_per_step']:.4f} s/step (median {r['baseline_median_s_per_step']:.4f}), "
            f"MFU {100 * r['baseline_mfu']:.2f}%, peak {r['baseline_peak_memory_gb']:.2f} GB (plain PyTorch + "
            "peft LoRA, AdamW)",
            f"ratio       baseline / project = {r['ratio']:.3f} (> 1: the project's step is faster)",
            f"losses      same seeds, {len(r['losses'])} steps each: largest relative difference "
            f"{r['loss_max_rel_diff']:.2e}, tolerance {r['loss_tolerance']:.1e}: "
            + ("within" if r["loss_within_tolerance"] else "OUTSIDE THE TOLERANCE"),
        ]
    if "peer_rows" in r:
        lines += peer_report(r)
    if "floor_s" in r:
        lines += floor.report_lines(r)
    if "ab_rounds" in r:
        lines += ab.report_lines(r)
    if r["device_type"] != "cuda":
        lines.append(
            "note        CPU run: MFU (against a GPU's bf16 peak) and peak memory (process RSS) are not "
            "meaningful here; this mode checks that the benchmark runs"
        )
    return "\n".join(lines)


def peer_report(r: dict) -> list[str]:
    """The peer's rows and its ratio, for format_report."""
    is_21 = r.get("variant") == "qwen_image_21"
    dit, module = ("QwenImage21DiT", "peer21.py") if is_21 else ("QwenImageDiT", "peer.py")
    lines = [
        f"peer        DiffSynth-Studio {r['peer_version']} {dit} driven as its trainer drives it "
        f"(train/benchmarks/{module}), micro-batch 1, same workload:"
    ]
    for row in r["peer_rows"]:
        if "error" in row:
            lines.append(f"  {row['variant']:28s} not measured: {row['error']}")
        else:
            lines.append(
                f"  {row['variant']:28s} {row['s_per_step']:.4f} s/step (median "
                f"{row['median_s_per_step']:.4f}), MFU {100 * row['mfu']:.2f}%, peak "
                f"{row['peak_memory_gb']:.2f} GB" + (f", attention {row['attention']}" if "attention" in row else "")
            )
    lines.append(f"  {'':28s} not measured: {r['peer_not_measured']}")
    if "peer_ratio" in r:
        lines.append(
            f"peer ratio  peer's fastest ({r['peer_fastest']}) / project = {r['peer_ratio']:.3f} "
            "(> 1: the project's step is faster)"
        )
    return lines
