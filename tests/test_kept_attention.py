"""Checkpointed blocks that keep their attention output (train/model/kept_attention.py), on the tiny model, fp32 CPU,
and the memory plan's choice of how many keep it (train/plan/choice.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import transformer_inputs
from plan_helpers import measured, plan
from recorded_plans import RELEASED

from train.config import LoraConfig
from train.model import family, kept_attention, prepare
from train.model.qwen_image.tiny import build_transformer
from train.plan.explain import describe
from train.plan.keys import config_values
from train.plan.measure import Measured
from train.plan.predict import Choice, predict
from train.plan.run_plan import gpu_margin
from train.plan.sizes import GB

QWEN = family.family_named("qwen_image")
LORA = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_k", "attn.add_v_proj", "img_mlp.net.2"])


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the attention kernel's runs inside the op (a replayed output does not run it)."""
    calls = []
    forward = kept_attention.fused_forward

    def counting(*args):
        calls.append(args[0].shape)
        return forward(*args)

    monkeypatch.setattr(kept_attention, "fused_forward", counting)
    return calls


def _prepared(kept: int, checkpoint_blocks: int = 0, offload: set[int] | None = None):
    torch.manual_seed(0)
    model = build_transformer(num_layers=3)
    prepare.prepare_for_training(model, "lora", LORA, True, False, checkpoint_blocks=checkpoint_blocks,
                                    offload=offload, kept_attention_blocks=kept)
    return model.train()


def _loss_and_grads(model):
    inputs = transformer_inputs(model, generator=torch.Generator().manual_seed(1))
    loss = model(**inputs)[0].square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_the_op_is_sdpa():
    """Output and input gradients equal diffusers' own attention (torch SDPA) bitwise."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 8, requires_grad=True) for _ in range(3))  # B S H D, diffusers' layout
    ours = kept_attention.dispatch(q, k, v, backend=kept_attention.BACKEND)
    theirs = kept_attention._DIFFUSERS(q, k, v)
    assert torch.equal(ours, theirs)
    g_ours = torch.autograd.grad(ours.square().sum(), (q, k, v))
    g_theirs = torch.autograd.grad(theirs.square().sum(), (q, k, v))
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kept, checkpoint_blocks, offload, runs", [
    (-1, 0, None, 3),        # all three recomputed blocks keep: the op runs the kernel in their forward only
    (1, 0, None, 1),         # the first keeps; the other two are not marked: diffusers' attention, twice each
    (-1, 2, None, 2),        # two checkpointed (both keep), the third plain (diffusers')
    (-1, 0, {0, 1}, 3),      # offloaded blocks keep it too
])
def test_kept_blocks_train_exactly_like_recomputed_ones(kernel_calls, kept, checkpoint_blocks, offload, runs):
    reference = _loss_and_grads(_prepared(0, checkpoint_blocks, offload))
    assert not kernel_calls  # kept_attention_blocks 0: diffusers' attention, the op not installed
    _assert_same(_loss_and_grads(_prepared(kept, checkpoint_blocks, offload)), reference)
    assert len(kernel_calls) == runs


def test_only_keeping_blocks_are_marked():
    model = _prepared(2, checkpoint_blocks=3)
    marks = [b.attn.processor._attention_backend for b in model.transformer_blocks]
    assert marks == [kept_attention.BACKEND, kept_attention.BACKEND, None]


def test_nothing_is_kept_without_gradients(kernel_calls):
    """Without gradients (validation renders) the blocks go to diffusers' attention and nothing is recorded."""
    model = _prepared(-1)
    with torch.no_grad():
        model(**transformer_inputs(model, generator=torch.Generator().manual_seed(1)))
    assert not kernel_calls


def test_a_stash_replays_in_order_and_then_forgets():
    stash = kept_attention.Stash()
    seen = []

    def block(x):
        out, _ = torch.ops.qwen_edit.kept_attention(x, x, x, None)
        seen.append(out)
        return out

    x = torch.randn(1, 2, 5, 4)
    first = stash.run(block, x)
    assert len(stash._saved) == 1 and not stash.replaying
    again = stash.run(block, x * 0)  # the recomputation gets the recorded output, not one of its own inputs
    assert torch.equal(first, again) and stash.replaying and not stash._saved


def test_kept_bytes_count_the_output_and_the_log_sum_exp():
    # 12,984 tokens of the 2509 workload, 24 heads of 128, bf16: 80 MB of output and 1.2 MB of float32 lse
    assert kept_attention.kept_bytes(1, 12_984, 24, 128, 2) == 12_984 * 24 * 128 * 2 + 12_984 * 24 * 4


# ---------------------------------------------------------------- the plan

def _kept(m: Measured, x_gb: float = 0.08, recompute_share: float = 0.6) -> Measured:
    return dataclasses.replace(m, kept_bytes=x_gb * GB, kept_recompute_s=recompute_share * m.fwd_s)


def test_keeping_is_counted_in_the_peak_and_the_step():
    s, m = RELEASED, _kept(measured(12_544))
    c = Choice(True, False, 30, 10, True)
    plain, kept = predict(s, m, c), predict(s, m, dataclasses.replace(c, kept_attention=20))
    assert kept.peak_bytes == pytest.approx(plain.peak_bytes + 20 * m.kept_bytes)
    assert kept.step_s == pytest.approx(plain.step_s - 20 * (m.fwd_s - m.kept_recompute_s))


@pytest.mark.parametrize("budget_gb", [141, 80, 48, 24])
def test_the_plan_keeps_as_many_as_fit(budget_gb):
    """Each checkpointed block that can keep its attention within the budget does; one more would not fit."""
    s, m = RELEASED, _kept(measured(12_544))
    budget = budget_gb * GB
    room = budget - gpu_margin(0, budget)
    c, p = plan(s, m, budget, gpu_margin(0, budget), {}, True, False)
    assert p.fit_bytes <= room
    if c.checkpointed and c.kept_attention < c.checkpointed:
        more = predict(s, m, dataclasses.replace(c, kept_attention=c.kept_attention + 1))
        assert more.fit_bytes > room
    assert config_values(c, s.num_blocks)["train.kept_attention_blocks"] == c.kept_attention


def test_keeping_makes_the_low_budgets_faster():
    s = RELEASED
    without, with_kept = measured(12_544), _kept(measured(12_544))
    budget = 48 * GB
    _, slow = plan(s, without, budget, gpu_margin(0, budget), {}, True, False)
    c, fast = plan(s, with_kept, budget, gpu_margin(0, budget), {}, True, False)
    assert c.kept_attention > 0 and fast.step_s < slow.step_s
    assert "keep their attention output" in describe(c, s.num_blocks)


def test_a_set_count_is_kept_as_set():
    s, m = RELEASED, _kept(measured(12_544))
    budget = 48 * GB
    for value, want in ((0, lambda c: 0), (-1, lambda c: c.checkpointed), (5, lambda c: min(5, c.checkpointed))):
        c, _ = plan(s, m, budget, gpu_margin(0, budget), {"train.kept_attention_blocks": value},
                             True, False)
        assert c.checkpointed and c.kept_attention == want(c), value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_cuda_kernels_equal_sdpa_and_replay_in_a_compiled_block(backend):
    """On a GPU, in bf16: the op's output and gradients equal torch SDPA's with the same kernel forced, its fake
    kernel agrees with the real one (torch.library.opcheck), and a compiled checkpointed block that keeps its
    attention gives the gradients of plain recomputation (up to the backward's rounding) without running the kernel
    again."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    kept_attention.install(QWEN.attention_module)
    kept_attention._backends.clear()
    try:
        with sdpa_kernel([kind]):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            ours = kept_attention.dispatch(q, k, v, backend=kept_attention.BACKEND)
            theirs = kept_attention._DIFFUSERS(q, k, v)
            g_ours = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
            g_theirs = torch.autograd.grad(theirs.float().square().sum(), (q, k, v))
            for a, b in zip((ours, *g_ours), (theirs, *g_theirs), strict=True):  # the same kernels: equal or all but
                assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3  # rounding (dO's layout)
            qp, kp, vp = (x.detach().permute(0, 2, 1, 3).requires_grad_() for x in (q, k, v))
            torch.library.opcheck(torch.ops.qwen_edit.kept_attention.default, (qp, kp, vp, None))

            def block(x, w):
                h = (x @ w).unflatten(-1, (4, 128))
                return kept_attention.dispatch(h, h * 0.5, h.tanh(), backend=kept_attention.BACKEND).flatten(2) @ w.T

            x = torch.randn(1, 1024, 512, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) / 23).requires_grad_()
            compiled = torch.compile(block)
            plain = checkpoint(compiled, x, w, use_reentrant=False)
            g_plain = torch.autograd.grad(plain.float().square().sum(), w)[0]
            calls = []
            forward = kept_attention.fused_forward
            kept_attention.fused_forward = lambda *a: calls.append(1) or forward(*a)
            try:
                replayed = checkpoint(kept_attention.Stash().run, compiled, x, w, use_reentrant=False)
                g_kept = torch.autograd.grad(replayed.float().square().sum(), w)[0]
            finally:
                kept_attention.fused_forward = forward
            # cuDNN's backward accumulates with atomics: two backward passes differ in rounding (seen on an H200)
            assert torch.equal(plain, replayed) and len(calls) == 1
            assert ((g_kept.float() - g_plain.float()).norm() / g_plain.float().norm()).item() < 1e-2
    finally:
        kept_attention._backends.clear()


def test_the_block_probe_reports_the_saving():
    """python -m train.bench --block_probe: the report reads the plan's figures of both runs (its GPU part cannot
    run here: it refuses without one)."""
    from train.benchmarks import blocks

    plain = dataclasses.asdict(measured(12_984))
    kept = {**plain, "ckpt_bytes": plain["ckpt_bytes"], "kept_bytes": 81e6, "kept_recompute_s": 0.0055}
    plain["fwd_s"] = 0.0087
    text = blocks.format_report({"gpu": "G", "torch": "t", "date": "d", "tokens": 12_984, "rank": 64,
                                 "kept": kept, "recomputed": plain})
    assert "X 81.0 MB, recomputation 5.50 ms: 3.20 ms saved per checkpointed block" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            blocks.run(blocks.parse_args([]))


def test_compiled_blocks_keep_and_skip_like_eager_ones(kernel_calls):
    """Compiled blocks (one graph with the mark, one without) train as the eager ones do, and the marked block's
    recomputation runs no kernel."""
    def prepared(compile_blocks: bool):
        torch.manual_seed(0)
        model = build_transformer(num_layers=2)
        prepare.prepare_for_training(model, "lora", LORA, True, compile_blocks, kept_attention_blocks=1)
        return model.train()

    eager_loss, eager_grads = _loss_and_grads(prepared(False))
    assert len(kernel_calls) == 1
    loss, grads = _loss_and_grads(prepared(True))
    assert len(kernel_calls) == 2  # the compiled marked block's forward; its recomputation replayed
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6)


def test_the_gemm_probe_covers_the_converted_linears():
    """python -m train.bench --gemm_probe times exactly the linears train.fp8_base converts in a released block: per
    stream, the (in, out) features of its list are those of the block's token linears; its report sums them for
    the step, and without a GPU it refuses."""
    from diffusers import QwenImageTransformer2DModel

    from train.benchmarks import gemms
    from train.model import family
    from train.model.qwen_image.archs import FULL_ARCH

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**{**FULL_ARCH, "num_layers": 1})
    converted = sorted((m.in_features, m.out_features) for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and family.transformer_family(model).fp8_kind(name) == "token")
    assert converted == sorted(2 * [(k, n) for _, k, n in gemms.linears()])
    row = {"m": 8, "k": 3072, "n": 3072, "fwd_ms_exact": 1.0, "fwd_ms_fast": 0.75, "bwd_ms_exact": 1.0,
           "bwd_ms_fast": 0.75, "fwd_error_exact": 1e-3, "fwd_error_fast": 2e-3, "bwd_error_exact": 1e-3,
           "bwd_error_fast": 3e-3}
    text = gemms.format_report({"gpu": "G", "torch": "t", "image_tokens": 8, "text_tokens": 0, "blocks": 60,
                                "linears": {"image_q": row}, "step_s_exact": 0.12, "step_s_fast": 0.09,
                                "tflops_exact": 1.0, "tflops_fast": 1.3, "max_error_exact": 1e-3,
                                "max_error_fast": 3e-3})
    assert "0.1200 s per step exact" in text and "fast - exact -0.0300 s" in text and "3.00e-03 fast" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            gemms.run(gemms.parse_args([]))


def test_train_attention_kernel_resolves_to_what_can_run(monkeypatch):
    """train.attention_kernel: auto takes FlashAttention-4 where its check passes (here a stand-in check), else the
    kernel SDPA picks; fa4 where it cannot run raises the check's error; the choice is what fused calls use."""
    from train.model import flash4

    cpu = torch.device("cpu")
    try:
        assert kept_attention.choose_kernel("auto", cpu) == "sdpa" and kept_attention._external is None
        with pytest.raises(RuntimeError, match="compute capability 9.0"):
            kept_attention.choose_kernel("fa4", cpu)
        monkeypatch.setattr(flash4, "check", lambda device: None)
        assert kept_attention.choose_kernel("auto", cpu) == "fa4" and kept_attention._external is flash4
        assert kept_attention.choose_kernel("sdpa", cpu) == "sdpa" and kept_attention._external is None
    finally:
        kept_attention.use_kernel("sdpa", cpu)
