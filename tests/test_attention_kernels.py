"""The attention-kernel probe (train/benchmarks/attention_kernels.py) on the CPU: its calls cover exactly the
block-causal mask's allowed pairs, the op's kernel runs and agrees with float32 math, and a kernel this machine
cannot run is reported, not raised."""

from __future__ import annotations

import sys

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage21 as T

from train.benchmarks import attention21, attention_kernels


@pytest.mark.parametrize("references", [0, 1, 3])
def test_the_calls_count_the_allowed_pairs_of_the_mask(references):
    """The probe's FLOP count rests on its calls' pairs: their sum is the number of query-key pairs the pipeline's
    block-causal mask allows (text causal, an image bidirectional within itself, everything before it visible)."""
    calls, length = attention_kernels.layer_calls(references, (4, 6), 7)
    mask, shapes = attention21.layout(references, (4, 6), 7)
    ids, _ = T.QwenImage21Transformer2DModel.build_token_metadata(mask, shapes)
    pos = torch.arange(length)
    allowed = (pos[:, None] >= pos[None, :]) | ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))
    assert length == mask.numel()
    assert sum(attention_kernels.pairs(c) for c in calls) == int(allowed.sum())


def test_the_probe_times_the_ops_kernel_and_reports_what_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's report, on any machine
    args = attention_kernels.parse_args(["--references", "2", "--target", "4x4", "--prompt_tokens", "5",
                                         "--heads", "2", "--head_dim", "16", "--steps", "1"])
    record = attention_kernels.run(args)
    sdpa = record["kernels"]["sdpa"]
    assert sdpa["forward_s"] > 0 and sdpa["backward_s"] > 0 and sdpa["forward_tflops"] > 0
    assert max(sdpa["max_abs_error"].values()) < 1e-4  # float32 on the CPU
    assert "fa4" in record["not_available"] and "compute capability" in record["not_available"]["fa4"]
    report = attention_kernels.format_report(record)
    assert "sdpa" in report and "fa4   not available" in report
    with pytest.raises(SystemExit, match="--kernels"):
        attention_kernels.run(attention_kernels.parse_args(["--kernels", "xformers"]))


def test_the_dense_probe_times_one_unmasked_call_over_the_whole_sequence(monkeypatch):
    """--dense: the MMDiT's attention, one non-causal call over every token, its FLOPs over all query-key pairs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = attention_kernels.parse_args(["--dense", "24", "--heads", "3", "--head_dim", "8", "--steps", "1",
                                         "--kernels", "sdpa"])
    record = attention_kernels.run(args)
    assert record["calls"] == [[0, 24, 0, 24, False]] and record["tokens"] == 24
    assert record["forward_flops"] == 4 * 24 * 24 * 3 * 8
    assert max(record["kernels"]["sdpa"]["max_abs_error"].values()) < 1e-4
    assert "one dense call" in attention_kernels.format_report(record)


def _fake_flash_attn_4(monkeypatch) -> list:
    """flash_attn.cute.interface with the contract of FlashAttention-4's two functions, in float32 math: q, k, v, out
    and gradients (B, S, H, D); the log-sum-exp (B, H, S), natural log; a causal triangle aligned bottom-right (query
    i of S sees keys 0..i + K - S); the backward's softmax from the log-sum-exp and its row sums from the output it is
    given; outputs written into the tensors given for them. Returns the list of the given outputs' shapes."""
    import sys
    import types

    written: list = []

    def scores(q, k, scale, causal):
        s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        hidden = torch.ones_like(s, dtype=torch.bool).triu(1 + s.shape[-1] - s.shape[-2])
        return s.masked_fill(hidden, float("-inf")) if causal else s

    def heads_first(*xs):
        return [x.transpose(1, 2).float() for x in xs]

    def into(given, made):  # FlashAttention-4 writes into an output tensor it is given
        if given is None:
            return made
        assert given.shape == made.shape and given.stride(-1) == 1
        written.append(tuple(given.shape))
        return given.copy_(made)

    def fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, out=None, lse=None):
        q, k, v = heads_first(q, k, v)
        s = scores(q, k, softmax_scale, causal)
        m = s.logsumexp(-1)
        o = ((s - m[..., None]).exp() @ v).transpose(1, 2).contiguous()
        return into(out, o), into(lse, m), None, None, None

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, dq=None, dk=None, dv=None):
        q, k, v, out, dout = heads_first(q, k, v, out, dout)
        scale = softmax_scale or q.shape[-1] ** -0.5
        p = (scores(q, k, softmax_scale, causal) - lse[..., None]).exp()
        ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
        grads = (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout)
        return tuple(into(given, g.transpose(1, 2).contiguous()) for g, given in zip(grads, (dq, dk, dv), strict=True))

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = fwd, bwd
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    return written


def test_the_segmented_op_on_flash_attention_4_equals_it_on_sdpa(monkeypatch):
    """The op's calls through train/model/flash4.py (a stand-in with FlashAttention-4's contract on the CPU: layout,
    log-sum-exp, bottom-right causal triangle, backward from a larger attention's out and lse) give the op's output
    and gradients on SDPA's kernel, with a later text run as one causal call over every key before its end, and as
    two calls where the A/B splits it; the kernel writes the op's outputs in place (its rows of out, lse and dq, the
    target call's dk and dv), or returns new ones where the A/B has them copied."""
    from train.model import flash4, kept_attention
    from train.model.qwen_image21 import attention

    written = _fake_flash_attn_4(monkeypatch)
    calls = []
    fused_forward = kept_attention.fused_forward
    monkeypatch.setattr(kept_attention, "fused_forward",
                        lambda q, k, v, scale, causal=False, **into: calls.append((q.shape[2], k.shape[2], causal))
                        or fused_forward(q, k, v, scale, causal, **into))
    mask, shapes = attention21.layout(2, (4, 6), 7)
    ids, target = T.QwenImage21Transformer2DModel.build_token_metadata(mask, shapes)
    segments = T._qwenimage21_prefix_segments(ids, int((~target).sum()))
    g = torch.Generator().manual_seed(3)
    qkv = [torch.randn(1, mask.numel(), 3, 16, generator=g) for _ in range(3)]
    grad = torch.randn(1, 3, mask.numel(), 16, generator=g)

    def run() -> list[torch.Tensor]:
        q, k, v = (x.transpose(1, 2).detach().requires_grad_(True) for x in qkv)
        out = attention.block_causal_attention(q, k, v, segments)
        (out * grad).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    on_sdpa = run()
    split = list(calls)
    monkeypatch.setattr(kept_attention, "_external", flash4)
    one_call = list(split)  # each later text run's two calls (keys before it; its own, causal) as one
    later_text = [(start, end) for start, end, is_text in segments if is_text and start > 0]
    for start, end in later_text:
        one_call.remove((end - start, start, False))
        one_call.remove((end - start, end - start, True))
        one_call.append((end - start, end, True))
    assert len(later_text) == 2
    length = mask.numel()
    for split_text, copy in ((False, False), (True, False), (False, True)):
        calls.clear()
        written.clear()
        kept_attention.split_text_calls(split_text)
        kept_attention.copy_outputs(copy)
        try:
            for ours, theirs in zip(run(), on_sdpa, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            assert kept_attention.causal_bottom_right() is not split_text
        finally:
            kept_attention.split_text_calls(False)
            kept_attention.copy_outputs(False)
        assert calls == split if split_text else sorted(calls) == sorted(one_call)
        # the kernel wrote the target call's dk and dv over every key, and each one-call run's rows of out, lse and dq
        single = len(calls) - (2 * len(later_text) if split_text else 0)  # the calls of one-call runs
        assert written.count((1, length, 3, 16)) == (0 if copy else 2)
        assert len(written) == (0 if copy else 2 + 3 * single)


def test_the_mmdit_blocks_run_their_attention_on_the_chosen_kernel(monkeypatch):
    """train.bench --attention_kernel fa4 on the Qwen-Image MMDiT: every block's attention goes through the op to
    flash4.py (the stand-in counts the calls), with the loss and gradients of diffusers' own attention."""
    from conftest import transformer_inputs

    from train.benchmarks.step import route_attention
    from train.config import LoraConfig
    from train.model import family, flash4, kept_attention, prepare
    from train.model.qwen_image.tiny import build_transformer

    _fake_flash_attn_4(monkeypatch)
    interface = sys.modules["flash_attn.cute.interface"]
    calls, forward = [], interface._flash_attn_fwd
    monkeypatch.setattr(interface, "_flash_attn_fwd", lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k))
    lora = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.add_k_proj"])

    def loss_and_grads(routed: bool):
        torch.manual_seed(0)
        model = build_transformer(num_layers=3)
        prepare.prepare_for_training(model, "lora", lora, False, False)
        if routed:
            assert route_attention(model, family.family_named("qwen_image")) == 3
        loss = model.train()(**transformer_inputs(model, generator=torch.Generator().manual_seed(1)))[0].square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]

    plain = loss_and_grads(routed=False)
    assert not calls
    monkeypatch.setattr(kept_attention, "_external", flash4)
    for ours, theirs in zip(loss_and_grads(routed=True), plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3  # one call per block
    assert route_attention(build_transformer(num_layers=1), family.family_named("qwen_image21")) == 0


def test_choosing_the_kernel(monkeypatch):
    from train.model import kept_attention

    monkeypatch.setattr(kept_attention, "_external", None)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        kept_attention.use_kernel("fa4", torch.device("cpu"))
    with pytest.raises(ValueError, match="'sdpa' or 'fa4'"):
        kept_attention.use_kernel("xformers", torch.device("cpu"))
    kept_attention.use_kernel("sdpa", torch.device("cpu"))
    assert kept_attention._external is None
