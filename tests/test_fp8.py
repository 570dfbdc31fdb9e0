"""train.model.fp8: frozen e4m3 base weights with fp8 matmuls (torch._scaled_mm runs on CPU too), and the partial
checkpointing helper used with it. The GPU speed and loss-curve figures are in docs/performance.md."""

from __future__ import annotations

import pytest
import torch
from conftest import transformer_inputs

from train.config import LoraConfig
from train.model import family, fp8, prepare
from train.model.qwen_image.tiny import build_transformer

KIND = family.family_named("qwen_image").fp8_kind


def _linear(n_in: int, n_out: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight[3] *= 40  # one row with a much larger range: per-row scales keep the others precise
    return lin.requires_grad_(False)


@pytest.mark.parametrize("kind", ["token", "vector"])
def test_float8_linear_matches_the_linear(kind):
    """Outputs and input gradients within e4m3's rounding (3 mantissa bits: a few % per element, ~2-4% in norm)."""
    lin = _linear(64, 48)
    q = fp8.Float8FrozenLinear(lin, kind)
    x = torch.randn(5, 7, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = q(x), lin(x_ref)
    assert y.shape == y_ref.shape
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 0.05
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert ((x.grad - x_ref.grad).norm() / x_ref.grad.norm()).item() < 0.05
    # the large row did not swamp the others: each output column is as precise as the whole
    err = (y - y_ref).norm(dim=(0, 1)) / y_ref.norm(dim=(0, 1))
    assert err.max().item() < 0.08


def test_float8_linear_is_not_a_crude_copy():
    """The test above can fail: a weight rounded to e5m2 (2 mantissa bits) and no scale misses the bound."""
    lin = _linear(64, 48)
    crude = lin.weight.to(torch.float8_e5m2).float()
    x = torch.randn(35, 64)
    ref = x @ lin.weight.T
    assert ((x @ crude.T - ref).norm() / ref.norm()).item() > 0.05


def test_convert_swaps_frozen_block_linears_and_keeps_lora():
    """Under LoRA the blocks' 12 token linears (peft's base_layer where wrapped) and 2 modulation linears become
    e4m3; embeddings/output stay; only LoRA trains; checkpoints (state_dict) hold no fp8 buffers."""
    model = build_transformer()
    prepare.add_lora(model, LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_k"]))
    before = {n for n, p in model.named_parameters() if p.requires_grad}
    assert fp8.convert_frozen_linears(model, KIND) == len(model.transformer_blocks) * 14
    block = model.transformer_blocks[0]
    assert isinstance(block.attn.to_q.base_layer, fp8.Float8FrozenLinear)  # wrapped by LoRA
    assert isinstance(block.img_mlp.net[2], fp8.Float8FrozenLinear)  # not wrapped
    assert block.img_mod[1].kind == "vector"
    assert type(model.img_in) is torch.nn.Linear and type(model.proj_out) is torch.nn.Linear
    assert {n for n, p in model.named_parameters() if p.requires_grad} == before
    assert not any("weight_fp8" in k or "weight_scale" in k for k in model.state_dict())


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_lora_learns_through_fp8_base(zero_cond_t):
    """A forward/backward through the converted tiny model gives LoRA gradients close to the unquantised reference;
    also with 2511's zero_cond_t, where the modulation ("vector") linears take [t, 0]: twice the batch."""
    import copy

    torch.manual_seed(0)
    model = build_transformer(zero_cond_t)
    prepare.add_lora(model, LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_v"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    reference = copy.deepcopy(model)
    fp8.convert_frozen_linears(model, KIND)
    inputs = transformer_inputs(model)
    grads = []
    for m in (model, reference):
        m(**inputs)[0].square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad]))
    assert torch.isfinite(grads[0]).all()
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item() > 0.99


def test_fp8_refuses_a_trainable_base():
    model = build_transformer().requires_grad_(True)
    with pytest.raises(ValueError, match="frozen base"):
        fp8.convert_frozen_linears(model, KIND)


@pytest.mark.parametrize("count, expected", [(0, 2), (1, 1)])
def test_checkpoint_first_recomputes_only_the_first_blocks(monkeypatch, count, expected):
    """train.checkpoint_blocks: diffusers hands every block to the function; only the first N are checkpointed."""
    import torch.utils.checkpoint as ckpt

    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))
    model = build_transformer()
    prepare.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]),
                                gradient_checkpointing=True, compile_blocks=False, checkpoint_blocks=count)
    model.train()
    out = model(**transformer_inputs(model))[0]
    out.mean().backward()
    assert len(calls) == expected


def test_kept_transposed_weight_gives_the_same_gradient():
    """keep_transposed stores W8^T once; outputs and input gradients are bitwise those of the per-call transpose,
    and the stored copy is the transpose (a vector linear keeps none)."""
    lin = _linear(64, 48)
    plain, kept = fp8.Float8FrozenLinear(lin, "token"), fp8.Float8FrozenLinear(lin, "token", keep_transposed=True)
    assert plain.weight_fp8_t is None and torch.equal(kept.weight_fp8_t.float(), kept.weight_fp8.float().t())
    assert fp8.Float8FrozenLinear(lin, "vector", keep_transposed=True).weight_fp8_t is None
    x = torch.randn(3, 5, 64)
    grads = []
    for layer in (plain, kept):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(torch.ones_like(y))
        grads.append((y.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert "weight_fp8_t" not in kept.state_dict()


@pytest.mark.parametrize("fast", [False, True])
def test_fast_accumulation_reaches_both_matmuls(monkeypatch, fast):
    """train.fp8_fast_accum, as prepare_for_training passes it: every token linear's forward and input-gradient
    `_scaled_mm` gets use_fast_accum=fast; the modulation linears (no fp8 matmul) are left as they are."""
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum"))
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    torch.manual_seed(0)
    model = build_transformer()
    lora = LoraConfig(rank=4, alpha=4.0, target_modules=list(family.family_named("qwen_image").lora.targets))
    prepare.prepare_for_training(model, "lora", lora, False, False, fp8_base=True,
                                    real_rope=False, fp8_fast_accum=fast)
    linears = [m for m in model.modules() if isinstance(m, fp8.Float8FrozenLinear)]
    assert [m.fast_accum for m in linears] == [fast and m.kind == "token" for m in linears]
    loss = model(**transformer_inputs(model))[0].square().mean()
    forward = len(calls)
    loss.backward()  # an input gradient wherever the input needs one (not block 0's text stream: 15 of 24 here)
    assert forward == sum(m.kind == "token" for m in linears) and len(calls) > forward, (forward, len(calls))
    assert set(calls) == {fast}


def test_qwen_image21_blocks_convert_by_its_record():
    """Qwen-Image-2.1's record names its 7 block linears (attention and SwiGLU MLP, all token linears; the shared
    modulation is outside the blocks): under its default LoRA they become e4m3 and the output stays close."""
    from copy import deepcopy as model_copy

    from train.model.qwen_image21.tiny import build_transformer as build_21

    fam = family.family_named("qwen_image21")
    torch.manual_seed(0)
    model = build_21()
    prepare.add_lora(model, LoraConfig(rank=4, alpha=4.0, target_modules=list(fam.lora.targets)))
    assert [fam.fp8_kind(n) for n, _ in model.named_modules() if n.startswith("modulation")] == [None, None, None]
    reference = model_copy(model)
    assert fp8.convert_frozen_linears(model, fam.fp8_kind) == len(model.transformer_blocks) * 7
    x = torch.randn(1, 64, 64)
    ours, theirs = model.transformer_blocks[0].img_mlp(x), reference.transformer_blocks[0].img_mlp(x)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.1
