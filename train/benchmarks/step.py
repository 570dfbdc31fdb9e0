"""Benchmark of the project's real training step: step time, throughput, MFU and peak memory (the command
train/bench.py; its arguments are train/benchmarks/options.py's).

What is timed is exactly what `train.trainer.loop.train` runs per micro-step: `train.trainer.loop.forward_loss` on a
`train.data.sources.Batch` (the Qwen-Image family's conditioning inside), `engine.backward(loss)` and
`engine.step()` on the DeepSpeed engine that `train.runtime.engine.build_engine` returns (ZeRO-2, GAS 1). The batch is
built from synthetic tensors of the shapes the encoders produce. The frozen encoders (Qwen2.5-VL and the VAE) are
excluded: their cost does not depend on anything the trainer does to the transformer, it is measured
separately, and the latent/embedding cache (train/data/latent_cache.py) removes it from training altogether.

Default model: the full Qwen-Image-Edit transformer architecture (60 blocks, width 3072) at random init,
built directly on the GPU in bf16 (no weights needed; `--num_layers` lowers the depth, e.g. so that full
fine-tuning fits). `--tiny` is the CPU smoke mode: the tiny transformer of `train.make_tiny`, fp32.
`--variant qwen_image_21` measures Qwen-Image-2.1's single-stream DiT instead (32 blocks, width 4096; its text
encoder is Qwen3-VL), the family record's `bench` part giving its configs and batch; its FLOPs are flops21.py's and
its peer peer21.py's.

The parts, one module each: the options (options.py), the workload's shapes (workload.py), the model, batch and
config (build.py), the timed loops and their statistics (timing.py), the plain PyTorch loop of `--baseline`
(baseline.py), the FLOP count and MFU (flops.py, flops21.py), the peer (peer.py, peer21.py), `--profile`
(profiling.py), the record and report (report.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from train.benchmarks import ab, floor, flops, flops21, fp8_impls, peer, peer21
from train.benchmarks.baseline import run_baseline
from train.benchmarks.build import (
    args_family,
    build_model,
    census_model,
    lora_config,
    lora_targets,
    make_config,
    prepare_training,
    synthetic_batch,
    trainable_count,
)
from train.benchmarks.profiling import PHASES, profile_steps
from train.benchmarks.report import add_peer, make_record
from train.benchmarks.timing import Phase, reset_peak_memory, time_steps
from train.benchmarks.workload import SEED, Workload, explained_oom, make_workload
from train.config import Config
from train.data import sources
from train.model import kept_attention, prepare, swiglu
from train.model.interface import ModelFamily
from train.runtime import ds_patches, engine
from train.trainer import loop


def project_step(
    eng, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype, fam: ModelFamily
) -> Callable[[int], torch.Tensor]:
    """One micro-step as train.trainer.loop.train runs it (GAS 1): forward_loss, engine.backward, engine.step."""
    from torch.profiler import record_function

    t, gas = cfg.project.train, cfg.deepspeed["gradient_accumulation_steps"]

    def step(i: int) -> torch.Tensor:
        with record_function(PHASES[0]):
            generator = loop.micro_batch_generator(t.seed, i, 0, gas, d, d.device)
            loss = loop.forward_loss(eng, b, t, generator, fam.bench.SCHEDULER, dtype, fam)
        with record_function(PHASES[1]):
            eng.backward(loss)
        with record_function(PHASES[2]):
            eng.step()
        return loss.detach()

    return step


def run_project(
    model: torch.nn.Module, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype, args: argparse.Namespace
) -> tuple[Phase, dict]:
    """Build the DeepSpeed engine over `model` (train.runtime.engine.build_engine) and time its step; with
    --ab_rounds, in rounds with --ab_lever's lever off and on (ab.py). Returns the timed phase and the A/B's fields."""
    eng, _ = engine.build_engine(model, cfg.deepspeed)
    eng.train()
    fam = args_family(args)
    step = project_step(eng, b, cfg, d, dtype, fam)
    if args.ab_rounds:
        def switch(on: bool) -> object:
            if args.ab_lever == "text_calls":
                return kept_attention.split_text_calls(not on)
            if args.ab_lever == "lean_step":
                return ds_patches.lean_step(on)
            if args.ab_lever == "fa4_into":
                return kept_attention.copy_outputs(not on)
            return (swiglu.fuse if on else swiglu.unfuse)(fam.blocks(model), fam.swiglu)

        return ab.alternate(step, switch, args.ab_rounds, args.warmup, args.steps, d.device, args.gc_every_steps,
                            args.ab_lever)
    phase = time_steps(step, args.warmup, args.steps, d.device, args.gc_every_steps)
    if args.profile and d.is_main:
        profile_steps(step, args.warmup + args.steps, d.device, f"{args.profile}.project.txt")
    return phase, {}


def run_peer(args: argparse.Namespace, w: Workload, d: engine.Dist, dtype: torch.dtype) -> list[dict]:
    """Time DiffSynth-Studio's DiT on the same workload, one row per --peer_variants entry (train/benchmarks/peer.py,
    peer21.py); every rank times its own copy, as the baseline."""

    def time_step(step: Callable[[int], torch.Tensor]) -> dict:
        phase = time_steps(step, args.warmup, args.steps, d.device, args.gc_every_steps)
        stats = phase.stats(1.0)
        return {
            "s_per_step": stats["mean_s_per_step"],
            "median_s_per_step": stats["median_s_per_step"],
            "peak_memory_gb": phase.peak_memory_gb,
            "losses": phase.losses,
        }

    def free() -> None:
        torch._dynamo.reset()  # the peer's compiled graphs must not count toward the project's recompile limit
        reset_peak_memory(d.device)

    builder, arch = peer_builder(args, dtype)
    return peer.run_variants(
        peer.parse_variants(args.peer_variants),
        time_step,
        free,
        builder,
        latent_hw=w.latent_hw,
        refs=w.refs,
        text_tokens=w.text_tokens,
        targets=lora_targets(args.lora_targets, w.family),
        rank=args.lora_rank,
        device=d.device,
        dtype=dtype,
        seed=SEED,
        checkpointing=args.checkpointing == "full",
        **arch,
    )


def peer_builder(args: argparse.Namespace, dtype: torch.dtype) -> tuple[Callable[..., peer.Setup], dict]:
    """The peer of the measured family (peer.py: DiffSynth's QwenImageDiT; peer21.py: its QwenImage21DiT) and its
    architecture's arguments, read off the project's transformer on the meta device."""
    model = build_model(args, torch.device("meta"), dtype)
    if args_family(args).name == "qwen_image21":
        return peer21.build, {"config": dict(model.config)}
    dims = peer.TINY if args.tiny else peer.FULL
    return peer.build, {"num_layers": len(model.transformer_blocks), "zero_cond_t": args.zero_cond_t, "dims": dims}


def run(args: argparse.Namespace, d: engine.Dist) -> dict:
    """Build the model and batch, time the baseline (if asked) and the project's step; the result record."""
    dtype = torch.bfloat16 if d.device.type == "cuda" and not args.tiny else torch.float32
    if args.attention_kernel != "sdpa":  # before anything is compiled: the ops call the kernel chosen here
        try:
            kept_attention.use_kernel(args.attention_kernel, d.device)
        except RuntimeError as e:
            raise SystemExit(f"--attention_kernel {args.attention_kernel}: {e}") from None
    w = make_workload(args.area, args.refs, args.text_tokens, args.micro_batch, args_family(args))
    peer_rows = run_peer(args, w, d, dtype) if args.peer else None  # first: its memory is gone before ours is built
    model, model_info, flops_per_gpu = build_measured_model(args, w, d, dtype)
    b = synthetic_batch(w, model, d.device, dtype, args.text_mask)
    cfg = make_config(args, d.world_size, d.device.type == "cuda", dtype)
    with explained_oom(w):
        baseline = run_baseline(model, b, cfg, d, dtype, args) if args.baseline else None
    to_project_form(model, args, d.device)
    with explained_oom(w):
        project, ab_fields = run_project(model, b, cfg, d, dtype, args)
    record = {**make_record(args, w, model_info, flops_per_gpu, project, baseline, d, dtype), **ab_fields}
    if peer_rows is not None:
        add_peer(record, peer_rows, flops_per_gpu, args.peak_tflops)
    if args.floor:  # after the step's timing, in the same process: its kernels alone at its shapes
        record.update(measure_floor(args, b, cfg, d, dtype, project))
    return record


def build_measured_model(
    args: argparse.Namespace, w: Workload, d: engine.Dist, dtype: torch.dtype
) -> tuple[torch.nn.Module, dict, float]:
    """The transformer prepared for training (LoRA or full, checkpointing, compile; diffusers' RoPE for the
    baseline), its description for the record, and its model FLOPs per step on one GPU (counted before LoRA)."""
    model = build_model(args, d.device, dtype)
    flops_per_gpu = model_flops(model, w, args.mode)
    model_info = {
        "model": "tiny" if args.tiny else "full architecture",
        "num_layers": len(model.transformer_blocks),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    lora = lora_config(args.lora_rank, args.lora_targets, w.family)
    prepare_training(
        model, args.mode, lora, args.checkpointing, args.compile, args.checkpoint_blocks, args.compile_mode,
        args.attention,
    )
    model_info["trainable_params"] = trainable_count(model)
    model_info["attention"] = type(model.transformer_blocks[0].attn.processor).__name__
    if args.attention_kernel != "sdpa":
        route_attention(model, w.family)
        model_info["attention"] += f" ({args.attention_kernel})"
    return model, model_info, flops_per_gpu


def floor_census_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """build.census_model, its attention routed as the step's is with --attention_kernel: the census then records the
    op's calls, and the floor times the kernel the step runs."""
    model = census_model(args, dtype)
    if args.attention_kernel != "sdpa":
        route_attention(model, args_family(args))
    return model


def route_attention(model: torch.nn.Module, fam: ModelFamily) -> int:
    """Every block's attention as kept_attention's op, so on the kernel --attention_kernel chose, for a family whose
    attention the op can take (its record's `attention_module`: the MMDiT's unmasked joint attention; 2.1's
    segmented op calls the kernel itself). Blocks stay as compiled; a call the op cannot take (a text mask) goes to
    diffusers. Returns how many blocks were routed."""
    if fam.attention_module is None:
        return 0
    for block in model.transformer_blocks:
        kept_attention.keep(block, fam.attention_module)
    return len(model.transformer_blocks)


def model_flops(model: torch.nn.Module, w: Workload, mode: str) -> float:
    """Model FLOPs of one training step at workload `w` by its family's count (flops.py, flops21.py)."""
    if w.family.name == "qwen_image21":
        blocks = [w.target_tokens] * (w.refs + 1)  # references of the target's size, then the target
        return flops21.step_flops(model, w.text_tokens, blocks, mode, w.micro_batch)
    return flops.step_flops(model, w.image_tokens, w.text_tokens, mode, w.micro_batch)


def to_project_form(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """After the baseline (which runs diffusers' RoPE and the bf16 base): the trainer's real-pair rotary embedding
    (train.model.prepare.prepare_for_training's real_rope) and, with --fp8_base, the fp8 base (--fused_swiglu: with
    the SwiGLU MLPs fused, train/model/swiglu.py)."""
    real_rope = args_family(args).real_rope
    if real_rope is not None and not args.complex_rope:
        real_rope(model)
    if args.fp8_base:
        prepare.check_fp8_device()
        fp8_impls.convert(model, args.fp8_impl, keep_transposed=args.fp8_transposed, fast_accum=args.fp8_fast_accum)
        if args.fused_swiglu:  # after the conversion: it fuses the fp8 linears' matmuls
            fam = args_family(args)
            swiglu.fuse(fam.blocks(model), fam.swiglu)
        reset_peak_memory(device)


def measure_floor(
    args: argparse.Namespace, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype, project: Phase
) -> dict:
    """The floor's fields (train/benchmarks/floor.py): the step's attention and matmuls timed alone at the shapes of
    its first micro-batch, against the project's timed step; with --attention_kernel, its attention through the same
    op and kernel as the step's routed blocks."""
    kwargs, _, _ = loop.noisy_inputs(
        b,
        cfg.project.train,
        loop.micro_batch_generator(SEED, 0, 0, 1, d, d.device),
        args_family(args).bench.SCHEDULER,
        dtype,
        args_family(args),
    )
    meta = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()}
    median = project.stats(1.0)["median_s_per_step"]
    return floor.measure(
        floor_census_model(args, dtype),
        meta,
        project.s_per_step,
        median,
        d.device,
        dtype,
        args.floor_repeats,
        args.fp8_fast_accum,
    )
