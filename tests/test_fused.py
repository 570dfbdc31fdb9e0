"""train.model.fused (train.fused_quant): the GELU + e4m3 row-quantise Triton kernel against the unfused path.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set per test by the `interpreter` fixture:
train/model/fused.py jits the kernel at first use, under the setting of that moment). The interpreter's float32 ->
bf16 and -> e4m3 casts truncate, so the kernel rounds to nearest even by hand there, and its tanh comes from exp
(libdevice is GPU-only); that last-bit difference in gelu moves a value across a rounding boundary now and then,
hence "identical but for rare one-step differences" below. The GPU-marked test checks the CUDA kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import transformer_inputs

from train.config import LoraConfig
from train.model import components, fp8, fused
from train.model.tiny import build_transformer

pytestmark = pytest.mark.skipif(fused.triton is None, reason="triton is not installed")


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter for this test; the kernel jitted under it really is the interpreted one."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.interpreted() and isinstance(fused._kernel(True), InterpretedFunction)


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows four decades apart in magnitude (a lane read from the next row would change a scale), a zero row and a
    row below -12 (gelu is -0 there: the sign bit must survive)."""
    torch.manual_seed(seed)
    h = torch.randn(rows, cols) * 2 * torch.logspace(-2, 2, rows)[:, None]
    h[1] = 0
    h[2] = -torch.rand(cols) * 8 - 12
    return h.to(dtype)


def _one_step_apart(q: torch.Tensor, ref: torch.Tensor) -> tuple[int, bool]:
    """How many e4m3 bytes differ, and whether each of those is one representable value away (same sign)."""
    diff = q.view(torch.uint8).int() - ref.view(torch.uint8).int()
    return int((diff != 0).sum()), bool((diff.abs() <= 1).all())


@pytest.mark.parametrize("rows, cols, with_bias", [(37, 200, False), (37, 200, True), (9, 12288, True),
                                                   (64, 1000, False)], ids=["ragged", "bias", "mlp_width", "rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_unfused_quantisation(interpreter, rows, cols, with_bias, dtype):
    """e4m3 bytes and row scales of quantize_rows(gelu_tanh(y + bias)), widths that leave the last block ragged (200
    of 256, 12288 of 16384, 1000 of 1024). bf16 (the trainer's dtype): scales identical, bytes identical but for at
    most 0.1% one step apart; fp32 (no bf16 rounding to absorb the tanh's last bit): scales within 2 float32 ulps.
    The bias (bf16 as the model's, added after a cast to y's dtype as Float8FrozenLinear adds it) is 0 on rows 1-2."""
    h = _rows(rows, cols, dtype)
    bias = (torch.randn(cols) * 0.5).to(torch.bfloat16) if with_bias else None
    y = h if bias is None else h - bias.to(dtype)  # rows 1-2 keep their meaning after y + bias (up to rounding)
    q, scale = fused.gelu_quant_rows(y, bias)
    expected = y if bias is None else y + bias.to(dtype)
    q_ref, scale_ref = fp8.quantize_rows(torch.nn.functional.gelu(expected, approximate="tanh"))
    assert q.dtype == fp8.E4M3 and q.shape == h.shape and scale.shape == (rows, 1) and scale.dtype == torch.float32
    if dtype == torch.bfloat16:
        assert torch.equal(scale, scale_ref)
    else:
        torch.testing.assert_close(scale, scale_ref, rtol=2.4e-7, atol=0)
    differing, one_step = _one_step_apart(q, q_ref)
    assert one_step and differing <= 1e-3 * q.numel(), f"{differing} of {q.numel()} bytes differ"
    if bias is None:
        assert torch.equal(q[1].float(), torch.zeros(cols))  # the zero row: all zeros at the floor scale
        assert scale[1].item() == pytest.approx(1e-12 / fp8.E4M3_MAX)
    assert (q[2].view(torch.uint8) == 0x80).all()  # -0, as torch's cast gives


def test_kernel_where_gelu_is_ill_conditioned(interpreter):
    """h in [-9, -3]: gelu = 0.5 h (1 + tanh) with 1 + tanh down to ~1e-7, so the last bit of tanh (the
    interpreter's from exp, torch's CPU one) moves the value by up to ~1e-3 relative and ~3% of the bytes land one
    bf16 rounding apart. The scales (set by h near -3, well conditioned) stay identical, the dequantised rows
    within 1e-3; on the GPU both sides use libdevice's tanh."""
    torch.manual_seed(3)
    h = (-torch.rand(8, 1000) * 6 - 3).to(torch.bfloat16)
    q, scale = fused.gelu_quant_rows(h)
    q_ref, scale_ref = fp8.quantize_rows(torch.nn.functional.gelu(h, approximate="tanh"))
    assert torch.equal(scale, scale_ref)
    deq, deq_ref = q.float() * scale, q_ref.float() * scale_ref
    assert ((deq - deq_ref).norm() / deq_ref.norm()).item() < 1e-3


def _pair(cols: int, out: int, up_bias: torch.Tensor | None = None):
    """(fused GeluFloat8Linear, the unfused Float8FrozenLinear) sharing one e4m3 weight with a bias."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(cols, out).requires_grad_(False)
    base = fp8.Float8FrozenLinear(lin, "token")
    return fused.GeluFloat8Linear.from_float8(base, up_bias), base


@pytest.mark.parametrize("with_bias", [False, True], ids=["gelu", "bias_folded"])
def test_fused_linear_forward_and_gradient(interpreter, with_bias):
    """linear(gelu(h + up_bias)) fused against the unfused modules, bf16, ragged width: outputs within the rare
    one-step differences' effect; input gradients identical (the same fp8 matmul, aten.gelu_backward on the same
    h, the bias added again in the backward with the forward's rounding)."""
    up_bias = torch.randn(200).to(torch.bfloat16) if with_bias else None
    fused_lin, base = _pair(200, 48, up_bias)
    assert fused_lin.weight_fp8 is base.weight_fp8 and fused_lin.bias is base.bias  # shared, not copied
    h = (torch.randn(3, 37, 200) * 2).to(torch.bfloat16).requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)
    y = fused_lin(h)
    y_ref = base(torch.nn.functional.gelu(h_ref if up_bias is None else h_ref + up_bias, approximate="tanh"))
    assert y.shape == y_ref.shape == (3, 37, 48) and y.dtype == torch.bfloat16
    assert ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item() < 1e-3
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(h.grad, h_ref.grad)


def test_fused_mlps_in_the_model(interpreter):
    """fuse_mlps on the tiny model (LoRA on the image MLP's up projection and on attention): every MLP fused (the
    text MLPs' up-projection bias folded into the kernel, the image MLPs' not: LoRA reads their output), state-dict
    names unchanged, outputs and LoRA gradients as the unfused model's; LoRA on img_mlp.net.2 leaves those unfused."""
    model = build_transformer()
    components.add_lora(model, LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "img_mlp.net.0.proj"]))
    fp8.convert_frozen_linears(model)
    with torch.no_grad():  # LoRA B starts at 0, which would leave every A gradient 0 on both sides
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    reference = copy.deepcopy(model)
    assert fused.fuse_mlps(model) == 2 * len(model.transformer_blocks)
    assert list(model.state_dict()) == list(reference.state_dict())
    block = model.transformer_blocks[0]
    assert not block.img_mlp.net[0].fold_bias and block.img_mlp.net[2].up_bias is None
    assert block.txt_mlp.net[0].fold_bias and torch.equal(block.txt_mlp.net[2].up_bias, block.txt_mlp.net[0].proj.bias)
    assert "4 of 4 MLPs" in fused.describe(model)
    torch.manual_seed(2)
    inputs = transformer_inputs(model)
    out, out_ref = model(**inputs)[0], reference(**inputs)[0]
    assert ((out - out_ref).norm() / out_ref.norm()).item() < 1e-5
    out.square().mean().backward()
    out_ref.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name, p in reference.named_parameters():
        if p.requires_grad:
            assert ((grads[name] - p.grad).norm() / p.grad.norm()).item() < 1e-4, name
    wrapped = build_transformer()
    components.add_lora(wrapped, LoraConfig(rank=4, alpha=4.0, target_modules=["img_mlp.net.2"]))
    fp8.convert_frozen_linears(wrapped)
    assert fused.fuse_mlps(wrapped) == len(wrapped.transformer_blocks)  # the text MLPs only
    assert "2 of 4 MLPs" in fused.describe(wrapped) and "carries LoRA" in fused.describe(wrapped)


def test_compiled_graph_holds_the_kernel(monkeypatch):
    """torch.compile (fullgraph: no graph break) traces the autograd.Function with the triton_op inside: the
    kernel is a node of the forward graph feeding _scaled_mm (no unfused gelu there), and the joint graph has the
    backward's gelu_backward. Traced with fake tensors only (a real JIT kernel; this machine has no GPU to run it,
    so torch cannot read which arguments the kernel writes and treats them all as written: it clones them)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused, "kernel_runs", lambda h: True)
    graphs = {}

    class Traced(Exception):
        pass

    def partition(joint, inputs, **kwargs):
        graphs["joint"] = joint.code
        return default_partition(joint, inputs, **kwargs)

    def forward_compiler(gm, inputs):
        graphs["forward"] = gm.code

        def run(*args):
            raise Traced  # nothing to run it on

        return run

    fused_lin, _ = _pair(200, 48, up_bias=torch.randn(200).to(torch.bfloat16))
    h = torch.randn(2, 19, 200, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with pytest.raises(Traced):
        torch.compile(fused_lin, backend=aot_autograd(fw_compiler=forward_compiler, partition_fn=partition),
                      fullgraph=True)(h)
    forward = graphs["forward"]
    assert "triton_kernel_wrapper_functional" in forward and "_scaled_mm" in forward and "'HAS_BIAS': True" in forward
    assert "aten.gelu.default" not in forward and "gelu_backward" in graphs["joint"]


def test_fallback_without_cuda(monkeypatch):
    """No CUDA and no interpreter (this CPU), or no triton: nothing is swapped, the notice says why, and the
    module falls back to the unfused computation where the kernel cannot run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build_transformer()
    components.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]),
                                    False, False, fp8_base=True, fused_quant=True)
    assert not any(isinstance(m, fused.GeluFloat8Linear) for m in model.modules())
    assert fused.describe(model).startswith("train.fused_quant: no CUDA device") and "unfused" in fused.describe(model)
    monkeypatch.setattr(fused, "triton", None)
    assert fused.unavailable().startswith("triton is not importable")
    fused_lin, base = _pair(200, 48)  # the kernel cannot run: the same values by the unfused computation
    h = torch.randn(5, 200)
    assert torch.equal(fused_lin(h), base(torch.nn.functional.gelu(h, approximate="tanh")))


def test_prepare_for_training_fuses_under_the_interpreter(interpreter):
    """components.prepare_for_training(fused_quant=True) swaps the fused path in where the kernel can run."""
    model = build_transformer()
    components.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]),
                                    False, False, fp8_base=True, fused_quant=True)
    assert sum(isinstance(m, fused.GeluFloat8Linear) for m in model.modules()) == 2 * len(model.transformer_blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_equals_the_unfused_quantisation():
    """On the GPU (libdevice's tanh, the hardware e4m3 cast): the kernel against eager quantize_rows(gelu(h)) at the
    full model's MLP width, and compiled by inductor inside a block-like function."""
    h = _rows(512, 12288, torch.bfloat16).cuda()
    q, scale = fused.gelu_quant_rows(h)
    q_ref, scale_ref = fp8.quantize_rows(torch.nn.functional.gelu(h, approximate="tanh"))
    assert torch.equal(scale, scale_ref)
    differing, one_step = _one_step_apart(q, q_ref)
    assert one_step and differing <= 1e-4 * q.numel(), f"{differing} of {q.numel()} bytes differ"
    up_bias = torch.randn(12288, device="cuda").to(torch.bfloat16)
    fused_lin, base = _pair(12288, 3072, up_bias.cpu())
    fused_lin, base = fused_lin.cuda(), base.cuda()
    x = h.view(4, 128, 12288)
    y, y_ref = torch.compile(fused_lin)(x), base(torch.nn.functional.gelu(x + up_bias, approximate="tanh"))
    assert ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item() < 1e-3
