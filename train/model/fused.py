"""Fused elementwise work around the fp8 base (`train.fused_quant`, issue 16): opt-in, not measured on a GPU yet.

What it fuses. In each block MLP (diffusers' FeedForward: net.0 = GELU(tanh) module around the up projection,
net.1 = dropout, net.2 = the down projection) the unfused fp8 path computes g = gelu(h) in bf16 and then the down
projection's `fp8.quantize_rows(g)`: an absmax over each row and a division/cast pass, in kernels inductor
generates. Here one Triton kernel reads each row of h once and writes the e4m3 row of gelu(h) and its fp32 scale;
the bf16 g is never written. `_scaled_mm` then runs as before.

How it is hooked in, without copying diffusers' forward: net.0 becomes `PreActivation` (its `proj`, LoRA-wrapped
or not, under the same name, without the activation) and net.2 becomes `GeluFloat8Linear` (the same e4m3 buffers
and bias, the activation folded in), so FeedForward's own loop passes h from one to the other and state-dict
names do not change. The kernel is a `torch.library.triton_op`, which torch.compile traces inside the compiled
blocks; an autograd.Function around it gives the input gradient.

What it saves for the backward: h (bf16), as the unfused path does (GELU's gradient needs its input; the fp8 down
projection saves nothing of its input since the weight is frozen). The backward is the unfused one: dg from the
fp8 matmul (fp8.input_gradient), then aten.gelu_backward(dg, h), which inductor fuses into the up projection's
quantisation as before.

Where it does not apply: an MLP whose down projection carries LoRA (lora.target_modules names img_mlp.net.2 /
txt_mlp.net.2) keeps the unfused path, since LoRA reads the bf16 GELU output; the benchmark's and the speed
table's workload (LoRA on the attention projections) fuses every MLP. The attention and MLP inputs (LayerNorm +
modulation + quantise) are not fused: the modulation happens in the block's forward and the three q/k/v
projections each quantise it inside diffusers' attention processor, so fusing them means rewriting both.

The Triton interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors for the tests; there the tanh is
computed from exp (libdevice is GPU-only), on the GPU with libdevice's tanh as torch's CUDA GELU does.
"""

from __future__ import annotations

import functools
import os

import torch
from diffusers.models.activations import GELU

from train.model import fp8

_IMPORT_ERROR = ""
try:  # triton ships with torch's CUDA wheels; without it the fused path falls back (unavailable() says why)
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
    from triton.language.extra import libdevice
except ImportError as e:
    triton = None
    _IMPORT_ERROR = str(e)

MAX_COLS = 32768  # one row per program, held whole in registers (the MLP's 12288 columns take a 16384 block)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable() -> str | None:
    """Why the fused kernel cannot run here, or None when it can (a CUDA device, or the interpreter)."""
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if not torch.cuda.is_available() and not interpreted():
        return "no CUDA device (the Triton kernel runs on CUDA; TRITON_INTERPRET=1 runs it on the CPU for tests)"
    return None


def _gelu_quant_rows_kernel(y_ptr, bias_ptr, scale_ptr, q_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                            INTERPRETER: tl.constexpr):
    """One row per program: h = y + bias, g = gelu_tanh(h), scale = absmax(g) / 448, q = e4m3(g / scale), with h and
    g rounded to y's dtype as the unfused path's tensors are. Masked lanes load 0 (and the bias 0), gelu(0) = 0, so
    the absmax ignores them. Reads y once, writes q and one scale: h and g never reach memory."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # y + bias.to(y.dtype), as fp8.Float8FrozenLinear adds it
        h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
        if not INTERPRETER:
            h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
        elif y_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter's casts truncate: round to nearest even
            bits = h.to(tl.int32, bitcast=True)
            h = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    inner = 0.7978845608028654 * (h + 0.044715 * (h * h * h))  # sqrt(2 / pi) (x + 0.044715 x^3)
    if INTERPRETER:  # no libdevice: tanh from exp, odd-symmetric so that large |inner| does not overflow
        e = tl.exp(-2.0 * tl.abs(inner))
        t = tl.where(inner < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    else:
        t = libdevice.tanh(inner)
    g = 0.5 * h * (1.0 + t)
    if not INTERPRETER:
        g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
    elif y_ptr.dtype.element_ty == tl.bfloat16:  # as for h above
        bits = g.to(tl.int32, bitcast=True)
        g = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    # tl.max(x, 0) spelt as what it calls: tl.max is itself jitted when triton is imported, so the interpreter
    # cannot call it unless TRITON_INTERPRET was set before that import; it does run tl.reduce with this combine.
    scale = tl.maximum(tl.reduce(tl.abs(g), 0, tl.standard._elementwise_max), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(g / scale, -448.0), 448.0)
    if INTERPRETER:  # its float32 -> e4m3 cast does not round to nearest even as the GPU and torch do: round |q|
        # on the e4m3 grid in float32 (3 mantissa bits: spacing 2^(exponent - 3), 2^-9 below the normals' 2^-6)
        # by adding and taking away 1.5 * 2^23 spacings, then cast an exact value; the sign kept (so -0 stays -0)
        bits = q.to(tl.int32, bitcast=True)
        power = (bits & 0x7F800000).to(tl.float32, bitcast=True)
        big = tl.maximum(power, 0.015625) * 0.125 * 12582912.0
        rounded = ((tl.abs(q) + big) - big).to(tl.int32, bitcast=True)
        q = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)  # | the sign bit
    tl.store(q_ptr + row * n_cols + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, scale)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel; jitted at first use (and again if TRITON_INTERPRET changes), since triton.jit reads
    TRITON_INTERPRET when it wraps the function."""
    return triton.jit(_gelu_quant_rows_kernel)


def _launch(y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y (M, N) contiguous, bias (N,) or None -> (e4m3 (M, N), fp32 scale (M, 1)):
    fp8.quantize_rows(gelu_tanh(y + bias)) in one pass over y."""
    rows, cols = y.shape
    q = torch.empty((rows, cols), dtype=fp8.E4M3, device=y.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=y.device)
    block = triton.next_power_of_2(cols)
    interpret = interpreted()
    wrap_triton(_kernel(interpret))[(rows,)](y, y if bias is None else bias, scale, q, cols, HAS_BIAS=bias is not None,
                                             BLOCK=block, INTERPRETER=interpret,
                                             num_warps=min(16, max(4, block // 1024)))
    return q, scale


if triton is not None:
    gelu_quant_rows = triton_op("qwen_edit::gelu_quant_rows", _launch, mutates_args=())


def kernel_runs(y: torch.Tensor) -> bool:
    """Whether the kernel can run on `y` here: triton, and a CUDA tensor or the interpreter (else: unfused)."""
    return triton is not None and (y.device.type == "cuda" or interpreted())


def gelu_quantized(y2: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows(gelu_tanh(y2 + bias)) for y2 (M, N): by the fused kernel, or unfused where it cannot run."""
    if use_kernel and y2.dtype in (torch.bfloat16, torch.float32):  # the dtypes the interpreter's path rounds
        return gelu_quant_rows(y2.contiguous(), bias)
    return fp8.quantize_rows(torch.nn.functional.gelu(_add_bias(y2, bias), approximate="tanh"))


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class _GeluFloat8Matmul(torch.autograd.Function):
    """z = gelu_tanh(y + up_bias) W^T for a frozen e4m3 weight with per-row scales; gradient for y only."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, up_bias: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
                weight_t: torch.Tensor | None, use_kernel: bool) -> torch.Tensor:
        # y: the up projection's output, saved as the unfused path saves GELU's input (the same bytes); the bias is
        # added again in the backward, inside the pointwise gelu_backward that inductor generates
        ctx.save_for_backward(y, up_bias, weight, scale, weight_t)
        q, q_scale = gelu_quantized(y.reshape(-1, y.shape[-1]), up_bias, use_kernel)
        z = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.view(1, -1), out_dtype=y.dtype)
        return z.view(*y.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y, up_bias, weight, scale, weight_t = ctx.saved_tensors
        grad_g = fp8.input_gradient(grad_out, weight, scale, weight_t)
        grad_y = torch.ops.aten.gelu_backward(grad_g, _add_bias(y, up_bias), approximate="tanh")
        return grad_y, None, None, None, None, None


class GeluFloat8Linear(fp8.Float8FrozenLinear):
    """An MLP's fp8 down projection with the tanh GELU before it (and the up projection's bias, when PreActivation
    leaves it out) folded in: forward(y) = linear(gelu(y + up_bias)), the bias, GELU and row quantisation in one
    kernel where it can run (a CUDA tensor, or the Triton interpreter)."""

    @classmethod
    def from_float8(cls, linear: fp8.Float8FrozenLinear, up_bias: torch.Tensor | None = None) -> GeluFloat8Linear:
        """The same e4m3 buffers and bias under the same names (nothing copied or quantised again); up_bias: the
        frozen up projection's bias, kept as a non-persistent buffer (its parameter stays where it was)."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        for name in ("weight_fp8", "weight_scale", "weight_fp8_t"):
            module.register_buffer(name, getattr(linear, name), persistent=False)
        module.register_buffer("up_bias", None if up_bias is None else up_bias.detach(), persistent=False)
        module.bias = linear.bias
        module.in_features, module.out_features, module.kind = linear.in_features, linear.out_features, "token"
        return module

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        z = _GeluFloat8Matmul.apply(y, self.up_bias, self.weight_fp8, self.weight_scale, self.weight_fp8_t,
                                    kernel_runs(y))
        return z if self.bias is None else z + self.bias.to(z.dtype)

    def extra_repr(self) -> str:
        folded = " + the up projection's bias" if self.up_bias is not None else ""
        return super().extra_repr() + f", tanh GELU{folded} on its input (fused with the row quantisation)"


class PreActivation(torch.nn.Module):
    """diffusers' GELU module without its activation: the same `proj` (LoRA-wrapped or not) under the same name;
    the GELU moves into the GeluFloat8Linear that follows. fold_bias (a bare fp8 proj only): leave out proj's bias
    too, which the kernel adds (one pass less over the hidden: y + bias is never written)."""

    def __init__(self, gelu: GELU, fold_bias: bool = False):
        super().__init__()
        self.proj, self.fold_bias = gelu.proj, fold_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj.matmul(x) if self.fold_bias else self.proj(x)


def why_not(ff: torch.nn.Module) -> str | None:
    """Why the FeedForward `ff` cannot take the fused path (None: it can)."""
    net = getattr(ff, "net", None)
    if net is None or len(net) != 3 or not isinstance(net[0], GELU) or net[0].approximate != "tanh":
        return "not diffusers' GELU(tanh) -> dropout -> linear FeedForward"
    if not (isinstance(net[1], torch.nn.Identity) or (isinstance(net[1], torch.nn.Dropout) and net[1].p == 0)):
        return "its dropout is not 0"
    if type(net[2]) is not fp8.Float8FrozenLinear:
        return ("its down projection (net.2) carries LoRA, which reads the bf16 GELU output"
                if hasattr(net[2], "base_layer") else "its down projection is not an fp8 token linear")
    if net[2].in_features > MAX_COLS:
        return f"its hidden width {net[2].in_features} is over the kernel's {MAX_COLS} columns"
    return None


def _mlps(transformer: torch.nn.Module):
    for i, block in enumerate(transformer.transformer_blocks):
        for stream in ("img_mlp", "txt_mlp"):
            yield f"transformer_blocks.{i}.{stream}", getattr(block, stream)


def fuse_mlps(transformer: torch.nn.Module) -> int:
    """Swap the fused GELU + quantise path into every block MLP that takes it (why_not is None), in place, after
    fp8.convert_frozen_linears; returns how many."""
    count = 0
    for _, ff in _mlps(transformer):
        if why_not(ff) is None:
            proj = ff.net[0].proj
            fold = type(proj) is fp8.Float8FrozenLinear and proj.bias is not None  # no LoRA around it
            ff.net[0] = PreActivation(ff.net[0], fold_bias=fold)
            ff.net[2] = GeluFloat8Linear.from_float8(ff.net[2], proj.bias if fold else None)
            count += 1
    return count


def describe(transformer: torch.nn.Module) -> str:
    """One line for the log: how many MLPs take the fused path, why the others do not (or why none can here)."""
    reason = unavailable()
    if reason is not None:
        return f"train.fused_quant: {reason}; the unfused fp8 path runs"
    fused = [isinstance(ff.net[2], GeluFloat8Linear) for _, ff in _mlps(transformer)]
    reasons = sorted({why_not(ff) for _, ff in _mlps(transformer) if not isinstance(ff.net[2], GeluFloat8Linear)})
    rest = f"; {fused.count(False)} unfused: {'; '.join(reasons)}" if reasons else ""
    return f"train.fused_quant: {sum(fused)} of {len(fused)} MLPs take the fused GELU + e4m3 row-quantise kernel{rest}"
