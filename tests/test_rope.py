"""train.model.qwen_image.rope: real (cos, sin) rotary pairs give diffusers' complex rotation, forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import transformer_inputs
from diffusers.models.transformers import transformer_qwenimage

from train.model.qwen_image import rope
from train.model.qwen_image.tiny import build_transformer


def _complex_freqs(seq: int, half: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.polar(torch.ones(seq, half), torch.rand(seq, half, generator=g) * 6.3)


rotate = rope.rotating(rope._DIFFUSERS)  # the wrapper use_real_pairs installs in the MMDiT's module


def test_rotate_pairs_is_the_complex_product():
    """Against diffusers' own complex path, in bf16 (its rounding at the end) and in fp32; a wrong sign fails."""
    freqs = _complex_freqs(7, 8)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(2, 7, 3, 16).to(dtype)
        ref = rope._DIFFUSERS(x, freqs, use_real=False)
        got = rotate(x, torch.view_as_real(freqs), use_real=False)
        assert got.dtype == ref.dtype == dtype
        assert (got.float() - ref.float()).abs().max().item() < tol
    wrong = torch.view_as_real(freqs.conj().resolve_conj())  # rotation the other way
    assert (rotate(x, wrong, use_real=False).float() - ref.float()).abs().max().item() > 0.1


def test_rotate_passes_complex_and_real_mode_calls_through():
    x, freqs = torch.randn(1, 5, 2, 8), _complex_freqs(5, 4)
    assert torch.equal(rotate(x, freqs, use_real=False), rope._DIFFUSERS(x, freqs, use_real=False))
    x, cos, sin = torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8)  # that path is laid out B H S D
    assert torch.equal(rotate(x, (cos, sin), use_real=True), rope._DIFFUSERS(x, (cos, sin), use_real=True))


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = transformer_inputs(model, h=4, w=6, text_tokens=5, generator=g)  # a non-square grid for RoPE
    hidden, text = inputs["hidden_states"].requires_grad_(), inputs["encoder_hidden_states"].requires_grad_()
    out = model(**inputs)[0]
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    loss.backward()
    return loss.detach(), [hidden.grad, text.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_transformer_with_real_pairs_equals_diffusers(monkeypatch, zero_cond_t):
    """The whole tiny transformer, fp32: same loss and gradients as diffusers' complex path, and the blocks did
    take the real path (every rotation call counted); also with 2511's zero_cond_t."""
    monkeypatch.setattr(transformer_qwenimage, "apply_rotary_emb_qwen", rope._DIFFUSERS)
    torch.manual_seed(0)
    model = build_transformer(zero_cond_t)
    ref_loss, ref_grads = _loss_and_grads(model)
    model.zero_grad()
    rope.use_real_pairs(model)
    rope.use_real_pairs(model)  # idempotent: one hook
    assert len(model.pos_embed._forward_hooks) == 1
    calls = []
    original = rope.rotate_pairs
    monkeypatch.setattr(rope, "rotate_pairs", lambda x, p: calls.append(p.shape) or original(x, p))
    loss, grads = _loss_and_grads(model)
    assert len(calls) == 4 * len(model.transformer_blocks)  # img q, k and text q, k in each block
    assert all(len(s) == 3 and s[-1] == 2 for s in calls)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for got, ref in zip(grads, ref_grads, strict=True):
        assert (got is None) == (ref is None)
        if ref is None:  # a parameter the forward does not use
            continue
        assert (got - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1e-6)
