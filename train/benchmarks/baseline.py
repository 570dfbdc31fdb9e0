"""train.bench --baseline: a plain PyTorch loop on the same transformer, timed in the same process before the
project's step: peft LoRA with fp32 LoRA parameters on bf16 base weights, diffusers' SDPA attention under
`torch.autocast(bfloat16)`, `torch.optim.AdamW(fused=True)` on CUDA over the LoRA parameters, MSE on the target
tokens, backward, step, zero_grad. It uses the same workload options (checkpointing, compile, text mask) and the same
noise and timesteps per step, so its loss curve is comparable with the project's; the report prints the ratio
baseline s/step / project s/step (> 1: the project is faster)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from train.benchmarks.profiling import profile_steps
from train.benchmarks.timing import Phase, reset_peak_memory, time_steps
from train.benchmarks.workload import LR
from train.config import Config
from train.data import sources
from train.model import family
from train.runtime import engine
from train.trainer import loop


def baseline_step(
    model: torch.nn.Module,
    b: sources.Batch,
    opt: torch.optim.Optimizer,
    cfg: Config,
    d: engine.Dist,
    dtype: torch.dtype,
) -> Callable[[int], torch.Tensor]:
    """Plain PyTorch: the same loss (same noise and timesteps per step as the project's step) on the bare
    model under bf16 autocast, loss.backward(), AdamW step, zero_grad."""
    t, gas = cfg.project.train, cfg.deepspeed["gradient_accumulation_steps"]
    fam = family.transformer_family(model)

    def step(i: int) -> torch.Tensor:
        generator = loop.micro_batch_generator(t.seed, i, 0, gas, d, d.device)
        with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = loop.forward_loss(model, b, t, generator, fam.bench.SCHEDULER, dtype, fam)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_baseline(
    model: torch.nn.Module, b: sources.Batch, cfg: Config, d: engine.Dist, dtype: torch.dtype, args: argparse.Namespace
) -> Phase:
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
    finally:
        opt.zero_grad(set_to_none=True)
        del opt
        with torch.no_grad():
            for p, p0 in zip(params, initial, strict=True):
                p.data = p0
        reset_peak_memory(b.x0.device)
