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
from conftest import metrics, run_trainer, transformer_inputs, write_config

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


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("rows, cols, with_bias, dtype", [
    (37, 200, False, BF16), (37, 200, True, BF16), (37, 200, True, FP32), (9, 12288, True, BF16),
    (64, 1000, False, FP32)], ids=["ragged", "bias", "bias_fp32", "mlp_width", "rows_fp32"])
def test_kernel_equals_the_unfused_quantisation(interpreter, rows, cols, with_bias, dtype):
    """e4m3 bytes and row scales of quantize_rows(gelu_tanh(y + bias)) at widths of one ragged chunk (200 of the
    interpreter's 512 columns), two (1000: the second ragged) and the MLP's 12288 (24 chunks, two passes each).
    bf16 (the trainer's dtype): scales identical, bytes identical but for at most 0.1% one step apart; fp32 (no bf16
    rounding to absorb the tanh's last bit): scales within 2 float32 ulps. The bias is bf16 as the model's, added
    after a cast to y's dtype as Float8FrozenLinear adds it; y = h - bias, so y + bias is about the rows above."""
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


def _linear8(n_in: int, n_out: int, seed: int, keep_transposed: bool = False) -> fp8.Float8FrozenLinear:
    torch.manual_seed(seed)
    return fp8.Float8FrozenLinear(torch.nn.Linear(n_in, n_out).requires_grad_(False), "token", keep_transposed)


@pytest.mark.parametrize("rows, cols, dtype", [(37, 200, BF16), (37, 200, FP32), (9, 12288, BF16)],
                         ids=["ragged", "ragged_fp32", "mlp_width"])
def test_backward_kernel_equals_the_unfused_quantisation(interpreter, rows, cols, dtype):
    """The backward kernel against quantize_rows(aten.gelu_backward(dg, y + bias) * s_up), gradients of rows four
    decades apart: bf16 scales identical, bytes identical but for at most 0.1% one step apart (aten's CPU derivative
    and the kernel's differ in their last bits); fp32 scales within 2e-6."""
    torch.manual_seed(4)
    y = (torch.randn(rows, cols) * 2).to(dtype)
    dg = (torch.randn(rows, cols) * torch.logspace(-3, 1, rows)[:, None]).to(dtype)
    bias, col_scale = (torch.randn(cols) * 0.5).to(torch.bfloat16), torch.rand(cols) * 0.01 + 1e-3
    q, scale = fused.gelu_backward_quant_rows(dg, y, bias, col_scale)
    grad_h = torch.ops.aten.gelu_backward(dg, y + bias.to(dtype), approximate="tanh")
    q_ref, scale_ref = fp8.quantize_rows(grad_h * col_scale.view(1, -1))
    if dtype == torch.bfloat16:
        assert torch.equal(scale, scale_ref)
    else:
        torch.testing.assert_close(scale, scale_ref, rtol=2e-6, atol=0)
    differing, one_step = _one_step_apart(q, q_ref)
    assert one_step and differing <= 1e-3 * q.numel(), f"{differing} of {q.numel()} bytes differ"


def test_fused_linear_forward_and_gradient(interpreter):
    """An MLP whose up projection carries LoRA: net.2 = linear(gelu(h)) fused against the unfused modules, bf16,
    ragged width: outputs within the rare one-step differences' effect; input gradients identical (the same fp8
    matmul and aten.gelu_backward on the same h)."""
    down = _linear8(200, 48, seed=1)
    fused_lin = fused.GeluFloat8Linear.from_float8(down)
    assert fused_lin.weight_fp8 is down.weight_fp8 and fused_lin.bias is down.bias  # shared, not copied
    h = (torch.randn(3, 37, 200) * 2).to(torch.bfloat16).requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)
    y, y_ref = fused_lin(h), down(torch.nn.functional.gelu(h_ref, approximate="tanh"))
    assert y.shape == y_ref.shape == (3, 37, 48) and y.dtype == torch.bfloat16
    assert ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item() < 1e-3
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(h.grad, h_ref.grad)


@pytest.mark.parametrize("transposed", [False, True], ids=["plain", "fp8_transposed"])
def test_fused_mlp_forward_and_gradient(interpreter, transposed):
    """Both projections bare (no LoRA): net.2 runs the whole MLP, against up -> GELU -> down unfused, bf16, ragged
    hidden width: outputs and input gradients within 1e-3 (the kernels' rare one-step differences; the same
    fp8 matmuls otherwise), with and without the stored transposed weights."""
    up, down = _linear8(48, 200, 2, transposed), _linear8(200, 48, 3, transposed)
    assert (up.weight_fp8_t is not None) == transposed
    fused_mlp = fused.GeluFloat8Linear.from_float8(down, up)
    x = (torch.randn(2, 19, 48) * 2).to(torch.bfloat16).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = fused_mlp(x), down(torch.nn.functional.gelu(up(x_ref), approximate="tanh"))
    assert y.shape == y_ref.shape == (2, 19, 48)
    assert ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item() < 1e-3
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert ((x.grad.float() - x_ref.grad.float()).norm() / x_ref.grad.float().norm()).item() < 1e-3


def test_fused_mlps_in_the_model(interpreter):
    """fuse_mlps on the tiny model (LoRA on the image MLP's up projection and on attention): every MLP fused (the
    text MLPs whole, forward and backward; the image MLPs from the GELU on: LoRA reads the up projection's output),
    state-dict names unchanged, outputs and LoRA gradients as the unfused model's; LoRA on img_mlp.net.2 leaves
    those MLPs unfused."""
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
    assert not block.img_mlp.net[0].passthrough and block.img_mlp.net[2]._up == ()  # LoRA on the up projection
    assert block.txt_mlp.net[0].passthrough and block.txt_mlp.net[2]._up == (block.txt_mlp.net[0].proj,)
    assert fused.describe(model) == ("train.fused_quant: 4 of 4 MLPs fused: 2 whole (forward and backward kernels), "
                                     "2 forward only (LoRA wraps their up projection)")
    torch.manual_seed(2)
    inputs = transformer_inputs(model, 4, 4, 8)
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
    assert fused.describe(wrapped) == ("train.fused_quant: 2 of 4 MLPs fused: 2 whole (forward and backward "
                                       "kernels); 2 unfused: the down projection (net.2) carries LoRA, which reads "
                                       "the bf16 GELU output")


def test_compiled_graph_holds_the_kernel(monkeypatch):
    """torch.compile (fullgraph: no graph break) traces the whole-MLP autograd.Function with the triton_ops inside:
    the forward kernel sits between the two _scaled_mm (no unfused gelu there), the backward kernel between the
    backward's two (no unfused gelu_backward). Traced with fake tensors only (real JIT kernels; this machine has no
    GPU to run them, so torch cannot read which arguments a kernel writes and treats them all as written)."""
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

    fused_mlp = fused.GeluFloat8Linear.from_float8(_linear8(200, 48, 3), _linear8(48, 200, 2))
    x = torch.randn(2, 19, 48, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with pytest.raises(Traced):
        torch.compile(fused_mlp, backend=aot_autograd(fw_compiler=forward_compiler, partition_fn=partition),
                      fullgraph=True)(x)
    forward, joint = graphs["forward"], graphs["joint"]
    assert forward.count("triton_kernel_wrapper_functional(") == 1 and "'HAS_BIAS': True" in forward
    assert forward.count("_scaled_mm.default(") == 2 and "aten.gelu.default" not in forward
    # the backward: the down projection's input gradient, the GELU-gradient kernel, the up projection's matmul
    assert joint.count("triton_kernel_wrapper_functional(") == 2 and joint.count("_scaled_mm.default(") == 4
    assert "gelu_backward" not in joint and "'dg_ptr'" in joint


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
    up, down = _linear8(48, 200, 2), _linear8(200, 48, 3)  # the kernels cannot run: the unfused computation
    x = torch.randn(5, 48, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = fused.GeluFloat8Linear.from_float8(down, up)(x)
    y_ref = down(torch.nn.functional.gelu(up(x_ref), approximate="tanh"))
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_prepare_for_training_fuses_under_the_interpreter(interpreter):
    """components.prepare_for_training(fused_quant=True) swaps the fused path in where the kernel can run."""
    model = build_transformer()
    components.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]),
                                    False, False, fp8_base=True, fused_quant=True)
    assert sum(isinstance(m, fused.GeluFloat8Linear) for m in model.modules()) == 2 * len(model.transformer_blocks)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_gpu_kernels_compile_for_hopper(backward):
    """The kernels' GPU branch (what no CPU test runs) compiles for sm_90a with triton's own ptxas, offline: the
    hardware e4m3 cast (round to nearest even, saturating), IEEE division as torch's (not the 2-ulp div.full)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"y_ptr": "*bf16", "bias_ptr": "*bf16", "scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "n_cols": "i32",
                 "HAS_BIAS": "constexpr", "BLOCK": "constexpr", "INTERPRETER": "constexpr"}
    if backward:
        signature = {"dg_ptr": "*bf16", **dict(list(signature.items())[:2]), "col_scale_ptr": "*fp32",
                     **dict(list(signature.items())[2:])}
    source = ASTSource(fused._kernel(False, backward), signature,
                       constexprs={"HAS_BIAS": True, "BLOCK": fused.BLOCK_COLS, "INTERPRETER": False})
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as e:  # a triton without its CUDA backend's tools (ptxas)
        pytest.skip(f"triton cannot compile for CUDA here: {e}")
    ptx = kernel.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
    assert "cubin" in kernel.asm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_equal_the_unfused_path():
    """On the GPU (libdevice's tanh, the hardware e4m3 cast), at the full model's MLP width: both kernels against
    eager torch, then the whole MLP compiled by inductor against the unfused modules, forward and input gradient."""
    y = _rows(512, 12288, torch.bfloat16).cuda()
    bias = (torch.randn(12288) * 0.5).to(torch.bfloat16).cuda()
    dg, col_scale = torch.randn_like(y), torch.rand(12288, device="cuda") * 0.01 + 1e-3
    for (q, scale), (q_ref, scale_ref) in [
        (fused.gelu_quant_rows(y, bias), fp8.quantize_rows(torch.nn.functional.gelu(y + bias, approximate="tanh"))),
        (fused.gelu_backward_quant_rows(dg, y, bias, col_scale),
         fp8.quantize_rows(torch.ops.aten.gelu_backward(dg, y + bias, approximate="tanh") * col_scale))]:
        assert torch.equal(scale, scale_ref)
        differing, one_step = _one_step_apart(q, q_ref)
        assert one_step and differing <= 1e-4 * q.numel(), f"{differing} of {q.numel()} bytes differ"
    up, down = _linear8(3072, 12288, 2).cuda(), _linear8(12288, 3072, 3).cuda()
    x = (torch.randn(4, 256, 3072, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    z = torch.compile(fused.GeluFloat8Linear.from_float8(down, up))(x)
    z_ref = down(torch.nn.functional.gelu(up(x_ref), approximate="tanh"))
    assert ((z.float() - z_ref.float()).norm() / z_ref.float().norm()).item() < 1e-3
    dz = torch.randn_like(z)
    z.backward(dz)
    z_ref.backward(dz)
    assert ((x.grad.float() - x_ref.grad.float()).norm() / x_ref.grad.float().norm()).item() < 1e-3


def test_trainer_falls_back_with_a_notice(tiny_edit, tmp_path, monkeypatch):
    """train/main.py with train.fused_quant (fp8 base, LoRA on attention) on this CPU: one notice line says why the
    unfused fp8 path runs, no traceback, and the 2 steps train to finite losses (the fused path in a model prepared
    as the trainer prepares it: test_prepare_for_training_fuses_under_the_interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = write_config(tmp_path / "cfg.json", **{"qwen_edit.train.fp8_base": True, "qwen_edit.train.fused_quant": True,
                                                "qwen_edit.lora.target_modules": ["attn.to_q", "attn.to_v"],
                                                "qwen_edit.output.log_every_steps": 1})
    proc = run_trainer(tiny_edit, tmp_path / "run", config=cfg, extra=("--max_steps", "2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    notice = [line for line in proc.stdout.splitlines() if line.startswith("train.fused_quant:")]
    assert notice == ["train.fused_quant: no CUDA device (the Triton kernel runs on CUDA; TRITON_INTERPRET=1 runs it "
                      "on the CPU for tests); the unfused fp8 path runs"], notice
    assert "Traceback" not in proc.stderr
    losses = [r["loss"] for r in metrics(tmp_path / "run")]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


def test_fused_mlps_with_offloaded_blocks(interpreter):
    """Offloaded blocks (train.offload_blocks: their frozen tensors swapped in and out of device slots) give
    exactly the resident fused model's loss and LoRA gradients: the whole-MLP path reads net.0.proj's e4m3 weights
    through the module at each call, so it sees the slot they are in."""
    def run(offload: set[int]):
        torch.manual_seed(0)
        model = build_transformer()
        components.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]),
                                        True, False, fp8_base=True, fused_quant=True, offload=offload)
        assert model.transformer_blocks[0].img_mlp.net[2]._up  # the whole-MLP path
        loss = model(**transformer_inputs(model, 4, 4, 8, torch.Generator().manual_seed(5)))[0].square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (loss_a, grads_a), (loss_b, grads_b) = run(set()), run({0, 1})
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
