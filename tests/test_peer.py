"""The benchmark's peer (DiffSynth-Studio's QwenImageDiT, train/benchmarks/peer.py) and the fp8 implementations
compared with train/model/fp8.py (train/benchmarks/fp8_impls.py), on tiny models on the CPU.

The peer's tests need the bench extra (diffsynth, einops, torchao); `bash launch.sh test` installs it without
diffsynth's own dependencies. Without it they are skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import transformer_inputs

from train.benchmarks import build, fp8_impls, options, peer
from train.model import fp8
from train.model.qwen_image.tiny import build_transformer

CPU = torch.device("cpu")
LATENT_HW, TEXT_TOKENS = (16, 16), 8  # 8x8 patches per image
# The last block's text output feeds nothing, so its text queries and text output projection get no gradient.
UNUSED = ("transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.attn.add_q_proj")


def needs_peer():
    pytest.importorskip("einops")
    if peer.importlib.util.find_spec("diffsynth") is None:
        pytest.skip("the bench extra (diffsynth) is not installed")


def diffusers_prediction(model, x: peer.Inputs, sigma: float) -> torch.Tensor:
    """Our transformer on the peer's inputs, packed as the edit pipelines pack them; target tokens only."""
    tokens = [peer._pack(im) for im in (x.target, *x.references)]
    shapes = [(1, im.shape[2] // 2, im.shape[3] // 2) for im in (x.target, *x.references)]
    out = model(hidden_states=torch.cat(tokens, dim=1), timestep=torch.tensor([sigma]),
                encoder_hidden_states=x.prompt_emb, encoder_hidden_states_mask=None, img_shapes=[shapes],
                return_dict=False)[0]
    return out[:, : tokens[0].shape[1]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_peer_forward_matches_diffusers(zero_cond_t):
    """With our tiny transformer's weights (same names and shapes: the same architecture), the peer's forward as its
    trainer calls it predicts what diffusers' model predicts; only its sigmoid GELU approximation differs (~5e-4).
    A timestep off by 2x, or 2511's reference modulation left out, is well outside that."""
    needs_peer()
    torch.manual_seed(0)
    ours = build_transformer(zero_cond_t).eval()
    dit = peer.build_dit(2, CPU, torch.float32, peer.TINY).eval()
    dit.load_state_dict(ours.state_dict(), strict=True)
    x = peer.make_inputs(LATENT_HW, 1, TEXT_TOKENS, peer.TINY.joint_dim, CPU, torch.float32, seed=0)
    with torch.no_grad():
        expected = diffusers_prediction(ours, x, 0.5)
        got = peer._pack(peer.forward(dit, x.target, torch.tensor([500.0]), x, zero_cond_t, checkpointing=False))
        wrong_t = peer._pack(peer.forward(dit, x.target, torch.tensor([250.0]), x, zero_cond_t, False))
        wrong_cond = peer._pack(peer.forward(dit, x.target, torch.tensor([500.0]), x, not zero_cond_t, False))
    assert rel(got, expected) < 1e-3
    assert rel(wrong_t, expected) > 1e-2 and rel(wrong_cond, expected) > 1.2e-3


def test_peer_step_trains_lora_on_the_same_modules():
    """One step of the peer (bf16 base variant, fp32 on the CPU): finite loss, every LoRA B moved off zero (its
    gradient reached it), the base untouched; LoRA sits on the same modules as on our transformer."""
    needs_peer()
    targets = build.lora_targets("attn")
    setup = peer.build(peer.Variant("bf16", "eager"), num_layers=2, latent_hw=LATENT_HW, refs=2,
                       text_tokens=TEXT_TOKENS, targets=targets, rank=4, device=CPU, dtype=torch.float32, seed=0,
                       checkpointing=True, dims=peer.TINY)
    base = {n: p.detach().clone() for n, p in setup.model.named_parameters() if not p.requires_grad}
    losses = [float(setup.step(i)) for i in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]
    lora_b = {n: p for n, p in setup.model.named_parameters() if "lora_B" in n}
    assert len(lora_b) == 2 * len(targets)
    assert all(p.abs().sum() > 0 for n, p in lora_b.items() if not n.startswith(UNUSED)), "no LoRA gradient"
    assert all(torch.equal(p, base[n]) for n, p in setup.model.named_parameters() if n in base)
    ours = build_transformer()
    build.prepare_training(ours, "lora", build.lora_config(4, "attn"), "none", False)
    lora_modules = lambda m: {n for n, _ in m.named_modules() if n.endswith(".lora_A")}  # noqa: E731
    assert lora_modules(setup.model) == lora_modules(ours)
    assert setup.trainable_params == sum(p.numel() for p in ours.parameters() if p.requires_grad)


def test_peer_quantised_base_and_refused_variants():
    """torchao weight-only (its fp8 w8a16 method) quantises every linear of the DiT and still trains LoRA; a method
    its trainer refuses (W8A8, not differentiable), an unknown one and bad entries are reported, not run."""
    needs_peer()
    pytest.importorskip("torchao")
    kwargs = dict(num_layers=2, latent_hw=LATENT_HW, refs=1, text_tokens=TEXT_TOKENS,
                  targets=build.lora_targets("attn"), rank=4, device=CPU, dtype=torch.float32, seed=0,
                  dims=peer.TINY)
    timed = []
    rows = peer.run_variants(peer.parse_variants("torchao_fp8_w8a16:eager,torchao_fp8_w8a8:eager,nope:eager"),
                             lambda step: timed.append(float(step(0))) or {"s_per_step": 1.0}, lambda: None, **kwargs)
    assert [r["variant"] for r in rows] == ["torchao_fp8_w8a16:eager", "torchao_fp8_w8a8:eager", "nope:eager"]
    assert "error" not in rows[0] and len(timed) == 1 and torch.isfinite(torch.tensor(timed[0]))
    assert "refuses" in rows[1]["error"] and "Unknown quantization method" in rows[2]["error"]
    setup = peer.build(peer.Variant("torchao_fp8_w8a16", "eager"), **kwargs)
    weights = [type(m.weight).__name__ for n, m in setup.model.named_modules() if type(m).__name__ == "TorchaoLinear"]
    assert len(weights) == 2 * 14 + 6 and set(weights) == {"Float8Tensor"}  # blocks; in, out, time, norm_out
    for bad in ("bf16", "bf16:fast", ":eager", "", "bf16:compile:fast", "bf16:compile:torch:more"):
        with pytest.raises(ValueError, match="peer_variants"):
            peer.parse_variants(bad)
    torch_sdpa = peer.parse_variants("bf16:compile:torch")[0]
    assert torch_sdpa == peer.Variant("bf16", "compile", "torch") and torch_sdpa.name == "bf16:compile:torch"


def test_bench_options_for_peer_and_fp8_impls():
    """Combinations the benchmark refuses, with the flag to change."""
    args = options.parse_args(["--peer", "diffsynth"])
    assert peer.parse_variants(args.peer_variants) == [peer.Variant(*v.split(":")) for v in peer.DEFAULT_VARIANTS]
    for bad in (["--peer", "diffsynth", "--micro_batch", "2"], ["--peer", "diffsynth", "--mode", "full"],
                ["--peer", "diffsynth", "--peer_variants", "bf16"], ["--fp8_impl", "torchao_training"],
                ["--peer", "diffsynth", "--peer_variants", "bf16:compile:torch"],  # the MMDiT's peer: no choice
                ["--fp8_base", "--fp8_transposed", "--fp8_impl", "torchao_inference"]):
        with pytest.raises(SystemExit):
            options.parse_args(bad)


@pytest.fixture()
def tiny_lora() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_transformer()
    build.prepare_training(model, "lora", build.lora_config(4, "attn"), "none", False)
    with torch.no_grad():  # LoRA B off zero, so that the LoRA branch contributes to the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


def test_fp8_impls_pick_the_linears_train_fp8_converts(tiny_lora):
    """torchao is applied to exactly the linears train/model/fp8.py converts: token linears (24 in 2 blocks) and the
    modulation linears (4); unknown implementations and the transposed copy outside ours are refused."""
    token, vector = fp8_impls.frozen_linears(tiny_lora, "token"), fp8_impls.frozen_linears(tiny_lora, "vector")
    ours = copy.deepcopy(tiny_lora)
    assert fp8_impls.convert(ours, "ours") == len(token) + len(vector) == 28
    converted = {n for n, m in ours.named_modules() if isinstance(m, fp8.Float8FrozenLinear)}
    assert converted == set(token) | set(vector)
    with pytest.raises(ValueError, match="fp8_transposed"):
        fp8_impls.convert(copy.deepcopy(tiny_lora), "torchao_training", keep_transposed=True)
    with pytest.raises(ValueError, match="choose one of"):
        fp8_impls.convert(copy.deepcopy(tiny_lora), "fp4")


def test_torchao_training_linear_trains_lora(tiny_lora):
    """torchao's Float8Linear (rowwise) on the token linears runs on the CPU: the output within fp8 error of the
    fp32 model, LoRA gradients finite, the frozen weights without gradient."""
    pytest.importorskip("torchao")
    converted = copy.deepcopy(tiny_lora)
    assert fp8_impls.convert(converted, "torchao_training") == 24
    token = set(fp8_impls.frozen_linears(tiny_lora, "token"))
    assert {type(m).__name__ for n, m in converted.named_modules() if n in token} == {"Float8Linear"}
    x = transformer_inputs(tiny_lora, generator=torch.Generator().manual_seed(0))
    expected = tiny_lora(**x)[0]
    out = converted(**x)[0]
    assert 0 < rel(out, expected) < 2e-2  # quantised (not the same numbers), but close
    out.square().mean().backward()
    grads = {n: p.grad for n, p in converted.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items() if not n.startswith(UNUSED))
    assert all(m.weight.grad is None for m in converted.modules() if type(m).__name__ == "Float8Linear")
