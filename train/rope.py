"""Rotary position embedding in real arithmetic, so compiled blocks fuse it.

diffusers' Qwen-Image attention rotates q and k with `apply_rotary_emb_qwen(x, freqs, use_real=False)`: x is
viewed as complex pairs and multiplied by the complex frequencies. Inductor does not generate code for complex
tensors, so inside a compiled block that multiply (and its backward) falls back to eager complex64 kernels with
fp32 copies of q and k around them: about 2% of a compiled 1024^2 LoRA step on an H200 (docs/perf_notes.md).

`install()` swaps that module-level function for one that does the same rotation on (real, imaginary) pairs:
    (a + ib)(c + id) = (ac - bd) + i(ad + bc)   in float32, cast back to x's dtype,
which inductor fuses into the surrounding normalisation kernels. The result equals diffusers' within float32
rounding (tests/test_rope.py). Calls with `use_real=True` go to diffusers' own function unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers.models.transformers import transformer_qwenimage

_ORIGINAL = transformer_qwenimage.apply_rotary_emb_qwen


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] times complex freqs [S, D/2] over consecutive (real, imaginary) pairs of x's last dim."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    c, d = freqs.real.unsqueeze(1), freqs.imag.unsqueeze(1)  # [S, 1, D/2]
    return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x)


def apply_rotary_emb_real(x: torch.Tensor, freqs_cis, use_real: bool = True, use_real_unbind_dim: int = -1):
    if use_real or not torch.is_complex(freqs_cis):
        return _ORIGINAL(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)
    return rotate_pairs(x, freqs_cis)


def install() -> None:
    """Route the Qwen-Image attention's complex RoPE through `apply_rotary_emb_real` (idempotent)."""
    transformer_qwenimage.apply_rotary_emb_qwen = apply_rotary_emb_real


def installed() -> bool:
    return transformer_qwenimage.apply_rotary_emb_qwen is apply_rotary_emb_real


@contextlib.contextmanager
def diffusers_rope() -> Iterator[None]:
    """Run with diffusers' complex RoPE (the benchmark's plain baseline loop), then restore what was installed."""
    current = transformer_qwenimage.apply_rotary_emb_qwen
    transformer_qwenimage.apply_rotary_emb_qwen = _ORIGINAL
    try:
        yield
    finally:
        transformer_qwenimage.apply_rotary_emb_qwen = current
