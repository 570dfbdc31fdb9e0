"""train.rope: diffusers' complex RoPE redone in real arithmetic (fused by inductor in compiled blocks)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage

from train import rope
from train.make_tiny import build_transformer


def _freqs(seq: int, half: int) -> torch.Tensor:
    angles = torch.rand(seq, half) * 6.3
    return torch.polar(torch.ones_like(angles), angles)  # complex64, as QwenEmbedRope returns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_diffusers_complex_path(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16, dtype=dtype)
    freqs = _freqs(9, 8)
    ref = rope._ORIGINAL(x, freqs, use_real=False)
    out = rope.rotate_pairs(x, freqs)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # fp32 rounding; bf16: one rounding of the same fp32 value
    assert (out.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
    # a rotation the other way (conjugate frequencies) is far off: the comparison can fail
    wrong = rope.rotate_pairs(x, freqs.conj())
    assert (wrong.float() - ref.float()).abs().max().item() > 0.1


def test_gradients_match():
    torch.manual_seed(1)
    x = torch.randn(1, 5, 2, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    freqs, g = _freqs(5, 4), torch.randn(1, 5, 2, 8)
    rope._ORIGINAL(x, freqs, use_real=False).backward(g)
    rope.rotate_pairs(x2, freqs).backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)


def test_installed_transformer_gives_the_same_output():
    """The whole tiny transformer with the real-arithmetic RoPE installed (as compiled training does) against
    diffusers' own; use_real=True calls still reach diffusers' function."""
    torch.manual_seed(2)
    model = build_transformer().eval()
    inner = model.config.num_attention_heads * model.config.attention_head_dim
    h, w = 4, 6
    kwargs = {"hidden_states": torch.randn(1, 2 * h * w, model.config.in_channels),
              "encoder_hidden_states": torch.randn(1, 7, model.config.joint_attention_dim),
              "timestep": torch.tensor([0.3]), "img_shapes": [[(1, h, w), (1, h, w)]], "return_dict": False}
    assert inner > 0
    with torch.no_grad(), rope.diffusers_rope():
        ref = model(**kwargs)[0]
    previous = transformer_qwenimage.apply_rotary_emb_qwen
    try:
        rope.install()
        assert rope.installed()
        with torch.no_grad():
            out = model(**kwargs)[0]
        cos_sin = (torch.ones(3, 4), torch.zeros(3, 4))
        y = torch.randn(1, 2, 3, 4)
        torch.testing.assert_close(rope.apply_rotary_emb_real(y, cos_sin, use_real=True), y)  # identity rotation
    finally:
        transformer_qwenimage.apply_rotary_emb_qwen = previous
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.abs().max().item() > 0
