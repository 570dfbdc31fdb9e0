"""Benchmark of the project's real training step: step time, throughput, MFU and peak memory (the command
train/bench.py; its arguments are parse_args's).

What is timed is exactly what `train.trainer.loop.train` runs per micro-step: `train.trainer.loop.forward_loss` on a
`train.data.sources.Batch` (the Qwen-Image family's conditioning inside), `engine.backward(loss)` and
`engine.step()` on the DeepSpeed engine that `train.runtime.engine.build_engine` returns (ZeRO-2, GAS 1). The batch is
built from synthetic tensors of the shapes the encoders produce. The frozen encoders (Qwen2.5-VL and the VAE) are
excluded: their cost does not depend on anything the trainer does to the transformer, it is measured
separately, and the latent/embedding cache (train/data/latent_cache.py) removes it from training altogether.

Default model: the full Qwen-Image-Edit transformer architecture (60 blocks, width 3072) at random init,
built directly on the GPU in bf16 (no weights needed; `--num_layers` lowers the depth, e.g. so that full
fine-tuning fits). `--tiny` is the CPU smoke mode: the tiny transformer of `train.make_tiny`, fp32.

`--baseline` also runs, in the same process and before the project's step, a plain PyTorch loop on the same
transformer: peft LoRA with fp32 LoRA parameters on bf16 base weights, diffusers' SDPA attention under
`torch.autocast(bfloat16)`, `torch.optim.AdamW(fused=True)` on CUDA over the LoRA parameters, MSE on the target
tokens, backward, step, zero_grad. It uses the same workload options (checkpointing, compile, text mask) and
prints the ratio baseline s/step / project s/step (> 1: the project is faster).

MFU (model FLOPs utilisation; recomputation under checkpointing is not counted):

    FLOPs per sample and step = k_lin x F_lin + 3 x F_attn
      k_lin = 2 for LoRA (frozen base: forward + input-gradient GEMMs; LoRA's own FLOPs ignored), 3 for full
      F_lin  = 2 x sum over the transformer's nn.Linear layers of tokens x in_features x out_features, where
               tokens = image tokens (target + references) for image-stream linears (img_in, attn.to_q/k/v,
               attn.to_out.0, img_mlp, proj_out), text tokens for text-stream linears (txt_in, attn.add_q/k/v_proj,
               attn.to_add_out, txt_mlp), and 1 for modulation / timestep linears (img_mod, txt_mod, norm_out,
               time_text_embed)
      F_attn = blocks x 4 x L^2 x inner_dim (QK^T and AV; L = all tokens, inner_dim = heads x head_dim = 3072)
    MFU = FLOPs per step (x micro-batch x GPUs) / (s/step x 989e12 FLOP/s x GPUs)

989e12 FLOP/s is the bf16 dense peak of one H100/H200 SXM (datasheet; `--peak_tflops` changes it). The linears
are found by walking the module, so the count is right for `--num_layers` and `--tiny`. Sanity check: the full
model at 1024^2 + one 1024^2 reference + 256 text tokens gives 3.87e14 FLOPs per LoRA step, so 1.28 s/step is
about 31% MFU. On a CPU the figure is printed but means nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from train.benchmarks import floor, fp8_impls, kernels, peer
from train.config import Config, LoraConfig, ProjectConfig, TrainConfig, resolve_deepspeed
from train.data import sources
from train.model import family, prepare
from train.runtime import engine, steptime
from train.runtime.collector import Collector
from train.trainer import loop

ATTN_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's
PEAK_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense, per GPU (datasheet)
SEED = 42
FAMILY = family.family_named("qwen_image")  # the architecture measured here, and by the peer (DiffSynth's QwenImageDiT)
LR = 1e-4
# Which stream's tokens each nn.Linear sees; the first pattern that matches the module name wins.
_STREAMS = (
    ("one", re.compile(r"(^|\.)(time_text_embed|norm_out|img_mod|txt_mod)\.")),
    ("text", re.compile(r"(^|\.)(txt_in|txt_mlp\..+|attn\.(add_[qkv]_proj|to_add_out))$")),
    ("image", re.compile(r"(^|\.)(img_in|proj_out|img_mlp\..+|attn\.(to_[qkv]|to_out\.0))$")),
)
# Fields of the JSON record that are numbers > 0 in every run (the CI smoke test checks them).
NUMERIC_FIELDS = ("s_per_step", "median_s_per_step", "mean_over_median", "slowest_s", "slowest_step", "timed_steps",
                  "samples_per_s", "tokens_per_s", "mfu", "flops_per_step", "peak_memory_gb",
                  "area", "width", "height", "target_tokens", "text_tokens", "tokens_per_sample", "trainable_params",
                  "total_params", "micro_batch", "gpu_count", "steps", "peak_tflops_per_gpu")
BASELINE_FIELDS = ("baseline_s_per_step", "baseline_median_s_per_step", "baseline_samples_per_s", "baseline_mfu",
                   "baseline_peak_memory_gb", "ratio")


# ---------------------------------------------------------------- options and workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; area and text tokens default per model (1024^2 / 256 full, 128^2 / 32 tiny)."""
    p = argparse.ArgumentParser(description="Benchmark the project's DeepSpeed training step (encoders excluded)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny transformer of train.make_tiny, fp32")
    p.add_argument("--num_layers", type=int, help="depth of the full architecture (default 60)")
    p.add_argument("--area", type=int, help="target pixel area (default 1024*1024; 128*128 with --tiny)")
    p.add_argument("--refs", type=int, default=1, help="reference images, each at --area (default 1)")
    p.add_argument("--text_tokens", type=int, help="prompt tokens (default 256; 32 with --tiny)")
    p.add_argument("--micro_batch", type=int, default=1, help="samples per GPU per step (default 1)")
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--lora_rank", type=int, default=64)
    p.add_argument("--lora_targets", choices=("attn", "default"), default="attn",
                   help="attn: the 8 attention projections; default: the family's default targets (12)")
    p.add_argument("--checkpointing", choices=("none", "full"), default="none",
                   help="full: recompute every transformer block in backward")
    p.add_argument("--checkpoint_blocks", type=int, default=0,
                   help="with --checkpointing full: recompute only the first N blocks (default 0 = all)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--compile_mode", choices=COMPILE_MODES,
                   help="with --compile: torch.compile's mode for the blocks (default: torch's default); "
                        "reduce-overhead replays each block as a CUDA graph")
    p.add_argument("--zero_cond_t", action="store_true",
                   help="Qwen-Image-Edit-2511's transformer config: reference tokens modulated at timestep 0")
    _add_fp8_arguments(p)
    p.add_argument("--peer", choices=("diffsynth",),
                   help="also time DiffSynth-Studio's QwenImageDiT on the same workload, driven as its trainer "
                        "drives it (train/benchmarks/peer.py; needs the bench extra), before the project's step")
    p.add_argument("--peer_variants", default=",".join(peer.DEFAULT_VARIANTS),
                   help="comma-separated BASE:MODE, BASE bf16 or a DiffSynth quantisation method, MODE eager, "
                        f"compile or compile_dynamic (default {','.join(peer.DEFAULT_VARIANTS)})")
    p.add_argument("--complex_rope", action="store_true",
                   help="the project's step with diffusers' complex rotary embedding instead of real pairs "
                        "(train/model/qwen_image/rope.py), to measure that lever")
    p.add_argument("--text_mask", action="store_true",
                   help="pass an all-ones text mask (the pipelines pass none at micro-batch 1)")
    p.add_argument("--zero_stage", type=int, choices=(0, 1, 2), default=2,
                   help="zero_optimization.stage of the engine (default 2, as ds_configs/zero2.json)")
    _add_probe_arguments(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=steptime.WARMUP_STEPS,
                   help=f"untimed steps first (default {steptime.WARMUP_STEPS}, as the trainer's step-time summary)")
    p.add_argument("--gc_every_steps", type=int, default=TrainConfig().gc_every_steps,
                   help="the garbage collector as train.gc_every_steps runs it in training, for every timed loop "
                        f"(default {TrainConfig().gc_every_steps}; 0 = Python's automatic collection)")
    p.add_argument("--baseline", action="store_true", help="also time a plain PyTorch LoRA loop, print the ratio")
    p.add_argument("--loss_tolerance", type=float, default=1e-3,
                   help="with --baseline: largest relative loss difference per step accepted between the two "
                        "loops' curves (default 1e-3)")
    p.add_argument("--peak_tflops", type=float, default=PEAK_TFLOPS, help="peak per GPU for MFU (default 989)")
    p.add_argument("--json", help="append the result as one JSON line to this file (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    _check_args(p, args)
    args.area = args.area or (128 * 128 if args.tiny else 1024 * 1024)
    args.text_tokens = args.text_tokens or (32 if args.tiny else 256)
    return args


def _add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """What else is read from the timed step: its profile and its kernels' floor."""
    p.add_argument("--profile", help="also profile 3 steps of each loop (torch.profiler); tables go to PROFILE.*.txt")
    p.add_argument("--floor", action="store_true",
                   help="after the step, time its attention and matmul kernels alone at its shapes and report the "
                        "step's time over their sum (train/benchmarks/floor.py)")
    p.add_argument("--floor_repeats", type=int, default=20,
                   help="with --floor: timed calls of each kernel (default 20)")


def _add_fp8_arguments(p: argparse.ArgumentParser) -> None:
    """The fp8 base's options: train.fp8_base, fp8_transposed, and the other implementations."""
    p.add_argument("--fp8_base", action="store_true",
                   help="the project's step with the frozen block weights in fp8 (train.fp8_base; the baseline "
                        "stays bf16, so --baseline compares the curves)")
    p.add_argument("--fp8_transposed", action="store_true",
                   help="with --fp8_base: keep the fp8 weights transposed for the backward too (train.fp8_transposed)")
    p.add_argument("--fp8_fast_accum", action="store_true",
                   help="with --fp8_base: the fp8 matmuls accumulate fast (train.fp8_fast_accum)")
    p.add_argument("--fp8_impl", choices=fp8_impls.IMPLS, default="ours",
                   help="with --fp8_base: train/model/fp8.py (ours, default) or torchao's float8 training linear "
                        "(torchao_training) or fp8 inference linears (torchao_inference); "
                        "train/benchmarks/fp8_impls.py says what each does")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject combinations the benchmark cannot run (parser.error exits with status 2)."""
    if (args.steps < 1 or args.warmup < 0 or args.micro_batch < 1 or args.refs < 0 or args.lora_rank < 1
            or args.gc_every_steps < 0):
        parser.error("--steps, --micro_batch, --lora_rank must be >= 1; --warmup, --refs and --gc_every_steps >= 0")
    if args.area is not None and args.area < 32 * 32:
        parser.error("--area must be at least 1024 px (one 32x32 tile)")
    if args.text_tokens is not None and args.text_tokens < 1:
        parser.error("--text_tokens must be >= 1")
    if args.tiny and args.num_layers is not None:
        parser.error("--num_layers applies to the full architecture, not --tiny")
    if args.num_layers is not None and args.num_layers < 1:
        parser.error("--num_layers must be >= 1")
    if args.fp8_base and args.mode != "lora":
        parser.error("--fp8_base needs --mode lora (a frozen base)")
    if args.fp8_transposed and not args.fp8_base:
        parser.error("--fp8_transposed applies with --fp8_base")
    if args.fp8_fast_accum and not args.fp8_base:
        parser.error("--fp8_fast_accum applies with --fp8_base")
    if args.compile_mode and not args.compile:
        parser.error("--compile_mode applies with --compile")
    if args.floor and (args.mode != "lora" or args.fp8_impl != "ours" or args.floor_repeats < 1):
        parser.error("--floor times a frozen base's matmuls as train/model/fp8.py makes them: use it with --mode lora "
                     "(and --fp8_impl ours), --floor_repeats >= 1")
    if args.baseline and args.mode != "lora":
        parser.error("--baseline is the plain PyTorch LoRA loop; use it with --mode lora")
    if args.fp8_impl != "ours" and not args.fp8_base:
        parser.error("--fp8_impl applies with --fp8_base")
    if (args.fp8_transposed or args.fp8_fast_accum) and args.fp8_impl != "ours":
        parser.error("--fp8_transposed and --fp8_fast_accum are train/model/fp8.py's; use them with --fp8_impl ours")
    if args.peer:
        if args.mode != "lora" or args.micro_batch != 1 or args.checkpoint_blocks:
            parser.error("--peer trains LoRA at micro-batch 1, every block checkpointed or none (as its trainer); "
                         "drop --mode full, --micro_batch and --checkpoint_blocks")
        try:
            peer.parse_variants(args.peer_variants)
        except ValueError as e:
            parser.error(str(e))


@dataclass(frozen=True)
class Workload:
    """Shapes of one micro-batch: square target and references of the same size, plus text tokens."""

    width: int
    height: int
    refs: int
    text_tokens: int
    micro_batch: int

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // FAMILY.pixels_per_latent, self.width // FAMILY.pixels_per_latent

    @property
    def target_tokens(self) -> int:
        h, w = self.latent_hw
        return (h // 2) * (w // 2)

    @property
    def reference_tokens(self) -> int:
        return self.refs * self.target_tokens

    @property
    def image_tokens(self) -> int:
        return self.target_tokens + self.reference_tokens

    @property
    def tokens_per_sample(self) -> int:
        return self.image_tokens + self.text_tokens


def make_workload(area: int, refs: int, text_tokens: int, micro_batch: int) -> Workload:
    """Square images of about `area` pixels, sized (multiples of 32) as the edit pipelines size them."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    width, height = calculate_dimensions(area, 1.0)
    return Workload(int(width), int(height), refs, text_tokens, micro_batch)


# ---------------------------------------------------------------- model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in `dtype` inside the block (no fp32 copy of 20 B weights first)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def variant(zero_cond_t: bool) -> str:
    """The variant measured: Qwen-Image-Edit, or 2511 (zero_cond_t)."""
    return "edit_plus_2511" if zero_cond_t else "edit"


def build_full_transformer(num_layers: int | None, device: torch.device | str, dtype: torch.dtype,
                           zero_cond_t: bool = False) -> torch.nn.Module:
    """The Qwen-Image-Edit transformer at random init, `num_layers` deep (None: the released depth), created
    directly on `device` (also "meta") in `dtype` (zero_cond_t: 2511's)."""
    import diffusers

    with torch.device(device), default_dtype(dtype):
        cls = getattr(diffusers, FAMILY.transformer_class)
        return cls(**FAMILY.bench.released_config(variant(zero_cond_t), num_layers))


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Tiny (fp32) or full-architecture transformer on `device`, seeded alike on every rank."""
    torch.manual_seed(SEED)
    if args.tiny:  # fp32 as built (dtype is float32 for --tiny)
        return FAMILY.bench.tiny_transformer(variant(args.zero_cond_t)).to(device)
    return build_full_transformer(args.num_layers, device, dtype, args.zero_cond_t)


def census_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The benchmarked model on the meta device, prepared as run() prepares it for the project's step (LoRA, RoPE, fp8
    base) but not compiled: the floor's census of the step's calls (train/benchmarks/floor.py)."""
    model = build_model(args, torch.device("meta"), dtype)
    prepare_training(model, args.mode, lora_config(args.lora_rank, args.lora_targets), args.checkpointing, False,
                     args.checkpoint_blocks)
    if not args.complex_rope:
        FAMILY.real_rope(model)
    if args.fp8_base:
        fp8_impls.convert(model, args.fp8_impl, keep_transposed=args.fp8_transposed, fast_accum=args.fp8_fast_accum)
    return model


def lora_targets(kind: str) -> list[str]:
    """Module-name suffixes that get LoRA: 'attn' (8 attention projections) or the family's default 12."""
    return list(ATTN_TARGETS) if kind == "attn" else list(FAMILY.lora.targets)


def lora_config(rank: int, targets: str) -> LoraConfig:
    """The project's LoRA settings for the benchmark (alpha = rank, no dropout)."""
    return LoraConfig(rank=rank, alpha=float(rank), dropout=0.0, target_modules=lora_targets(targets))


def prepare_training(model: torch.nn.Module, mode: str, lora: LoraConfig, checkpointing: str,
                     compile_blocks: bool, checkpoint_blocks: int = 0, compile_mode: str | None = None) -> None:
    """The trainer's own preparation (train.model.prepare.prepare_for_training, as train/main.py calls it), but with
    diffusers' rotary embedding: the baseline runs first; run() switches to the trainer's real pairs after it."""
    prepare.prepare_for_training(model, mode, lora, checkpointing == "full", compile_blocks,
                                checkpoint_blocks=checkpoint_blocks, real_rope=False, compile_mode=compile_mode)


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- FLOPs and MFU


def linear_stream(name: str) -> str:
    """'image', 'text' or 'one' (one vector per sample): whose tokens the nn.Linear called `name` sees."""
    name = name.replace(".base_layer", "")  # a peft-wrapped linear counts as its base layer
    for stream, pattern in _STREAMS:
        if pattern.search(name):
            return stream
    raise ValueError(f"nn.Linear {name!r} belongs to no known stream; extend train.bench._STREAMS")


def forward_linear_flops(model: torch.nn.Module, image_tokens: int, text_tokens: int) -> float:
    """2 x tokens x in x out summed over the model's nn.Linear layers (LoRA's own layers skipped)."""
    tokens = {"image": image_tokens, "text": text_tokens, "one": 1}
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            total += 2 * tokens[linear_stream(name)] * module.in_features * module.out_features
    return float(total)


def forward_attention_flops(model: torch.nn.Module, tokens: int) -> float:
    """QK^T and AV of the joint attention: blocks x 4 x L^2 x inner_dim."""
    return float(len(model.transformer_blocks) * 4 * tokens**2 * model.inner_dim)


def step_flops(model: torch.nn.Module, image_tokens: int, text_tokens: int, mode: str, batch: int = 1) -> float:
    """Model FLOPs of one training step of `batch` samples on one GPU (see the module docstring)."""
    k_lin = 2 if mode == "lora" else 3
    linear = forward_linear_flops(model, image_tokens, text_tokens)
    attention = forward_attention_flops(model, image_tokens + text_tokens)
    return batch * (k_lin * linear + 3 * attention)


def mfu(flops_per_step: float, s_per_step: float, num_gpus: int, peak_tflops: float = PEAK_TFLOPS) -> float:
    """Model FLOPs utilisation: `flops_per_step` is the global count (all GPUs together)."""
    return flops_per_step / (s_per_step * peak_tflops * 1e12 * num_gpus)


# ---------------------------------------------------------------- batch, config, timing


def synthetic_batch(w: Workload, model: torch.nn.Module, device: torch.device, cond_dtype: torch.dtype,
                    text_mask: bool) -> sources.Batch:
    """A sources.Batch of random tensors shaped as encode_batch returns them (conditioning in encoder dtype)."""
    return FAMILY.synthetic_batch(model, w.micro_batch, w.latent_hw, [w.latent_hw] * w.refs, w.text_tokens, device,
                                  cond_dtype, text_mask, seed=SEED)


def make_config(args: argparse.Namespace, world_size: int, has_gpu: bool, dtype: torch.dtype) -> Config:
    """Config as train.config.load_config resolves it: ZeRO-2 as in ds_configs/zero2.json (no LR schedule)."""
    ds = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        # Stage 2 as ds_configs/zero2.json; stage 0/1 without overlap and contiguous buffers, so that DeepSpeed
        # installs no per-parameter gradient hooks (gradients are reduced in bulk at the step).
        "zero_optimization": {"stage": args.zero_stage, "overlap_comm": has_gpu and args.zero_stage == 2,
                              "contiguous_gradients": args.zero_stage == 2,
                              "reduce_scatter": True, "reduce_bucket_size": 200_000_000,
                              "allgather_bucket_size": 200_000_000},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    }
    train = TrainConfig(mode=args.mode, max_steps=args.warmup + args.steps, seed=SEED,
                        gradient_checkpointing=args.checkpointing == "full")
    project = ProjectConfig(lora=lora_config(args.lora_rank, args.lora_targets), train=train)
    return Config(project=project, deepspeed=resolve_deepspeed(ds, train.max_steps, has_gpu), world_size=world_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """torch.cuda.max_memory_allocated on a GPU; the process's peak RSS on a CPU (Linux: ru_maxrss in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each entry's largest value on any rank (a collective when the world is larger than one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    return values


@dataclass
class Phase:
    """One timed loop: every step's seconds (the slowest rank's), peak memory (largest rank), the losses."""

    seconds: list[float]  # every step's, warm-up included
    warmup: int
    peak_memory_gb: float
    losses: list[float]  # every step's loss, warm-up included (same seeds in both loops: comparable curves)

    @property
    def last_loss(self) -> float:
        return self.losses[-1]

    def stats(self, samples_per_step: float) -> dict:
        """steptime.step_time_stats of the steps after the warm-up (the same summary as the trainer's)."""
        return steptime.step_time_stats(self.seconds, samples_per_step, warmup=self.warmup)

    @property
    def s_per_step(self) -> float:
        """The mean over the timed steps."""
        return self.stats(1.0)["mean_s_per_step"]


def time_steps(step: Callable[[int], torch.Tensor], warmup: int, steps: int, device: torch.device,
               gc_every_steps: int = 0) -> Phase:
    """Run `warmup` steps, then `steps` more, every rank starting them together, each step timed alone
    (steptime.StepTimer: CUDA events, no sync inside the loop); the garbage collector as train.gc_every_steps runs it
    in training (no log here: a full collection every 100 steps)."""
    reset_peak_memory(device)
    timer, losses = steptime.StepTimer(device), []
    with Collector(gc_every_steps) as collector:
        for i in range(warmup + steps):
            if i == warmup:
                _sync(device)
                engine.barrier()
            timer.start()
            losses.append(step(i))  # kept on the device: no sync inside the loop
            collector.after_step(i + 1, at_log=True)
            timer.stop()
    return Phase(max_over_ranks(timer.seconds(), device), warmup, max_over_ranks([peak_memory_gb(device)], device)[0],
                 [float(x) for x in losses])


PHASES = ("bench/forward", "bench/backward", "bench/step")  # record_function labels of project_step
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass(frozen=True)
class Span:
    """One profiler event reduced to what the idle report needs (times in microseconds)."""

    name: str
    start: float
    end: float
    on_device: bool


def idle_report(spans: list[Span], steps: int, top: int = 12) -> str:
    """Where the device waits for the host: gaps between kernels, attributed to the step phase (PHASES) the host
    was in when the next kernel was issued, and the host synchronisations in each phase."""
    kernels = sorted((s for s in spans if s.on_device), key=lambda s: s.start)
    phases = sorted((s for s in spans if not s.on_device and s.name in PHASES), key=lambda s: s.start)

    def phase_at(t: float) -> str:
        inside = [p.name for p in phases if p.start <= t <= p.end]
        return inside[-1] if inside else "between phases"

    gaps, busy_until, previous = [], None, None  # (length, phase, kernel before, kernel after)
    for k in kernels:
        if busy_until is not None and k.start > busy_until:
            # charged to the phase in which the host issued the kernel that ended the gap
            gaps.append((k.start - busy_until, phase_at(k.start - 1.0), previous, k.name))
        if busy_until is None or k.end > busy_until:
            busy_until, previous = k.end, k.name
    by_phase: dict[str, float] = {}
    for length, phase, _, _ in gaps:
        by_phase[phase] = by_phase.get(phase, 0.0) + length
    syncs: dict[str, int] = {}
    for s in spans:
        if not s.on_device and s.name in SYNC_CALLS:
            key = f"{s.name} in {phase_at(s.start)}"
            syncs[key] = syncs.get(key, 0) + 1
    total = sum(g[0] for g in gaps)
    lines = [f"device idle between kernels: {total / steps / 1e3:.2f} ms/step in {len(gaps) / steps:.0f} gaps/step; "
             "by the phase that issued the next kernel:"]
    lines += [f"  {name}: {us / steps / 1e3:.2f} ms/step" for name, us in sorted(by_phase.items(), key=lambda x: -x[1])]
    lines.append("host synchronisations per step: " + (", ".join(
        f"{name} x{count / steps:g}" for name, count in sorted(syncs.items())) or "none"))
    lines.append(f"largest {top} gaps (ms, phase, kernel before -> kernel after):")
    for length, phase, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {length / 1e3:7.3f}  {phase:15s} {str(before)[:60]} -> {after[:60]}")
    return "\n".join(lines) + "\n"


def profiler_spans(prof) -> list[Span]:
    """Kernels, copies and host events of a finished torch.profiler run."""
    return [Span(e.name, e.time_range.start, e.time_range.end, _is_kernel(e)) for e in prof.events()]


def _is_kernel(event) -> bool:
    """A kernel or copy on the device (not a host op, nor a record_function range mirrored on the device)."""
    name = getattr(event, "name", None) or getattr(event, "key", "")  # FunctionEvent / key_averages' rows
    return (event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and name not in PHASES)


def profile_steps(step: Callable[[int], torch.Tensor], first: int, device: torch.device, path: str) -> None:
    """torch.profiler over 3 more steps; writes the op table (by device time), the device-busy share and, on a
    GPU, the idle report (where the device waits for the host) and the kernels by category (train/benchmarks/
    kernels.py: which part of the floor each belongs to, or what it is beyond it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(first, first + 3):
            step(i)
        _sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # Kernels (and copies) only: an op's row repeats the device time of the kernels it launched.
    busy_us = sum(e.self_device_time_total for e in events if _is_kernel(e))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"wall {wall / 3:.4f} s/step under the profiler; device kernels {busy_us / 3e6:.4f} s/step "
                f"({100 * busy_us / 1e6 / wall:.1f}% busy)\n\n")
        if device.type == "cuda":
            f.write(idle_report(profiler_spans(prof), steps=3) + "\n")
            f.write(kernels.report(kernels.profiled_kernels(prof), steps=3) + "\n")
        f.write(events.table(sort_by=sort, row_limit=60, max_name_column_width=90))


# ---------------------------------------------------------------- the two loops


def oom_hint(w: Workload) -> str:
    return (f"CUDA out of memory at {w.width}x{w.height} px + {w.refs} reference(s), micro-batch {w.micro_batch}; "
            "try --checkpointing full, a smaller --area or --micro_batch, or --num_layers N")


def project_step(eng, b: sources.Batch, cfg: Config, d: engine.Dist,
                 dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    """One micro-step as train.trainer.loop.train runs it (GAS 1): forward_loss, engine.backward, engine.step."""
    from torch.profiler import record_function

    t, gas = cfg.project.train, cfg.deepspeed["gradient_accumulation_steps"]

    def step(i: int) -> torch.Tensor:
        with record_function(PHASES[0]):
            generator = loop.micro_batch_generator(t.seed, i, 0, gas, d, d.device)
            loss = loop.forward_loss(eng, b, t, generator, FAMILY.bench.SCHEDULER, dtype, FAMILY)
        with record_function(PHASES[1]):
            eng.backward(loss)
        with record_function(PHASES[2]):
            eng.step()
        return loss.detach()

    return step


def run_project(model: torch.nn.Module, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype,
                args: argparse.Namespace, w: Workload) -> Phase:
    """Build the DeepSpeed engine over `model` (train.runtime.engine.build_engine) and time its step."""
    eng, _ = engine.build_engine(model, cfg.deepspeed)
    eng.train()
    try:
        step = project_step(eng, b, cfg, d, dtype)
        phase = time_steps(step, args.warmup, args.steps, d.device, args.gc_every_steps)
        if args.profile and d.is_main:
            profile_steps(step, args.warmup + args.steps, d.device, f"{args.profile}.project.txt")
        return phase
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(oom_hint(w)) from e


def baseline_step(model: torch.nn.Module, b: sources.Batch, opt: torch.optim.Optimizer, cfg: Config,
                  d: engine.Dist, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    """Plain PyTorch: the same loss (same noise and timesteps per step as the project's step) on the bare
    model under bf16 autocast, loss.backward(), AdamW step, zero_grad."""
    t, gas = cfg.project.train, cfg.deepspeed["gradient_accumulation_steps"]

    def step(i: int) -> torch.Tensor:
        generator = loop.micro_batch_generator(t.seed, i, 0, gas, d, d.device)
        with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = loop.forward_loss(model, b, t, generator, FAMILY.bench.SCHEDULER, dtype, FAMILY)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_baseline(model: torch.nn.Module, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype,
                 args: argparse.Namespace, w: Workload) -> Phase:
    """Time the plain loop (LoRA parameters in fp32), then put the LoRA weights back to their initial values
    (so the project's loop starts from the same point) and free the optimizer state and gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().clone() for p in params]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=b.x0.device.type == "cuda")
    try:
        step = baseline_step(model, b, opt, cfg, d, dtype)
        phase = time_steps(step, args.warmup, args.steps, b.x0.device, args.gc_every_steps)
        if args.profile and d.is_main:
            profile_steps(step, args.warmup + args.steps, d.device, f"{args.profile}.baseline.txt")
        return phase
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(oom_hint(w)) from e
    finally:
        opt.zero_grad(set_to_none=True)
        del opt
        with torch.no_grad():
            for p, p0 in zip(params, initial, strict=True):
                p.data = p0
        reset_peak_memory(b.x0.device)


def run_peer(args: argparse.Namespace, w: Workload, d: engine.Dist, dtype: torch.dtype) -> list[dict]:
    """Time DiffSynth-Studio's DiT on the same workload, one row per --peer_variants entry (train/benchmarks/peer.py);
    every rank times its own copy, as the baseline."""
    def time_step(step: Callable[[int], torch.Tensor]) -> dict:
        phase = time_steps(step, args.warmup, args.steps, d.device, args.gc_every_steps)
        stats = phase.stats(1.0)
        return {"s_per_step": stats["mean_s_per_step"], "median_s_per_step": stats["median_s_per_step"],
                "peak_memory_gb": phase.peak_memory_gb, "losses": phase.losses}

    def free() -> None:
        torch._dynamo.reset()  # the peer's compiled graphs must not count toward the project's recompile limit
        reset_peak_memory(d.device)

    num_layers = len(build_model(args, torch.device("meta"), dtype).transformer_blocks)
    return peer.run_variants(
        peer.parse_variants(args.peer_variants), time_step, free, num_layers=num_layers, latent_hw=w.latent_hw,
        refs=w.refs, text_tokens=w.text_tokens, targets=lora_targets(args.lora_targets), rank=args.lora_rank,
        device=d.device, dtype=dtype, seed=SEED, zero_cond_t=args.zero_cond_t,
        checkpointing=args.checkpointing == "full", dims=peer.TINY if args.tiny else peer.FULL)


def add_peer(record: dict, rows: list[dict], flops_per_gpu: float, peak_tflops: float) -> None:
    """The peer's rows (with MFU by the same FLOP count) and the ratio of its fastest to the project's step."""
    timed = [r for r in rows if "error" not in r]
    for r in timed:
        r["mfu"] = mfu(flops_per_gpu, r["s_per_step"], 1, peak_tflops)
    record.update(peer="diffsynth", peer_version=peer.version(), peer_rows=rows,
                  peer_not_measured=peer.not_measured())
    if timed:
        fastest = min(timed, key=lambda r: r["s_per_step"])
        record.update(peer_fastest=fastest["variant"], peer_fastest_s_per_step=fastest["s_per_step"],
                      peer_ratio=fastest["s_per_step"] / record["s_per_step"])


# ---------------------------------------------------------------- report


def machine(d: engine.Dist) -> dict:
    """Device name and software versions, for the record."""
    import deepspeed
    import diffusers

    if d.device.type == "cuda":
        name = torch.cuda.get_device_name(d.device)
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return {"gpu_name": name, "gpu_count": d.world_size, "device_type": d.device.type,
            "torch_version": torch.__version__, "deepspeed_version": deepspeed.__version__,
            "diffusers_version": diffusers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def make_record(args: argparse.Namespace, w: Workload, model_info: dict, flops_per_gpu: float, project: Phase,
                baseline: Phase | None, d: engine.Dist, dtype: torch.dtype) -> dict:
    """The result as one flat JSON-able dict (global throughput = per GPU x world size)."""
    world = d.world_size
    flops = flops_per_gpu * world
    record = {
        **project.stats(w.micro_batch * world),  # mean, median, slowest, slow steps: steptime.step_time_stats
        "s_per_step": project.s_per_step, "samples_per_s": w.micro_batch * world / project.s_per_step,
        "tokens_per_s": w.micro_batch * world * w.tokens_per_sample / project.s_per_step,
        "mfu": mfu(flops, project.s_per_step, world, args.peak_tflops), "flops_per_step": flops,
        "peak_memory_gb": project.peak_memory_gb,
        "peak_memory_source": "torch.cuda.max_memory_allocated" if d.device.type == "cuda" else "ru_maxrss",
        "last_loss": project.last_loss, "losses": project.losses,
        "area": args.area, "width": w.width, "height": w.height, "refs": w.refs,
        "target_tokens": w.target_tokens, "reference_tokens": w.reference_tokens, "text_tokens": w.text_tokens,
        "tokens_per_sample": w.tokens_per_sample, "micro_batch": w.micro_batch, **model_info,
        "precision": str(dtype).removeprefix("torch."), "mode": args.mode, "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets, "checkpointing": args.checkpointing, "compile": args.compile,
        "compile_mode": args.compile_mode,
        "zero_cond_t": args.zero_cond_t,
        "zero_stage": args.zero_stage, "fp8_base": args.fp8_base, "fp8_transposed": args.fp8_transposed,
        "fp8_fast_accum": args.fp8_fast_accum,
        "fp8_impl": args.fp8_impl if args.fp8_base else None,
        "rope": "complex (diffusers)" if args.complex_rope else "real pairs",
        "checkpoint_blocks": args.checkpoint_blocks,
        "text_mask": args.text_mask, "steps": args.steps, "warmup": args.warmup, "gc_every_steps": args.gc_every_steps,
        "peak_tflops_per_gpu": args.peak_tflops, **machine(d),
    }
    if baseline is not None:
        record.update(baseline_s_per_step=baseline.s_per_step,
                      baseline_median_s_per_step=baseline.stats(1.0)["median_s_per_step"],
                      baseline_samples_per_s=w.micro_batch * world
                      / baseline.s_per_step, baseline_mfu=mfu(flops, baseline.s_per_step, world, args.peak_tflops),
                      baseline_peak_memory_gb=baseline.peak_memory_gb, ratio=baseline.s_per_step / project.s_per_step,
                      baseline_losses=baseline.losses, loss_max_rel_diff=max_rel_diff(project.losses, baseline.losses),
                      loss_tolerance=args.loss_tolerance)
        record["loss_within_tolerance"] = record["loss_max_rel_diff"] <= args.loss_tolerance
    return record


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
        f"model       {r['model']}{' (2511: zero_cond_t)' if r['zero_cond_t'] else ''}, {r['num_layers']} blocks, "
        f"{r['precision']}, {lora}: "
        f"{r['trainable_params']:,} trainable of {r['total_params']:,}",
        f"options     checkpointing {r['checkpointing']}, compile {r['compile']}"
        f"{' (' + r['compile_mode'] + ')' if r.get('compile_mode') else ''}, text mask {r['text_mask']}, "
        f"ZeRO stage {r['zero_stage']}, fp8 base {r['fp8_base']} ({r['fp8_impl'] or '-'}, transposed copy "
        f"{r['fp8_transposed']}{', fast accumulation' if r.get('fp8_fast_accum') else ''}), "
        f"RoPE {r['rope']}, "
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
        lines += [f"baseline    {r['baseline_s_per_step']:.4f} s/step (median {r['baseline_median_s_per_step']:.4f}), "
                  f"MFU {100 * r['baseline_mfu']:.2f}%, peak {r['baseline_peak_memory_gb']:.2f} GB (plain PyTorch + "
                  "peft LoRA, AdamW)",
                  f"ratio       baseline / project = {r['ratio']:.3f} (> 1: the project's step is faster)",
                  f"losses      same seeds, {len(r['losses'])} steps each: largest relative difference "
                  f"{r['loss_max_rel_diff']:.2e}, tolerance {r['loss_tolerance']:.1e}: "
                  + ("within" if r["loss_within_tolerance"] else "OUTSIDE THE TOLERANCE")]
    if "peer_rows" in r:
        lines += peer_report(r)
    if "floor_s" in r:
        lines += floor.report_lines(r)
    if r["device_type"] != "cuda":
        lines.append("note        CPU run: MFU (against a GPU's bf16 peak) and peak memory (process RSS) are not "
                     "meaningful here; this mode checks that the benchmark runs")
    return "\n".join(lines)


def peer_report(r: dict) -> list[str]:
    """The peer's rows and its ratio, for format_report."""
    lines = [f"peer        DiffSynth-Studio {r['peer_version']} QwenImageDiT driven as its trainer drives it "
             "(train/benchmarks/peer.py), micro-batch 1, same workload:"]
    for row in r["peer_rows"]:
        if "error" in row:
            lines.append(f"  {row['variant']:28s} not measured: {row['error']}")
        else:
            lines.append(f"  {row['variant']:28s} {row['s_per_step']:.4f} s/step (median "
                         f"{row['median_s_per_step']:.4f}), MFU {100 * row['mfu']:.2f}%, peak "
                         f"{row['peak_memory_gb']:.2f} GB")
    lines.append(f"  {'':28s} not measured: {r['peer_not_measured']}")
    if "peer_ratio" in r:
        lines.append(f"peer ratio  peer's fastest ({r['peer_fastest']}) / project = {r['peer_ratio']:.3f} "
                     "(> 1: the project's step is faster)")
    return lines


# ---------------------------------------------------------------- entry


def run(args: argparse.Namespace, d: engine.Dist) -> dict:
    """Build the model and batch, time the baseline (if asked) and the project's step; the result record."""
    dtype = torch.bfloat16 if d.device.type == "cuda" and not args.tiny else torch.float32
    w = make_workload(args.area, args.refs, args.text_tokens, args.micro_batch)
    peer_rows = run_peer(args, w, d, dtype) if args.peer else None  # first: its memory is gone before ours is built
    model = build_model(args, d.device, dtype)
    flops_per_gpu = step_flops(model, w.image_tokens, w.text_tokens, args.mode, w.micro_batch)
    model_info = {"model": "tiny" if args.tiny else "full architecture", "num_layers": len(model.transformer_blocks),
                  "total_params": sum(p.numel() for p in model.parameters())}
    prepare_training(model, args.mode, lora_config(args.lora_rank, args.lora_targets), args.checkpointing,
                     args.compile, args.checkpoint_blocks, args.compile_mode)
    model_info["trainable_params"] = trainable_count(model)
    b = synthetic_batch(w, model, d.device, dtype, args.text_mask)
    cfg = make_config(args, d.world_size, d.device.type == "cuda", dtype)
    baseline = run_baseline(model, b, cfg, d, dtype, args, w) if args.baseline else None
    # the trainer's rotary embedding (train.model.prepare.prepare_for_training's real_rope)
    if not args.complex_rope:
        FAMILY.real_rope(model)
    if args.fp8_base:  # after the baseline, which runs the bf16 base
        prepare.check_fp8_device()
        fp8_impls.convert(model, args.fp8_impl, keep_transposed=args.fp8_transposed, fast_accum=args.fp8_fast_accum)
        reset_peak_memory(d.device)
    project = run_project(model, b, cfg, d, dtype, args, w)
    record = make_record(args, w, model_info, flops_per_gpu, project, baseline, d, dtype)
    if peer_rows is not None:
        add_peer(record, peer_rows, flops_per_gpu, args.peak_tflops)
    if args.floor:  # after the step's timing, in the same process: its kernels alone at its shapes
        kwargs, _, _ = loop.noisy_inputs(b, cfg.project.train, loop.micro_batch_generator(SEED, 0, 0, 1, d, d.device),
                                         FAMILY.bench.SCHEDULER, dtype, FAMILY)
        meta = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()}
        median = project.stats(1.0)["median_s_per_step"]
        record.update(floor.measure(census_model(args, dtype), meta, project.s_per_step, median, d.device, dtype,
                                    args.floor_repeats, args.fp8_fast_accum))
    return record
