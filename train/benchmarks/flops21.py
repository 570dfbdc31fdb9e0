"""Model FLOPs of Qwen-Image-2.1's training step (the single-stream DiT, QwenImage21Transformer2DModel); flops.py
has the Qwen-Image MMDiT's and the MFU. Recomputation under checkpointing is not counted.

    FLOPs per step = k_lin x F_lin + 3 x F_attn   (forward once, backward twice the forward where it is computed)
      k_lin = 2 for LoRA: the frozen base's forward GEMMs and their input-gradient GEMMs, no weight gradients (the
              base is frozen); LoRA's own small GEMMs are ignored. 3 for full fine-tuning (weight gradients too).
              As for the MMDiT, every linear counts its input gradient, even the few whose input needs none.
      F_lin  = 2 x sum over the nn.Linear layers of rows x in_features x out_features, per micro-batch of B:
               B x L rows for every linear of the 32 blocks (attn.to_q/k/v, attn.to_out.0, img_mlp.proj/gate_layer/
               out) and proj_out (the model predicts every position of the joint sequence; the loss reads the
               target's), L = text + reference + target tokens;
               B x (text + image slots) rows for txt_in (the prompt embeddings hold one slot per 2x2 group of each
               reference's latents; the slots are replaced by the references' tokens after it);
               B x (reference + target tokens) rows for img_in;
               B + 1 rows for time_text_embed, modulation and norm_out.linear (causal_condition adds one t = 0 row
               that the text and references read).
      F_attn = B x blocks x 4 x inner_dim x P   (QK^T and AV), P = the (query, key) pairs the block-causal mask
               allows: L(L+1)/2 (causal) + n(n-1)/2 for each image block of n tokens (bidirectional within it; the
               target, last, thereby sees every key). Only allowed pairs are counted, not what a kernel computes
               around them (flex's 128 x 128 tiles, the segmented processor's dense text masks).

Sanity figures (LoRA, 1024^2 target, 256 text tokens, the released 32 blocks): text-to-image L = 4352, about
1.50e14 FLOPs per step; one 1024^2 reference, L = 8448, about 3.19e14; three, L = 16640, about 7.36e14 (so 1 s/step
is 15%, 32% and 74% MFU of 989 TFLOP/s).
"""

from __future__ import annotations

import re

import torch

from train.benchmarks.flops import classify

IMG_TOKENS_PER_SLOT = 4  # one VL image slot stands for 2x2 latent tokens
# Whose rows each nn.Linear sees; the first pattern that matches the module name wins.
_ROWS = (
    ("vector", re.compile(r"(^|\.)(time_text_embed\..+|modulation\.\d+|norm_out\.linear)$")),
    ("prompt", re.compile(r"(^|\.)txt_in\..+$")),
    ("image", re.compile(r"(^|\.)img_in$")),
    ("joint", re.compile(r"(^|\.)(transformer_blocks\.\d+\..+|proj_out)$")),
)


def linear_rows(name: str) -> str:
    """'joint', 'prompt', 'image' or 'vector': whose rows the nn.Linear called `name` sees."""
    return classify(name, _ROWS, "rows; extend _ROWS in train/benchmarks/flops21.py")


def joint_tokens(text_tokens: int, image_blocks: list[int]) -> int:
    """L: text positions plus every image block's tokens (references, then the target)."""
    return text_tokens + sum(image_blocks)


def forward_linear_flops(model: torch.nn.Module, text_tokens: int, image_blocks: list[int], batch: int = 1) -> float:
    """2 x rows x in x out over the model's nn.Linear layers (LoRA's own layers skipped), for a micro-batch of
    `batch` samples of `text_tokens` text positions and image blocks of `image_blocks` tokens (target last)."""
    slots = sum(image_blocks[:-1]) // IMG_TOKENS_PER_SLOT
    vector_rows = batch + 1 if model.config.causal_condition else batch
    rows = {
        "joint": batch * joint_tokens(text_tokens, image_blocks),
        "prompt": batch * (text_tokens + slots),
        "image": batch * sum(image_blocks),
        "vector": vector_rows,
    }
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            total += 2 * rows[linear_rows(name)] * module.in_features * module.out_features
    return float(total)


def allowed_pairs(text_tokens: int, image_blocks: list[int]) -> int:
    """(query, key) pairs of one sample the block-causal mask allows (no padding)."""
    length = joint_tokens(text_tokens, image_blocks)
    return length * (length + 1) // 2 + sum(n * (n - 1) // 2 for n in image_blocks)


def forward_attention_flops(model: torch.nn.Module, text_tokens: int, image_blocks: list[int], batch: int = 1) -> float:
    """QK^T and AV over the allowed pairs: batch x blocks x 4 x inner_dim x pairs."""
    return float(batch * len(model.transformer_blocks) * 4 * model.inner_dim * allowed_pairs(text_tokens, image_blocks))


def step_flops(model: torch.nn.Module, text_tokens: int, image_blocks: list[int], mode: str, batch: int = 1) -> float:
    """Model FLOPs of one training step of `batch` samples on one GPU (see the module docstring)."""
    k_lin = 2 if mode == "lora" else 3
    linear = forward_linear_flops(model, text_tokens, image_blocks, batch)
    return k_lin * linear + 3 * forward_attention_flops(model, text_tokens, image_blocks, batch)
