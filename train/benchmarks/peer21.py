"""The peer for Qwen-Image-2.1: DiffSynth-Studio's `QwenImage21DiT`, trained as DiffSynth's trainer trains a 2.1 LoRA.

The installed `diffsynth` package is loaded as peer.py loads it (its folders registered without running their
`__init__` files); nothing of it is copied here. What the two peers share (the scheduler's loss, LoRA, quantisation,
compilation, AdamW, the variants) is peer.py's; this module holds what differs. One training step, as DiffSynth
2.1.12 runs it (each item names the file of the installed package it follows, or of its repository's example):

- model (`models/qwen_image_21_dit.py`): `QwenImage21DiT(**config)` with the project's transformer config (the same
  keyword arguments as diffusers' `QwenImage21Transformer2DModel`: the released architecture, `--num_layers` deep, or
  the tests' tiny one), built here at random init in bf16 (its loader builds it in the pipeline dtype, bf16, then
  loads the weights).
- frozen base (`diffusion/base_pipeline.py` freeze_except): every weight frozen, the module in eval mode.
- quantised base (`core/quant`): as for the MMDiT's peer (peer.quantize_base).
- LoRA (`diffusion/training_module.py` add_lora_to_model): peft `inject_adapter_in_model`, alpha = rank, the LoRA
  weights cast to bf16. The example script (examples/qwen_image_21/model_training/lora/Qwen-Image-2.1.sh, rank 32)
  passes `--lora_target_modules ""`, so `auto_detect_lora_target_modules` picks every nn.Linear of the block list
  with both sides >= 512: at the released width the 7 linears of every block, which is `--lora_targets default`.
  The benchmark passes the project's `--lora_targets` to both, so both train the same modules at any size.
- inputs (`pipelines/qwen_image_21.py` units, as its training passes them on): the prompt embeddings (1, T, 4096)
  with one image slot per 2x2 group of each reference's latents (`edit_image_pad_mask`), no prompt mask (the unit
  drops an all-ones one), the target's latents (1, 64, h, w) and each reference's (`edit_latents`). The slots sit
  after two text tokens each and the rest of the text follows them, as the project's synthetic batch lays them.
- loss (`diffusion/loss.py` FlowMatchSFTLoss, `diffusion/flow_match.py`'s "Qwen-Image" schedule): peer.FlowMatchLoss.
- forward (`pipelines/qwen_image_21.py` model_fn_qwen_image_21; that file imports the text encoder, VAE and
  ControlNet modules and the pipeline base, which pull in the whole library, so `forward` below makes its calls in
  its order): img_shapes references then target, every latent flattened to (B, h w, C) (`patchify`, patch 1), the
  target's slots (its tokens / 4) appended to the pad mask, references before the target along the sequence, the
  DiT called with timestep / 1000, `use_gradient_checkpointing` and no flex attention (the trainer passes none: the
  DiT's split SDPA path), the last target tokens kept and unflattened.
- checkpointing: the example script passes `--use_gradient_checkpointing`; here `--checkpointing full` turns it on.
- optimizer and compile: peer.trainer and peer.compile_blocks (its `compile_pipeline` compiles the DiT's
  `_repeated_blocks`, `QwenImage21TransformerBlock`, as it compiles the MMDiT's).
- attention (`core/attention/attention.py`): the DiT's masked calls run torch's SDPA; its unmasked ones run the
  implementation DiffSynth picks at import (FlashAttention-4, 3 or 2 where installed, else SDPA). A variant's third
  field sets it (`bf16:compile:torch`), so its fastest configuration is measured whatever is installed.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from train.benchmarks import peer

TOKENS_PER_SLOT = 4  # one VL image slot stands for 2x2 latent tokens
TEXT_BEFORE_SLOTS = 2  # text tokens before each reference's slots (as the project's synthetic batch)


def load_dit_module():
    """`models.qwen_image_21_dit` of the installed package; its `core` imports first, so that the relative imports
    find them without running `core/__init__` (which imports the dataset code and its dependencies)."""
    peer.load("core.attention")
    peer.load("core.gradient")
    return peer.load("models.qwen_image_21_dit")


def build_dit(config: dict, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The peer's QwenImage21DiT at random init from a diffusers transformer config (keys it does not take, such as
    diffusers' own `_class_name`, are left out), created on `device` in `dtype`."""
    cls = load_dit_module().QwenImage21DiT
    taken = set(inspect.signature(cls.__init__).parameters) - {"self"}
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights created in `dtype` directly: no fp32 copy of 7 B parameters
    try:
        with torch.device(device):
            return cls(**{k: v for k, v in config.items() if k in taken})
    finally:
        torch.set_default_dtype(saved)


@dataclass
class Inputs:
    """One sample as the pipeline's units hand it to model_fn_qwen_image_21."""

    target: torch.Tensor  # (1, C, h, w) latents
    references: list[torch.Tensor]  # each (1, C, h, w)
    prompt_emb: torch.Tensor  # (1, T, D): text positions and image slots
    pad_mask: torch.Tensor  # (1, T) bool, True at the references' image slots


def make_inputs(
    dit: torch.nn.Module,
    latent_hw: tuple[int, int],
    refs: int,
    text_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> Inputs:
    """Random latents and prompt embeddings of the workload's shapes: `text_tokens` text positions, references at the
    target's latent size."""
    g = torch.Generator(device).manual_seed(seed)
    h, w = latent_hw
    channels, width = dit.img_in.in_features, dit.txt_in.in_layer.in_features
    latents = [torch.randn(1, channels, h, w, generator=g, device=device).to(dtype) for _ in range(1 + refs)]
    slots_per_ref = h * w // TOKENS_PER_SLOT
    pad = torch.zeros(1, text_tokens + refs * slots_per_ref, dtype=torch.bool, device=device)
    for k in range(refs):
        start = TEXT_BEFORE_SLOTS * (k + 1) + k * slots_per_ref
        pad[0, start : start + slots_per_ref] = True
    prompt = torch.randn(1, pad.shape[1], width, generator=g, device=device).to(dtype)
    return Inputs(latents[0], latents[1:], prompt, pad)


def _flatten(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H W, C): one token per latent pixel (model_fn's patchify)."""
    return latents_BCHW.flatten(2).transpose(1, 2)


def forward(
    dit: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, x: Inputs, checkpointing: bool
) -> torch.Tensor:
    """The noise prediction for the target latents: the calls of model_fn_qwen_image_21 for an edit (or, without
    references, a text-to-image) sample."""
    h, w = latents.shape[2:]
    img_shapes = [[*[(1, r.shape[2], r.shape[3]) for r in x.references], (1, h, w)]]
    target = _flatten(latents)
    target_slots = torch.ones(1, target.shape[1] // TOKENS_PER_SLOT, dtype=torch.bool, device=latents.device)
    pad_mask = torch.cat([x.pad_mask, target_slots], dim=1)
    hidden = torch.cat([*(_flatten(r) for r in x.references), target], dim=1)
    out = dit(
        hidden_states=hidden,
        timestep=timestep / peer.TRAIN_TIMESTEPS,
        encoder_hidden_states=x.prompt_emb,
        encoder_hidden_states_mask=None,
        img_shapes=img_shapes,
        img_mask=pad_mask,
        use_gradient_checkpointing=checkpointing,
        use_gradient_checkpointing_offload=False,
        use_flex_attention=False,
    )
    return out[:, -target.shape[1] :].transpose(1, 2).reshape(latents.shape)


def build(
    variant: peer.Variant,
    config: dict,
    latent_hw: tuple[int, int],
    refs: int,
    text_tokens: int,
    targets: list[str],
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    checkpointing: bool = False,
) -> peer.Setup:
    """The peer's 2.1 DiT from the transformer `config`, its inputs, and DiffSynth's trainer around it
    (peer.trainer: quantised base, LoRA, compiled blocks, AdamW, the step)."""
    torch.manual_seed(seed)
    dit = build_dit(config, device, dtype)
    loss_fn = peer.FlowMatchLoss(device, dtype)
    x = make_inputs(dit, latent_hw, refs, text_tokens, device, dtype, seed)

    def loss() -> torch.Tensor:
        return loss_fn(x.target, lambda noisy, t: forward(dit, noisy, t, x, checkpointing))

    attention = use_attention(variant.attention)
    return dataclasses.replace(peer.trainer(dit, variant, targets, rank, dtype, loss), attention=attention)


def use_attention(name: str) -> str:
    """DiffSynth's attention implementation for the DiT's calls from now on (its module global, read at each call):
    `name`, or for "" the one DiffSynth picks itself (its import-time priority: an installed flash-attention build
    before torch's SDPA, or DIFFSYNTH_ATTENTION_IMPLEMENTATION). Returns the implementation set."""
    module = peer.load("core.attention.attention")
    module.ATTENTION_IMPLEMENTATION = name or module.initialize_attention_priority()
    return module.ATTENTION_IMPLEMENTATION
