"""Rotary position embedding as real (cos, sin) pairs, so that compiled transformer blocks fuse it.

diffusers' Qwen-Image transformer computes complex frequencies once per forward (`pos_embed`) and each block's
attention rotates q and k with `apply_rotary_emb_qwen(x, freqs, use_real=False)`: x viewed as complex pairs,
multiplied by the complex64 frequencies. Inductor generates no code for complex tensors, so in a compiled block
that product and its backward run as eager complex64 kernels, with float32 copies of q and k written around them
(docs/levers.md, lever 15).

`use_real_pairs(transformer)` changes two things, both dispatching on the tensor type so that nothing else is
affected:
- a forward hook on the transformer's `pos_embed` returns the same frequencies as float32 views [S, D/2, 2]
  (`torch.view_as_real`: no copy), so the compiled blocks receive real tensors;
- diffusers' module-level `apply_rotary_emb_qwen` is wrapped by `rotating`: the wrapper multiplies such pairs in
  float32, (a + ib)(c + id) = (ac - bd) + i(ad + bc), exactly as the complex product is defined, and casts back to
  x's dtype. Complex frequencies (any other transformer, or this one before the hook) go to diffusers' function.
Qwen-Image-2.1's module carries a copy of the same function and its `pos_embed` returns one complex tensor
instead of a tuple: `use_real_pairs(transformer, transformer_qwenimage21)` makes the same change there
(train/model/qwen_image21/rope.py).
tests/test_rope.py checks the result and the gradients against diffusers' complex path.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_qwenimage

_DIFFUSERS = transformer_qwenimage.apply_rotary_emb_qwen


def rotate_pairs(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] rotated by pairs [S, D/2, 2] = (cos, sin) per position and frequency (float32 product)."""
    xr = x.float().unflatten(-1, (-1, 2))  # B S H D/2 2
    a, b = xr[..., 0], xr[..., 1]
    c, d = pairs[:, None, :, 0], pairs[:, None, :, 1]  # S 1 D/2: broadcast over heads
    return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x)


def rotating(original):
    """A drop-in for `original` (a diffusers module's apply_rotary_emb_qwen) that also takes real (cos, sin) pairs;
    every other call goes to `original`."""

    def rotate(x: torch.Tensor, freqs_cis, use_real: bool = True, use_real_unbind_dim: int = -1) -> torch.Tensor:
        if use_real or not torch.is_tensor(freqs_cis) or freqs_cis.is_complex():
            return original(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)
        return rotate_pairs(x, freqs_cis)

    rotate.original = original
    return rotate


def _real_pairs_hook(module, args, output):
    if torch.is_tensor(output):  # Qwen-Image-2.1's pos_embed: one tensor
        return torch.view_as_real(output) if output.is_complex() else output
    return tuple(torch.view_as_real(f) if torch.is_tensor(f) and f.is_complex() else f for f in output)


def use_real_pairs(transformer: torch.nn.Module, diffusers_module=transformer_qwenimage) -> None:
    """Make `transformer`'s blocks rotate with real pairs (idempotent); call before the blocks are compiled.
    `diffusers_module`: the diffusers module whose attention calls apply_rotary_emb_qwen (the MMDiT's by default)."""
    if not hasattr(diffusers_module.apply_rotary_emb_qwen, "original"):  # not wrapped yet
        diffusers_module.apply_rotary_emb_qwen = rotating(diffusers_module.apply_rotary_emb_qwen)
    pos_embed = transformer.pos_embed
    if not getattr(pos_embed, "_qwen_edit_real_pairs", False):
        pos_embed.register_forward_hook(_real_pairs_hook)
        pos_embed._qwen_edit_real_pairs = True
