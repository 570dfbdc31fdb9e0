"""The plan's words: a setting described, the plan line's notes (validation renders, the host step, pinned host
memory), and the refusals: a choice's NoFit turned into the PlanError a run stops with, naming the figures and what
to change."""

from __future__ import annotations

import dataclasses

from train.plan.choice import NoFit, Scored, choose
from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.measure import Measured
from train.plan.predict import Choice, Prediction, host_bytes, predict
from train.plan.sizes import GB, Sizes, moved_bytes
from train.runtime.oom import oom_advice


class PlanError(ValueError):
    """Nothing fits the budget: the message has the numbers and what to change."""


def describe(c: Choice, num_blocks: int) -> str:
    """Setting `c` in words, as the plan line prints it."""
    transposed = c.fp8_transposed and c.offloaded < num_blocks  # offloaded blocks keep no transposed copy
    fp8 = ("fp8 base + transposed copy" if transposed else "fp8 base") if c.fp8_base else "bf16 base"
    ck = (
        "no checkpointing"
        if not c.checkpointed
        else (
            "all blocks checkpointed" if c.checkpointed >= num_blocks else f"first {c.checkpointed} blocks checkpointed"
        )
    )
    if c.kept_attention and c.checkpointed:
        ck += (
            " (all keep their attention output)"
            if c.kept_attention >= c.checkpointed
            else f" ({c.kept_attention} of them keep their attention output)"
        )
    off = f", first {c.offloaded} blocks offloaded to host memory" if c.offloaded else ""
    enc = "from the cache" if c.cached else "online encoding"
    opt = (
        ", optimizer state in host memory (DeepSpeed offload_optimizer, Adam steps on the CPU)"
        if (c.offload_optimizer)
        else ""
    )
    vae = {None: "", False: ", validation VAE decode untiled", True: ", validation VAE decode tiled"}[c.vae_tiling]
    return f"{fp8}, {ck}{off}, {enc}{opt}{vae}"


def choice_or_refusal(result: Scored | NoFit, s: Sizes, host: Host, fixed: dict) -> Scored:
    """choose's `result` when a setting fits; else PlanError with the words of its NoFit."""
    if isinstance(result, NoFit):
        raise PlanError(refusal(result, s, host, fixed))
    return result


def refusal(no_fit: NoFit, s: Sizes, host: Host, fixed: dict) -> str:
    """Why nothing fits, with the figures and what to change."""
    budget = f"{no_fit.budget / GB:.1f} GB with a {no_fit.margin / GB:.1f} GB margin"
    if no_fit.kind == "no candidate":
        return "the config's explicit settings leave no candidate to plan (see qwen_edit.memory)"
    smallest = describe(no_fit.smallest, s.num_blocks)
    if no_fit.kind == "host":
        return (
            f"nothing fits this node's host memory: only settings that pin host memory fit the GPU budget "
            f"({budget}), and the one that needs the least ({smallest}) needs "
            f"{host_refusal(s, no_fit.smallest, host, fixed)}"
        )
    if no_fit.kind == "render":
        return (
            f"nothing fits the memory budget with validation renders: {budget}; the training step fits, but a "
            f"render of qwen_edit.validation.file (the first runs before step 1) needs "
            f"{no_fit.needs_bytes / GB:.1f} GB at the least ({smallest}). {oom_advice('validation', 1)}"
        )
    return (
        f"nothing fits the memory budget: {budget}; the smallest setting allowed ({smallest}) needs "
        f"{no_fit.needs_bytes / GB:.1f} GB.{_unused_offload(no_fit, s.num_blocks)}{_full_ranks_hint(no_fit, s)} "
        f"Lower qwen_edit.data.area or the micro-batch, {'' if s.full else 'a lower qwen_edit.lora.rank, '}remove "
        "settings that pin the plan (train.fp8_base false, train.gradient_checkpointing false, data.cache off), "
        "or use a bigger GPU or the model-parallel mode"
    )


def _unused_offload(no_fit: NoFit, num_blocks: int) -> str:
    """The sentence about the optimizer offload the plan could not use."""
    if no_fit.offload is None:
        return ""
    verdict = "would fit" if no_fit.offload_needs_bytes <= no_fit.room else "would still not fit"
    return (
        f" With DeepSpeed's optimizer offload (zero_optimization.offload_optimizer) the run {verdict}: "
        f"{describe(no_fit.offload, num_blocks)} needs {no_fit.offload_needs_bytes / GB:.1f} GB, of "
        f"{no_fit.room / GB:.1f} GB; but {no_fit.blocker}."
    )


def _full_ranks_hint(no_fit: NoFit, s: Sizes) -> str:
    """The sentence for full fine-tuning: over how many GPUs ZeRO stage 2 fits it, or that no number does."""
    if no_fit.full_ranks is None:
        return ""
    if no_fit.full_ranks.ranks is None:
        return (
            f" Full fine-tuning does not fit at any number of GPUs: every GPU holds the whole model "
            f"({s.num_blocks * s.block_params + s.other_params:,} parameters in bf16) and its activations; "
            'train a LoRA (qwen_edit.train.mode "lora") or use a GPU with more memory.'
        )
    world = no_fit.full_ranks.ranks
    return (
        f" Full fine-tuning fits with ZeRO stage 2 (zero_optimization.stage 2) over {world} or more GPUs "
        f"(data-parallel ranks: deepspeed --num_gpus, or a hostfile for several nodes), which split the fp32 "
        f"master weights, Adam moments and gradients: {no_fit.full_ranks.per_gpu_bytes / GB:.1f} GB each at "
        f"{world}."
    )


def host_refusal(s: Sizes, c: Choice, host: Host, fixed: dict, dtype_bytes: int = 2) -> str:
    """Why setting `c` does not fit this node's host memory, with its figures and what to change."""
    per_block = moved_bytes(s, c.fp8_base, dtype_bytes)
    kind = "fp8" if c.fp8_base else "bf16"
    if host.shares(c.offloaded * per_block):
        parts = (
            f"one copy for the node's {host.ranks_per_node} training processes in /dev/shm of {c.offloaded} "
            f"offloaded blocks x {per_block / GB:.2f} GB ({kind} weights)"
        )
    else:
        parts = (
            f"{host.ranks_per_node} training process(es) on this node x {c.offloaded} offloaded blocks x "
            f"{per_block / GB:.2f} GB ({kind} weights)"
        )
    if c.offload_optimizer:
        state = host.ranks_per_node * s.host_state_bytes(host.world_size)
        parts += f" + {state / GB:.1f} GB of DeepSpeed's offloaded optimizer state"
    pinned = ""
    if "train.offload_blocks" in fixed:
        pinned = (
            f" qwen_edit.train.offload_blocks = {fixed['train.offload_blocks']} is set in the config: set fewer "
            "blocks, or leave the key out so that the plan chooses what fits."
        )
    return (
        f"{host_bytes(s, c, host, dtype_bytes) / GB:.1f} GB of pinned host memory ({parts}), and "
        f"{host.available_bytes / GB:.1f} GB is available, less a {host.margin_bytes / GB:.1f} GB margin.{pinned} "
        "To fit: fewer training processes per node (deepspeed --num_gpus), a larger qwen_edit.memory.budget_gb "
        'where the GPU has more, data.cache "auto" (no encoders on the GPU: more blocks stay there), a smaller '
        "qwen_edit.data.area, or more free host memory (fewer qwen_edit.data.num_workers, other jobs)"
    )


def render_note(
    s: Sizes,
    m: Measured,
    c: Choice,
    pred: Prediction,
    budget: float,
    margin: float,
    fixed: dict,
    fp8_ok: bool,
    online: bool,
    offload_blocker: str | None = None,
    host: Host = UNCOUNTED_HOST,
) -> str:
    """The plan line's words on validation renders: their predicted peak and, when they changed the plan (the VAE
    decode tiled, or a slower step than the step alone needs), what and why, naming the keys that lower a render.
    "" with validation off."""
    if m.render_forward_bytes is None:
        return ""
    text = f"; a validation render peaks at {pred.render_peak_bytes / GB:.1f} GB"
    alone = choose(
        s,
        dataclasses.replace(m, render_forward_bytes=None),
        budget,
        margin,
        fixed,
        fp8_ok,
        online,
        offload_blocker,
        host,
    )
    if isinstance(alone, NoFit):
        return text
    alone_choice, alone_pred = alone
    if dataclasses.replace(c, vae_tiling=None) == alone_choice:
        if not c.vae_tiling:
            return text
        untiled = predict(s, m, dataclasses.replace(c, vae_tiling=False)).render_peak_bytes
        return (
            f"{text} with inference.vae_tiling = true, which the plan chose: untiled it would need "
            f"{untiled / GB:.1f} GB, and the step is the same either way"
        )
    tilings = [fixed["inference.vae_tiling"]] if "inference.vae_tiling" in fixed else [False, True]
    needs = min(predict(s, m, dataclasses.replace(alone_choice, vae_tiling=t)).render_peak_bytes for t in tilings)
    pinned = " (inference.vae_tiling is set false in the config)" if tilings == [False] else ""
    return (
        f"{text}; the renders set this plan: the step alone would fit with {describe(alone_choice, s.num_blocks)} "
        f"(~{alone_pred.step_s:.2f} s per micro-batch), but its render would need {needs / GB:.1f} GB{pinned}. "
        f"{oom_advice('validation', 1)}"
    )


def host_step_note(pred: Prediction) -> str:
    """The plan line's words on the host optimizer step, "" without the optimizer offload."""
    if not pred.optimizer_s:
        return ""
    return (
        f", plus ~{pred.optimizer_s:.1f} s per optimizer step on the host (DeepSpeedCPUAdam; an allowance, "
        "docs/performance.md 'The last resort'): zero_optimization.offload_optimizer was the only way to fit"
    )


def pinned_note(s: Sizes, c: Choice, host: Host) -> str:
    """The plan line's words on the pinned host memory of setting `c`, "" when it pins none."""
    pinned = host_bytes(s, c, host)
    if not pinned:
        return ""
    shared = " in one copy in /dev/shm" if host.shares(c.offloaded * moved_bytes(s, c.fp8_base)) else ""
    return (
        f", {pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es)"
        f"{shared}), of {host.available_bytes / GB:.1f} GB available"
    )


def plan_line(
    seconds: float,
    budget: float,
    margin: float,
    tokens: int,
    c: Choice,
    pred: Prediction,
    s: Sizes,
    host: Host,
    compiled: bool,
    allocator_words: str,
    render_words: str,
) -> str:
    """The line a run prints with its plan: the budget and margin, the largest micro-batch, the setting chosen, its
    predicted peak and step, and the notes on the host, the allocator and the validation renders."""
    return (
        f"memory plan ({seconds:.0f} s): budget {budget / GB:.1f} GB, margin {margin / GB:.1f} GB, "
        f"largest micro-batch {tokens} tokens -> {describe(c, s.num_blocks)}"
        f"{', compiled blocks' if compiled else ''}{allocator_words}; predicted peak "
        f"{pred.peak_bytes / GB:.1f} GB, ~{pred.step_s:.2f} s per micro-batch in the blocks"
        f"{host_step_note(pred)}{pinned_note(s, c, host)}{render_words}. Keys set in the config "
        'are kept; qwen_edit.memory.plan = "off" runs the config as written'
    )
