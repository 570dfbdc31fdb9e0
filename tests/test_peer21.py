"""The benchmark's peer for Qwen-Image-2.1 (DiffSynth-Studio's QwenImage21DiT, train/benchmarks/peer21.py) on the
tiny config on the CPU: its forward against the project's, one training step, and the sequence it runs.

Needs the bench extra (diffsynth, einops); without it the tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

from train.benchmarks import build, options, peer, peer21
from train.benchmarks.workload import make_workload
from train.model.qwen_image21 import batches, sequence
from train.model.qwen_image21.tiny import build_transformer

CPU = torch.device("cpu")
LATENT_HW, REFS, TEXT_TOKENS = (8, 8), 2, 32  # --tiny's 128^2 images at 16 px a latent


def needs_peer():
    pytest.importorskip("einops")
    if peer.importlib.util.find_spec("diffsynth") is None:
        pytest.skip("the bench extra (diffsynth) is not installed")


def project_prediction(model, x: peer21.Inputs, sigma: float) -> torch.Tensor:
    """Our transformer on the peer's inputs through the project's own sequence code (sequence.py); (1, C, h, w)."""
    shapes = [(1, *r.shape[2:]) for r in x.references]
    refs = torch.cat([r.flatten(2).transpose(1, 2) for r in x.references], dim=1)
    cond = batches.BatchConditioning(x.prompt_emb, None, x.pad_mask, refs, shapes)
    target = x.target.flatten(2).transpose(1, 2)
    kwargs = sequence.transformer_inputs(cond, target, tuple(x.target.shape[2:]), torch.tensor([sigma]))
    out = sequence.target_prediction(model(**kwargs)[0], tuple(x.target.shape[2:]))
    return out.transpose(1, 2).reshape(x.target.shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_peer21_forward_matches_the_project():
    """With our tiny transformer's weights (every name and shape loads: the same architecture), the peer's forward as
    model_fn_qwen_image_21 calls it predicts what our transformer predicts from the same latents and prompt; a
    timestep off by 2x is far outside that."""
    needs_peer()
    torch.manual_seed(0)
    ours = build_transformer().eval()
    dit = peer21.build_dit(dict(ours.config), CPU, torch.float32).eval()
    dit.load_state_dict(ours.state_dict(), strict=True)
    x = peer21.make_inputs(dit, LATENT_HW, REFS, TEXT_TOKENS, CPU, torch.float32, seed=0)
    with torch.no_grad():
        expected = project_prediction(ours, x, 0.5)
        got = peer21.forward(dit, x.target, torch.tensor([500.0]), x, checkpointing=False)
        wrong_t = peer21.forward(dit, x.target, torch.tensor([250.0]), x, checkpointing=False)
    assert rel(got, expected) < 1e-4
    assert rel(wrong_t, expected) > 1e-2


def test_peer21_step_trains_lora_on_the_projects_sequence():
    """One peer step at the tiny size (bf16 base variant, fp32 on the CPU): finite losses, every LoRA B moved off zero,
    the base untouched; its blocks run the sequence length the project's workload counts, and LoRA sits on the
    modules it sits on in our transformer."""
    needs_peer()
    args = options.parse_args(
        ["--variant", "qwen_image_21", "--tiny", "--refs", str(REFS), "--lora_targets", "default"]
    )
    fam = build.args_family(args)
    w = make_workload(args.area, args.refs, args.text_tokens, 1, fam)
    targets = build.lora_targets("default", fam)
    setup = peer21.build(
        peer.Variant("bf16", "eager"),
        dict(build_transformer().config),
        w.latent_hw,
        w.refs,
        w.text_tokens,
        targets,
        rank=4,
        device=CPU,
        dtype=torch.float32,
        seed=0,
        checkpointing=True,
    )
    lengths = []
    setup.model.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a, kw: lengths.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    base = {n: p.detach().clone() for n, p in setup.model.named_parameters() if not p.requires_grad}
    losses = [float(setup.step(i)) for i in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]
    assert set(lengths) == {w.tokens_per_sample}  # forward and checkpointed recomputation alike
    lora_b = {n: p for n, p in setup.model.named_parameters() if "lora_B" in n}
    assert len(lora_b) == 2 * len(targets) and all(p.abs().sum() > 0 for p in lora_b.values()), "no LoRA gradient"
    assert all(torch.equal(p, base[n]) for n, p in setup.model.named_parameters() if n in base)
    ours = build.build_model(args, CPU, torch.float32)
    build.prepare_training(ours, "lora", build.lora_config(4, "default", fam), "none", False)
    lora_modules = lambda m: {n for n, _ in m.named_modules() if n.endswith(".lora_A")}  # noqa: E731
    assert lora_modules(setup.model) == lora_modules(ours)


def test_peer21_builds_the_released_architecture():
    """At the released config (on meta: shapes only) the peer's DiT has our transformer's every parameter name and
    shape: the project's FLOP count is the peer's too."""
    needs_peer()
    ours = build.build_full_transformer(None, "meta", torch.bfloat16, name="qwen_image_21")
    dit = peer21.build_dit(dict(ours.config), "meta", torch.bfloat16)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(dit) == shapes(ours) and len(dit.transformer_blocks) == 32


def test_peer21_variant_sets_diffsynth_s_attention(monkeypatch):
    """A variant's third field is the implementation DiffSynth's unmasked attention calls run (its module global, as
    its import-time choice sets it); without one, DiffSynth's own choice. Here FlashAttention-4's entry is a recorder
    in front of SDPA, so the CPU can see which calls reach it."""
    needs_peer()
    module = peer.load("core.attention.attention")
    monkeypatch.setattr(module, "ATTENTION_IMPLEMENTATION", module.ATTENTION_IMPLEMENTATION)  # restored afterwards
    calls = []

    def recorded(q, k, v, *patterns, scale=None, is_causal=False, window_size=None):
        calls.append(q.shape)
        return module.torch_sdpa(q, k, v, *patterns, scale=scale, is_causal=is_causal)

    monkeypatch.setattr(module, "flash_attention_4", recorded)
    args = options.parse_args(["--variant", "qwen_image_21", "--tiny", "--refs", "1"])
    w = make_workload(args.area, args.refs, args.text_tokens, 1, build.args_family(args))
    counts = {}
    for attention in ("flash_attention_4", "torch", ""):
        setup = peer21.build(peer.Variant("bf16", "eager", attention), dict(build_transformer().config),
                             w.latent_hw, w.refs, w.text_tokens, ["attn.to_q"], rank=4, device=CPU,
                             dtype=torch.float32, seed=0)
        assert setup.attention == (attention or module.initialize_attention_priority())
        before = len(calls)
        setup.step(0)
        counts[attention] = len(calls) - before
    assert counts["flash_attention_4"] > 0 and counts["torch"] == 0
    assert counts[""] == (counts["flash_attention_4"] if module.initialize_attention_priority() == "flash_attention_4"
                          else 0)
