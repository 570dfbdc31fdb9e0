"""The transformer in its training form, for any model family: LoRA on a frozen base (optionally stored in fp8) or
every weight trainable, then block offloading, activation checkpointing and compiled blocks. The family's record
(train/model/family.py, found from the transformer's class) names its blocks and its compile-friendly rotary
embedding."""

from __future__ import annotations

from pathlib import Path

import torch

from train.config import LoraConfig
from train.config.files import transformer_class
from train.model import family, fp8, kept_attention, streaming
from train.model.loading import streamed_transformer


def add_lora(transformer, lora: LoraConfig, adapter_name: str = "default") -> None:
    """Freeze the transformer and add a peft LoRA adapter on `lora.target_modules` of every block."""
    from peft import LoraConfig as PeftLoraConfig

    assert lora.target_modules is not None, "the family's default targets are filled in first (with_family_defaults)"
    names = [n for n, _ in transformer.named_modules()]
    unmatched = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        fam = family.transformer_family(transformer)
        raise ValueError(
            f"qwen_edit.lora.target_modules: {unmatched} match no module of the transformer; names look like "
            f"{fam.lora.targets[0]!r}, {fam.lora.targets[-1]!r} (suffixes of {fam.block_list}.N.*)"
        )
    transformer.requires_grad_(False)
    transformer.add_adapter(
        PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=list(lora.target_modules)),
        adapter_name=adapter_name,
    )


def prepare_for_training(transformer, mode: str, lora: LoraConfig, gradient_checkpointing: bool,
                         compile_blocks: bool, fp8_base: bool = False, checkpoint_blocks: int = 0,
                         fp8_transposed: bool = False, real_rope: bool = True,
                         quantized: dict | None = None, offload: set[int] | None = None,
                         compile_mode: str | None = None, share=None, kept_attention_blocks: int = 0,
                         fp8_fast_accum: bool = False, attention: str = "auto"):
    """LoRA on a frozen base (optionally stored in fp8) or every weight trainable; then block offloading,
    activation checkpointing and compiled blocks. real_rope: the family's rotary embedding that compiled blocks fuse
    (the same rotation; Qwen-Image: real pairs). quantized: fp8 weights already made by the streaming loader.
    offload: indices of blocks whose frozen weights live in pinned host memory (train/model/offload.py); they must be
    among the checkpointed ones. compile_mode: torch.compile's mode for the blocks (None: its default).
    share: the node's shared host copy of the offloaded blocks (offload.NodeShare), or None for this process's own.
    kept_attention_blocks: how many of the checkpointed blocks (the first ones) keep their attention output for the
    recomputation (train/model/kept_attention.py); -1 = all of them. fp8_fast_accum: the fp8 matmuls accumulate
    fast (train.fp8_fast_accum). attention: train.attention, for a family whose record sets its processors.
    Returns the BlockOffloader, or None."""
    offload = offload or set()
    fam = family.transformer_family(transformer)
    blocks = fam.blocks(transformer)
    if mode == "lora":
        add_lora(transformer, lora)
        if fp8_base:
            check_fp8_device()
            # Offloaded blocks keep no transposed copy: it would double what crosses the bus every use.
            fp8.convert_frozen_linears(
                transformer, fam.fp8_kind, lambda name: fp8_transposed and fam.block_index(name) not in offload,
                quantized, fp8_fast_accum)
    else:
        transformer.requires_grad_(True)
    offloader = None
    if offload:
        from train.model.offload import BlockOffloader

        offloader = BlockOffloader({i: blocks[i] for i in sorted(offload)}, _device_of(transformer, fam.block_list),
                                     share=share)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing(
            checkpoint_first(blocks, checkpoint_blocks, kept_attention_blocks, fam.attention_module))
    if real_rope and fam.real_rope is not None:
        fam.real_rope(transformer)
    if fam.training_forward is not None:
        fam.training_forward(transformer)
    if fam.set_attention is not None:  # CUDA is where the plan, DeepSpeed or the model-parallel split place it
        fam.set_attention(transformer, attention, compile_blocks and torch.cuda.is_available())
    if compile_blocks:
        for block in blocks:
            # in place, so the DeepSpeed engine wraps the same modules; the blocks share one graph
            block.compile(**({"mode": compile_mode} if compile_mode else {}))
    return offloader


def freeze_unreached(transformer) -> int:
    """Freeze the trainable weights that no output of the transformer reaches (its family's `unreached` modules of
    the last block: the Qwen-Image MMDiT drops the text stream after its last attention); returns how many. They
    train nothing either way, but DeepCompile's ZeRO-1/2 pass looks up a gradient for every trainable weight among
    a compiled graph's inputs and fails on one without (DeepSpeed 0.19.8, add_z1_reduce_bw in
    deepspeed/compile/passes/zero_1_and_2_compile.py)."""
    fam = family.transformer_family(transformer)
    last = fam.blocks(transformer)[-1]
    frozen = [p for name in fam.unreached for p in last.get_submodule(name).parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def _device_of(module: torch.nn.Module, block_list: str) -> torch.device:
    """The training device: where the non-block weights are (they are never offloaded)."""
    return next(p.device for name, p in module.named_parameters() if not name.startswith(f"{block_list}."))


def load_for_training(model_dir: str | Path, dtype: torch.dtype, device: torch.device, mode: str,
                      lora: LoraConfig, gradient_checkpointing: bool, compile_blocks: bool, fp8_base: bool = False,
                      checkpoint_blocks: int = 0, fp8_transposed: bool = False, offload_blocks: int = 0,
                      share=None, kept_attention_blocks: int = 0, fp8_fast_accum: bool = False,
                      attention: str = "auto"):
    """(transformer, offloader or None) streamed from `model_dir` straight into its training form
    (train/model/streaming.py: fp8 weights quantised one by one on the device, offloaded blocks' weights kept on the
    host), then prepared as prepare_for_training does. The first `offload_blocks` blocks are offloaded. share: the
    node's shared host copy of them (memory.offload_share), or None; a process that is not its writer does not read
    the offloaded weights."""
    fam = family.transformer_family(transformer_class(Path(model_dir) / "transformer"))
    placement = streaming.Placement(device, dtype, fp8=fam.fp8_kind if fp8_base and mode == "lora" else None,
                                    offload=set(range(offload_blocks)),
                                    skip_offloaded=share is not None and not share.writer)
    if fp8_base:
        check_fp8_device()
    transformer, quantized = streamed_transformer(model_dir, placement, frozen=mode == "lora")
    offloader = prepare_for_training(transformer, mode, lora, gradient_checkpointing, compile_blocks, fp8_base,
                                     checkpoint_blocks, fp8_transposed, quantized=quantized,
                                     offload=placement.offload, share=share,
                                     kept_attention_blocks=kept_attention_blocks, fp8_fast_accum=fp8_fast_accum,
                                     attention=attention)
    return transformer, offloader


def checkpoint_first(blocks, count: int, kept: int = 0, attention_module: str | None = None):
    """diffusers' gradient_checkpointing_func that recomputes the first `count` blocks (0 = all) and runs the
    others plainly (diffusers hands every block to this function while checkpointing is on). The first `kept` of
    the recomputed blocks (-1 = all) keep their attention output, so their recomputation skips the attention kernel
    (train/model/kept_attention.py: their attention processors are marked for it, and the dispatch of
    `attention_module`, the family's, routes them); a family without one keeps none."""
    from torch.utils.checkpoint import checkpoint

    selected = list(blocks) if count == 0 else list(blocks)[:count]
    keeping = [] if attention_module is None else selected if kept < 0 else selected[:kept]
    for block in keeping:
        kept_attention.keep(block, attention_module)
    keeping, selected = {id(b) for b in keeping}, {id(b) for b in selected}

    def call(block, *args):
        if id(block) in keeping:
            return checkpoint(kept_attention.Stash().run, block.__call__, *args, use_reentrant=False)
        if id(block) in selected:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    return call


def check_fp8_device() -> None:
    """fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer on CUDA; CPUs run them (slowly)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ValueError(f"qwen_edit.train.fp8_base: {name} has no fp8 matmuls (needs compute capability >= 8.9); "
                         "set fp8_base to false")


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
