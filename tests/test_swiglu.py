"""train.model.swiglu: the SwiGLU MLP's input side in one autograd function on an fp8 base, its backward's math, the
Triton kernel under Triton's interpreter on the CPU, and the fused MLP against the unfused one in Qwen-Image-2.1's
tiny transformer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from train.config import LoraConfig
from train.model import family, fp8, prepare, swiglu
from train.model.qwen_image21 import batches
from train.model.qwen_image21.tiny import build_transformer

FAM = family.family_named("qwen_image21")


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    g, u, dh = (torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(3))
    g_scale, u_scale = (torch.rand(cols, generator=gen) + 0.5 for _ in range(2))
    return dh, g, u, g_scale, u_scale


def test_reference_backward_is_autograds_gradient_then_fp8s_row_quantisation():
    dh, g, u, g_scale, u_scale = _inputs(6, 40, torch.float32)
    g_ = g.clone().requires_grad_(True)
    u_ = u.clone().requires_grad_(True)
    (torch.nn.functional.silu(g_) * u_).backward(dh)
    dg, du, dg8, g_rows, du8, u_rows = swiglu.reference_backward(dh, g, u, g_scale, u_scale)
    assert torch.allclose(dg, g_.grad, atol=1e-6) and torch.allclose(du, u_.grad, atol=1e-6)
    for grad, scale, q, rows in ((dg, g_scale, dg8, g_rows), (du, u_scale, du8, u_rows)):
        want_q, want_rows = fp8.quantize_rows(grad * scale)
        assert q.dtype == fp8.E4M3 and rows.shape == (6, 1)
        assert torch.equal(rows, want_rows) and torch.equal(q.float(), want_q.float())


_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from train.model import fp8, swiglu
    assert swiglu.kernel_runs(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    rows, cols = 3, 5000  # 3 loop iterations of 2,048 columns, the last one partial
    g, u, dh = (torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for _ in range(3))
    dh[1] *= 1e-3  # rows of different ranges get their own scales
    g_scale, u_scale = (torch.rand(cols, generator=gen) + 0.5 for _ in range(2))
    # float32 copies: the values the kernel casts to e4m3 (the interpreter's e4m3 cast is not the GPU's)
    got = swiglu.launch(dh, g, u, g_scale, u_scale, q_dtype=torch.float32)
    dg, du = swiglu.reference_backward(dh, g, u, g_scale, u_scale)[:2]
    # The interpreter also casts float32 to bf16 by truncation where the GPU rounds to nearest: the gradients, and
    # the row scales and copies taken from them, may be one bf16 step (2^-8 relative, 2^-7 next to a power of two)
    # apart.
    tol = dict(rtol=2 ** -6, atol=1e-30)
    for a, b in zip(got[:2], (dg, du)):
        assert a.dtype == torch.bfloat16 and torch.allclose(a.float(), b.float(), **tol)
    for grad, scale, q, q_rows in ((dg, g_scale, got[2], got[3]), (du, u_scale, got[4], got[5])):
        want = grad.float() * scale
        want_rows = want.abs().amax(dim=1, keepdim=True) / 448.0
        assert q_rows.shape == (rows, 1) and torch.allclose(q_rows, want_rows, **tol)
        assert torch.allclose(q, want / want_rows, rtol=2 ** -5, atol=1e-3)
        assert torch.allclose(q.abs().amax(dim=1), torch.full((rows,), 448.0), rtol=2 ** -6)
    print("kernel ok")
""")


def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "kernel ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("interpreted", [True, False], ids=["interpreter", "no_kernel"])
def test_the_kernel_probe_times_each_variant_and_checks_it(tmp_path, interpreted):
    """`python -m train.bench --swiglu_probe` on the CPU: the eager reference and a kernel launch (under Triton's
    interpreter; without it, reported as not available), each timed and compared with the reference."""
    pytest.importorskip("triton")
    out = tmp_path / "probe.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpreted else "0"}
    cmd = [sys.executable, "-m", "train.bench", "--swiglu_probe", "--rows", "4", "--cols", "600", "--steps", "1",
           "--variants", "eager,256x4", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["probe"] == "swiglu" and (record["rows"], record["cols"]) == (4, 600)
    eager = record["variants"]["eager"]
    assert eager["s"] > 0 and eager["gradients"] == eager["row_scales"] == eager["fp8_differing"] == 0
    if interpreted:  # the interpreter's truncating casts: within a bf16 step (e4m3 copies: see the kernel test)
        kernel = record["variants"]["256x4"]
        assert kernel["s"] > 0 and kernel["gradients"] < 2 ** -6 and kernel["row_scales"] < 2 ** -6
        assert "256x4" in proc.stdout and "x inductor" not in proc.stdout
    else:
        assert "256x4" in record["not_available"] and "256x4     not available" in proc.stdout
    if not interpreted:  # a flag error, the same under either TRITON_INTERPRET: asked once
        bad = subprocess.run([*cmd[:4], "--variants", "3000x8"], env=env, capture_output=True, text=True, timeout=600)
        assert bad.returncode == 2 and "'3000x8' is none of inductor, eager or BxW" in bad.stderr


LORA = LoraConfig(rank=4, alpha=4.0, target_modules=list(FAM.lora.targets))


def _prepared(fused: bool, targets=None, device: str = "cpu", dtype: torch.dtype = torch.float32,
              compiled: bool = False):
    torch.manual_seed(0)
    model = build_transformer(num_layers=2).to(device, dtype)
    lora = LORA if targets is None else LoraConfig(rank=4, alpha=4.0, target_modules=targets)
    prepare.prepare_for_training(model, "lora", lora, False, compiled, fp8_base=True)
    with torch.no_grad():  # LoRA B starts at zero: give the updates a value so that their gradients matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    if fused:
        assert swiglu.fuse(FAM.blocks(model), FAM.swiglu) == 2
    return model.train()


def _loss_and_grads(model, device: str = "cpu", dtype: torch.dtype = torch.float32):
    b = batches.synthetic_batch(model, 2, (4, 4), [(4, 4)], 12, torch.device(device), dtype)
    kwargs = FAM.transformer_inputs(b, b.x0, torch.tensor([0.3, 0.8], device=device), dtype)
    loss = FAM.target_prediction(model(**kwargs), b).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("targets", [None, ["attn.to_q", "img_mlp.out"]], ids=["every_linear", "no_lora_on_gate_up"])
def test_the_fused_mlp_trains_like_the_unfused_fp8_mlp(monkeypatch, targets):
    """The loss and every LoRA gradient (the gate's and up's included) as the unfused fp8 MLP gives them; and the
    fused backward did run, once per block."""
    calls = []
    backward = swiglu.swiglu_backward
    monkeypatch.setattr(swiglu, "swiglu_backward", lambda *a: calls.append(1) or backward(*a))
    loss, grads = _loss_and_grads(_prepared(False, targets))
    assert not calls
    fused_loss, fused = _loss_and_grads(_prepared(True, targets))
    assert len(calls) == 2
    assert torch.allclose(loss, fused_loss, rtol=1e-5)
    assert grads.keys() == fused.keys() and any("gate_layer" in n for n in grads) == (targets is None)
    for n in grads:
        assert torch.allclose(grads[n], fused[n], rtol=1e-3, atol=1e-6 * grads[n].abs().max()), n


def test_unfuse_puts_the_mlps_back_on_their_own_forward(monkeypatch):
    """fuse, unfuse, fuse again (train.bench --ab_rounds switches so between rounds): the unfused model runs no fused
    backward and gives the never-fused model's loss; fused again, the fused backward runs again."""
    calls = []
    backward = swiglu.swiglu_backward
    monkeypatch.setattr(swiglu, "swiglu_backward", lambda *a: calls.append(1) or backward(*a))
    plain_loss, _ = _loss_and_grads(_prepared(False))
    model = _prepared(True)
    assert swiglu.unfuse(FAM.blocks(model), FAM.swiglu) == 2 and swiglu.unfuse(FAM.blocks(model), FAM.swiglu) == 0
    assert not any("forward" in vars(block.img_mlp) for block in model.transformer_blocks)
    loss, _ = _loss_and_grads(model)
    assert not calls and torch.equal(loss, plain_loss)
    model.zero_grad()
    assert swiglu.fuse(FAM.blocks(model), FAM.swiglu) == 2
    fused_loss, _ = _loss_and_grads(model)
    assert len(calls) == 2 and torch.allclose(fused_loss, plain_loss, rtol=1e-5)


def test_the_lora_update_is_what_peft_adds_to_the_base():
    model = _prepared(False)
    gate = model.transformer_blocks[0].img_mlp.gate_layer
    x = torch.randn(3, 5, gate.in_features)
    assert torch.allclose(gate(x), gate.base_layer(x) + swiglu.lora_update(gate, x), atol=1e-6)
    gate.enable_adapters(False)  # peft's switch: the base alone
    assert swiglu.lora_update(gate, x) is None


def test_fuse_needs_the_fp8_base():
    torch.manual_seed(0)
    model = build_transformer(num_layers=2)
    prepare.prepare_for_training(model, "lora", LORA, False, False)
    with pytest.raises(ValueError, match=r"block 0's img_mlp\.gate_layer is Linear, not a bias-free fp8 token linear"):
        swiglu.fuse(FAM.blocks(model), FAM.swiglu)
    assert "forward" not in vars(model.transformer_blocks[0].img_mlp)  # nothing half-fused


@pytest.mark.gpu
def test_the_compiled_fused_mlp_runs_the_kernel_on_cuda():
    """On a CUDA GPU with fp8: the compiled block's kernel gives reference_backward's values."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with fp8 matmuls")
    dh, g, u, g_scale, u_scale = (t.cuda() for t in _inputs(64, 3000, torch.bfloat16))
    got = torch.compile(swiglu.swiglu_backward)(dh, g, u, g_scale, u_scale)
    want = swiglu.reference_backward(dh, g, u, g_scale, u_scale)
    for a, b in zip(got[:2], want[:2], strict=True):  # bf16 gradients: sigmoids may differ in the last bit
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-30)
    for q, rows, wq, want_rows in ((got[2], got[3], want[2], want[3]), (got[4], got[5], want[4], want[5])):
        assert q.dtype == fp8.E4M3 and torch.allclose(rows, want_rows, rtol=2 ** -7)
        err = (q.float() - wq.float()).abs()  # one e4m3 step at most
        assert bool((err <= 0.125 * wq.float().abs() + 2 ** -9).all()) and (err == 0).float().mean() > 0.9


@pytest.mark.gpu
def test_compiled_fused_blocks_train_like_compiled_unfused_ones_on_cuda():
    """Compiled blocks in bf16 on CUDA: the fused MLP's kernel runs inside the compiled backward, and the loss and
    LoRA gradients stay within bf16 rounding of the unfused blocks'."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with fp8 matmuls")
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(_prepared(False, device="cuda", dtype=torch.bfloat16, compiled=True), "cuda",
                                  torch.bfloat16)
    fused_loss, fused = _loss_and_grads(_prepared(True, device="cuda", dtype=torch.bfloat16, compiled=True), "cuda",
                                        torch.bfloat16)
    assert torch.allclose(loss.float(), fused_loss.float(), rtol=2e-2)
    for n in grads:
        err = (grads[n].float() - fused[n].float()).norm() / grads[n].float().norm()
        assert err < 5e-2, (n, err)
