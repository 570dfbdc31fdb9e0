"""Qwen-Image-2.1's rotary embedding as real (cos, sin) pairs, so that compiled blocks fuse the rotation.

diffusers' 2.1 attention rotates q and k with its own copy of `apply_rotary_emb_qwen` (complex64 products, which
Inductor runs as eager kernels with float32 copies of q and k around them), and `QwenImage21Rope` returns one complex
tensor [S, D/2]. The change is the Qwen-Image MMDiT's (train/model/qwen_image/rope.py), pointed at the 2.1 module."""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_qwenimage21

from train.model.qwen_image import rope


def use_real_pairs(transformer: torch.nn.Module) -> None:
    """Make the 2.1 transformer's blocks rotate with real pairs (idempotent); call before the blocks are compiled."""
    rope.use_real_pairs(transformer, transformer_qwenimage21)
