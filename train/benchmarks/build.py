"""The project's step as train.bench builds it: the transformer of `--variant`'s family (tiny, or the full
architecture at random init straight on the device), the trainer's own LoRA / checkpointing / compile preparation, a
synthetic batch of the encoders' shapes and the Config that train.config.load_config would resolve (ZeRO-2, GAS 1).
What differs between the families comes from their records' `bench` parts (released config, tiny transformer,
synthetic batch, scheduler) and LoRA targets."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

from train.benchmarks import fp8_impls
from train.benchmarks.workload import FAMILY, LR, SEED, Workload, bench_family
from train.config import Config, LoraConfig, ProjectConfig, TrainConfig, resolve_deepspeed
from train.data import sources
from train.model import prepare
from train.model.interface import ModelFamily


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in `dtype` inside the block (no fp32 copy of 20 B weights first)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def variant(zero_cond_t: bool, name: str = "edit") -> str:
    """The variant measured: `name` (--variant), Qwen-Image-Edit-2511 where zero_cond_t."""
    return "edit_plus_2511" if zero_cond_t else name


def args_family(args: argparse.Namespace) -> ModelFamily:
    """The family of the options' --variant."""
    return bench_family(args.variant)


def build_full_transformer(
    num_layers: int | None,
    device: torch.device | str,
    dtype: torch.dtype,
    zero_cond_t: bool = False,
    name: str = "edit",
) -> torch.nn.Module:
    """The transformer of variant `name` (zero_cond_t: 2511's) at random init, `num_layers` deep (None: the released
    depth), created directly on `device` (also "meta") in `dtype`."""
    import diffusers

    fam = bench_family(name)
    with torch.device(device), default_dtype(dtype):
        cls = getattr(diffusers, fam.transformer_class)
        return cls(**fam.bench.released_config(variant(zero_cond_t, name), num_layers))


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Tiny (fp32) or full-architecture transformer on `device`, seeded alike on every rank."""
    torch.manual_seed(SEED)
    if args.tiny:  # fp32 as built (dtype is float32 for --tiny)
        return args_family(args).bench.tiny_transformer(variant(args.zero_cond_t, args.variant)).to(device)
    return build_full_transformer(args.num_layers, device, dtype, args.zero_cond_t, args.variant)


def census_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The benchmarked model on the meta device, prepared as step.run prepares it for the project's step (LoRA, RoPE,
    fp8 base) but not compiled: the floor's census of the step's calls (train/benchmarks/floor.py)."""
    model = build_model(args, torch.device("meta"), dtype)
    prepare_training(
        model,
        args.mode,
        lora_config(args.lora_rank, args.lora_targets, args_family(args)),
        args.checkpointing,
        False,
        args.checkpoint_blocks,
    )
    real_rope = args_family(args).real_rope
    if real_rope is not None and not args.complex_rope:
        real_rope(model)
    if args.fp8_base:
        fp8_impls.convert(model, args.fp8_impl, keep_transposed=args.fp8_transposed, fast_accum=args.fp8_fast_accum)
    return model


def lora_targets(kind: str, fam: ModelFamily = FAMILY) -> list[str]:
    """Module-name suffixes that get LoRA: 'attn' (the attention projections among the family's default targets:
    Qwen-Image's 8 of both streams, 2.1's 4) or the family's default targets (Qwen-Image's 12, 2.1's 7)."""
    targets = list(fam.lora.targets)
    return [t for t in targets if t.startswith("attn.")] if kind == "attn" else targets


def lora_config(rank: int, targets: str, fam: ModelFamily = FAMILY) -> LoraConfig:
    """The project's LoRA settings for the benchmark (alpha = rank, no dropout)."""
    return LoraConfig(rank=rank, alpha=float(rank), dropout=0.0, target_modules=lora_targets(targets, fam))


def prepare_training(
    model: torch.nn.Module,
    mode: str,
    lora: LoraConfig,
    checkpointing: str,
    compile_blocks: bool,
    checkpoint_blocks: int = 0,
    compile_mode: str | None = None,
    attention: str = "auto",
) -> None:
    """The trainer's own preparation (train.model.prepare.prepare_for_training, as train/main.py calls it), but with
    diffusers' rotary embedding: the baseline runs first; step.run switches to the trainer's real pairs after it."""
    prepare.prepare_for_training(
        model,
        mode,
        lora,
        checkpointing == "full",
        compile_blocks,
        checkpoint_blocks=checkpoint_blocks,
        real_rope=False,
        compile_mode=compile_mode,
        attention=attention,
    )


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def synthetic_batch(
    w: Workload, model: torch.nn.Module, device: torch.device, cond_dtype: torch.dtype, text_mask: bool
) -> sources.Batch:
    """A sources.Batch of random tensors shaped as encode_batch returns them (conditioning in encoder dtype), the
    family's bench part counting the workload's tokens as the family does."""
    return w.family.bench.synthetic_batch(
        model,
        w.micro_batch,
        w.latent_hw,
        [w.latent_hw] * w.refs,
        w.text_tokens,
        device,
        cond_dtype,
        text_mask,
        seed=SEED,
    )


def make_config(args: argparse.Namespace, world_size: int, has_gpu: bool, dtype: torch.dtype) -> Config:
    """Config as train.config.load_config resolves it: ZeRO-2 as in ds_configs/zero2.json (no LR schedule)."""
    ds = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        # Stage 2 as ds_configs/zero2.json; stage 0/1 without overlap and contiguous buffers, so that DeepSpeed
        # installs no per-parameter gradient hooks (gradients are reduced in bulk at the step).
        "zero_optimization": {
            "stage": args.zero_stage,
            "overlap_comm": has_gpu and args.zero_stage == 2,
            "contiguous_gradients": args.zero_stage == 2,
            "reduce_scatter": True,
            "reduce_bucket_size": 200_000_000,
            "allgather_bucket_size": 200_000_000,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    }
    train = TrainConfig(
        mode=args.mode,
        max_steps=args.warmup + args.steps,
        seed=SEED,
        gradient_checkpointing=args.checkpointing == "full",
    )
    project = ProjectConfig(lora=lora_config(args.lora_rank, args.lora_targets, args_family(args)), train=train)
    return Config(project=project, deepspeed=resolve_deepspeed(ds, train.max_steps, has_gpu), world_size=world_size)
