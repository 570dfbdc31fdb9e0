"""CUDA out-of-memory errors turned into advice: the phase that ran out (loading, encoding, building the cache, the
step, a validation render), torch's own figures shortened, and the settings that lower that phase's memory. The loop,
the engine's entry points and the data sources raise it; entry points print it without a traceback."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory in a phase of the run; the message names the settings that lower that phase's memory.
    Entry points print it without a traceback (engine.exit_with)."""

    without_traceback = True


_LOWER = {
    "load": (
        'qwen_edit.memory.plan "auto" (the default; do not pin train.fp8_base / offload_blocks / '
        "gradient_checkpointing in the config) or, by hand, train.fp8_base = true and train.offload_blocks = N "
        '(with train.gradient_checkpointing = true); data.cache "auto" so the encoders leave the GPU before the '
        "transformer loads; a lower qwen_edit.memory.budget_gb if other processes share the GPU"
    ),
    "encode": (
        'data.cache "auto" (the encoders run once, before the transformer loads, and leave the GPU), a '
        "smaller qwen_edit.data.area or data.condition_area"
    ),
    "cache": (
        "a smaller qwen_edit.data.area or data.condition_area (the largest image's encode), a larger "
        "qwen_edit.memory.margin_gb or a lower memory.budget_gb (below what the VL encoder and the VAE need, "
        "the VL encoder's blocks stream from host memory), or build the cache with python -m train.cache on a "
        "larger GPU and point data.cache_dir at it; the rows encoded so far are rewritten on the next run"
    ),
    "step": (
        "qwen_edit.train.gradient_checkpointing = true (checkpoint_blocks 0 = every block), "
        "train.offload_blocks = N (the first N blocks' frozen weights in host memory), train.fp8_base = true, "
        'a smaller qwen_edit.data.area, a lower qwen_edit.lora.rank, or memory.plan "auto" with those keys '
        'left out of the config; last, zero_optimization.offload_optimizer = {"device": "cpu"} (the '
        "optimizer state in host memory, a slower step)"
    ),
    "validation": (
        "inference.vae_tiling = true (the VAE decodes in tiles), a smaller qwen_edit.inference.area, "
        'data.cache "auto" (renders then replay conditioning recorded before the model loads, with '
        'the VAE alone: no VL encoder beside the model), or validation.file "" and render the export '
        "afterwards with python -m train.infer"
    ),
}


@dataclass(frozen=True)
class InEffect:
    """A run's memory settings as it trains (after the plan), for the step's out-of-memory advice."""

    checkpoint_all: bool  # train.gradient_checkpointing on every block
    offload_blocks: int
    fp8_base: bool
    offload_optimizer: bool  # DeepSpeed's zero_optimization.offload_optimizer
    planned: bool  # qwen_edit.memory.plan "auto" chose them
    margin_gb: float  # qwen_edit.memory.margin_gb (0: automatic)


def _step_advice(now: InEffect) -> str:
    """The step's levers that are not yet in effect, then what is left when the plan already pulled them all."""
    items = (
        []
        if now.checkpoint_all
        else ["qwen_edit.train.gradient_checkpointing = true (checkpoint_blocks 0 = every block)"]
    )
    items.append(
        f"train.offload_blocks = N (the first N blocks' frozen weights in host memory; now {now.offload_blocks})"
    )
    if not now.fp8_base:
        items.append("train.fp8_base = true")
    items += ["a smaller qwen_edit.data.area", "a lower qwen_edit.lora.rank"]
    if now.planned:
        margin = f"now {now.margin_gb:g} GB" if now.margin_gb > 0 else "now automatic: 1.5 GB + 5% of the budget"
        items.append(
            f"a larger qwen_edit.memory.margin_gb ({margin}): the plan then picks a setting with a "
            "smaller predicted peak"
        )
    else:
        items.append('memory.plan "auto" with those keys left out of the config')
    advice = ", ".join(items)
    if not now.offload_optimizer:
        advice += (
            '; last, zero_optimization.offload_optimizer = {"device": "cpu"} (the optimizer state in host '
            "memory, a slower step)"
        )
    return advice


def oom_advice(phase: str, micro_batch: int, now: InEffect | None = None) -> str:
    """What lowers the memory of `phase` (load, encode, cache, step, validation); a micro-batch of 1 is never suggested
    to a run that already has it, nor (with `now`, the step's settings in effect) a step setting already on."""
    micro = (
        "; train_micro_batch_size_per_gpu = 1 (raise gradient_accumulation_steps instead)"
        if micro_batch > 1 and phase in ("encode", "step")
        else ""
    )
    lower = _step_advice(now) if phase == "step" and now is not None else _LOWER[phase]
    return f"To use less memory: {lower}{micro}"


def out_of_memory(e: BaseException, doing: str, phase: str, micro_batch: int = 1) -> OutOfMemory:
    """The OutOfMemory to raise from torch's error `e` in `phase`: "CUDA out of memory while <doing>", torch's
    figures, then what lowers that phase's memory."""
    return OutOfMemory(f"CUDA out of memory while {doing}{torch_oom_figures(e)}. {oom_advice(phase, micro_batch)}")


def torch_oom_figures(e: BaseException) -> str:
    """torch's own figures from a CUDA out-of-memory error, shortened: what it tried to allocate, what its caching
    allocator held (allocated, and reserved but free) and the largest allocated so far; "" where it gave none."""
    text = str(e)
    wanted = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    held = re.search(
        r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch, and ([\d.]+ [KMGT]?i?B) is reserved by PyTorch but "
        r"unallocated",
        text,
    )
    parts = [f"tried to allocate {wanted.group(1)}"] if wanted else []
    if held:
        parts.append(f"{held.group(1)} allocated and {held.group(2)} reserved but free")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(f"at most {torch.cuda.max_memory_allocated() / 1e9:.1f} GB allocated so far")
    return f" (torch: {'; '.join(parts)})" if parts else ""
