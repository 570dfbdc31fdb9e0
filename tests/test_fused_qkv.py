"""train.fused_qkv: stacked fp8 q/k/v projections + stacked LoRA A inside diffusers' attention, on the tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from train import fp8, fused_qkv, models
from train.config import LoraConfig
from train.make_tiny import build_transformer

TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out"]


def _lora_fp8_model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_transformer()
    models.add_lora(model, LoraConfig(rank=4, alpha=4.0, dropout=dropout, target_modules=TARGETS))
    for name, p in model.named_parameters():  # B starts at zero: give it values so LoRA's path is exercised
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    fp8.convert_frozen_linears(model)
    return model


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    h, w = 4, 6
    hidden = torch.randn(1, 2 * h * w, 64, generator=g, requires_grad=True)
    text = torch.randn(1, 5, model.config.joint_attention_dim, generator=g)
    out = model(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                timestep=torch.tensor([0.4]), img_shapes=[[(1, h, w), (1, h, w)]], return_dict=False)[0]
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    # (the last block's text output is unused: its to_add_out gets no gradient)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return out.detach(), hidden.grad.clone(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fused_projections_match_the_per_layer_ones():
    """Same forward (the same quantised matmuls, stacked); gradients within e4m3 rounding of the output gradient's
    scale (one per row over 3N columns instead of N); the stack shares the layers' weight memory."""
    plain = _lora_fp8_model()
    fused = copy.deepcopy(plain)
    assert fused_qkv.install(fused) == len(fused.transformer_blocks)
    attn = fused.transformer_blocks[0].attn
    assert isinstance(attn.processor, fused_qkv.FusedQKVProcessor)
    assert attn.to_k.base_layer.weight_fp8.data_ptr() == attn.fused_qkv.weight_fp8[attn.to_q.out_features:].data_ptr()
    calls = []
    original = fused_qkv.StackedFloat8.forward
    fused_qkv.StackedFloat8.forward = lambda self, x: calls.append(x.shape) or original(self, x)
    try:
        out, dx, grads = _run(fused)
    finally:
        fused_qkv.StackedFloat8.forward = original
    assert len(calls) == 2 * len(fused.transformer_blocks)  # one per stream and block: the stacked path ran
    ref_out, ref_dx, ref_grads = _run(plain)
    assert _rel(out, ref_out) < 1e-5
    assert _rel(dx, ref_dx) < 0.05
    assert grads.keys() == ref_grads.keys()
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert 0 < worst < 0.05, worst
    lora_a = [n for n in grads if "to_v.lora_A" in n]
    assert lora_a and all(grads[n].abs().max() > 0 for n in lora_a)


def test_fused_with_transposed_stack_is_the_same():
    """keep_transposed stores one transposed stack (the layers' own transposed copies are dropped): bitwise the
    same outputs and gradients as transposing per call."""
    base = _lora_fp8_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    fused_qkv.install(a)
    fp8_b = [m for m in b.modules() if isinstance(m, fp8.Float8FrozenLinear)]
    for m in fp8_b:
        m.weight_fp8_t = m.weight_fp8.t().contiguous() if m.kind == "token" else None
    fused_qkv.install(b, keep_transposed=True)
    attn = b.transformer_blocks[0].attn
    assert attn.to_q.base_layer.weight_fp8_t is None and attn.to_out[0].base_layer.weight_fp8_t is not None
    assert torch.equal(attn.fused_qkv.weight_fp8_t.float(), attn.fused_qkv.weight_fp8.float().t())
    for x, y in zip(_run(a)[:2], _run(b)[:2], strict=True):
        assert torch.equal(x, y)


def test_lora_dropout_falls_back_to_diffusers_projections():
    """A layer the stacked path cannot express (LoRA dropout) runs diffusers' per-layer projections: bitwise the
    same as without the processor (eval mode, so dropout is the identity but still a Dropout module)."""
    plain = _lora_fp8_model(dropout=0.1).eval()
    fused = copy.deepcopy(plain)
    fused_qkv.install(fused)
    assert fused_qkv.project(fused.transformer_blocks[0].attn, "fused_qkv", torch.randn(1, 3, 64)) is None
    for x, y in zip(_run(fused)[:2], _run(plain)[:2], strict=True):
        assert torch.equal(x, y)


def test_prepare_for_training_installs_it_and_compiles_without_graph_breaks():
    """train.fused_qkv through the trainer's preparation; one block traced by dynamo in a single graph."""
    torch.manual_seed(0)
    model = build_transformer()
    models.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=TARGETS),
                                gradient_checkpointing=False, compile_blocks=False, fp8_base=True, fused_qkv=True)
    block = model.transformer_blocks[0]
    assert isinstance(block.attn.processor, fused_qkv.FusedQKVProcessor)
    g = torch.Generator().manual_seed(2)
    img, txt, temb = torch.randn(1, 12, 64, generator=g), torch.randn(1, 5, 64, generator=g), torch.randn(1, 64)
    freqs = (torch.randn(12, 8, 2, generator=g), torch.randn(5, 8, 2, generator=g))  # real pairs (train.rope)
    explained = torch._dynamo.explain(block)(img, txt, None, temb, freqs)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_fused_qkv_needs_fp8_base():
    with pytest.raises(ValueError, match="fp8_base"):
        models.prepare_for_training(build_transformer(), "lora", LoraConfig(rank=4, alpha=4.0, target_modules=TARGETS),
                                    gradient_checkpointing=False, compile_blocks=False, fp8_base=False, fused_qkv=True)
