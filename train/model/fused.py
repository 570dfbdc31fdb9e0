"""Fused elementwise work around the fp8 base (`train.fused_quant`, issue 16): opt-in, not measured on a GPU yet.

What it fuses. In each block MLP (diffusers' FeedForward: net.0 = GELU(tanh) module around the up projection,
net.1 = dropout, net.2 = the down projection) the unfused fp8 path runs, in kernels inductor generates: forward,
y + bias, g = gelu(y + bias) in bf16 and the down projection's `fp8.quantize_rows(g)` (a row absmax and a
division/cast pass); backward, gelu_backward(dg, y + bias), the up projection's row scales folded in, and its
`fp8.quantize_rows`. Here a Triton kernel does each of the two from the matmul output to the e4m3 rows and their
scales, reading its inputs from memory once; the bf16 intermediates are never written. docs/perf_notes.md
(lever 24) counts the bytes.

How it is hooked in, without copying diffusers' forward: net.2 becomes `GeluFloat8Linear` (the same e4m3 buffers
and bias under the same names) and net.0 `PreActivation` (its `proj` under the same name, without the activation).
Where no LoRA wraps the up projection, PreActivation passes x through and GeluFloat8Linear runs the whole MLP
(`_FusedMLP`, reading net.0.proj's e4m3 weights), so that both directions fuse; where LoRA wraps it,
PreActivation returns proj(x) and GeluFloat8Linear fuses the forward only (`_GeluFloat8Matmul`). FeedForward's own
loop calls both; state-dict names do not change. The kernels are `torch.library.triton_op`s, which torch.compile
traces inside the compiled blocks; the autograd.Functions around them give the input gradient.

What is saved for the backward: y (bf16), the bytes the unfused path saves as GELU's input; the fp8 projections
save nothing of their inputs (frozen weights).

Where it does not apply: an MLP whose down projection carries LoRA (lora.target_modules names img_mlp.net.2 /
txt_mlp.net.2) keeps the unfused path, since LoRA reads the bf16 GELU output; the benchmark's and the speed
table's workload (LoRA on the attention projections) fuses every MLP whole. The attention and MLP inputs (LayerNorm
+ modulation + quantise) are not fused: the modulation happens in the block's forward and the three q/k/v
projections each quantise it inside diffusers' attention processor, so fusing them means rewriting both.

The Triton interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors for the tests. Its float32 -> bf16 and
-> e4m3 casts truncate, so there the kernel rounds to nearest even by hand, and its tanh comes from exp
(libdevice is GPU-only); on the GPU the casts are the hardware's (round to nearest even, as torch's) and the tanh
is libdevice's, as in torch's CUDA GELU."""

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

# Columns per chunk and 8 warps (8 bf16, one 16-byte load, per thread): 39 registers a thread, no spills (ptxas -v,
# sm_90a), so six programs (rows) share an SM; a whole 16384-column row in registers takes 105 registers at 16 warps
# and one program per SM. Not tuned on a GPU. The interpreter takes 512-column chunks: the tests' widths span one to
# 24 of them, the last ragged, at an interpreter's speed.
BLOCK_COLS = 2048
INTERPRETER_BLOCK_COLS = 512


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
    g rounded to y's dtype as the unfused path's tensors are. Two passes over the row in BLOCK-column chunks: the
    absmax, then the quantisation (the row, 24 KB at the MLP's width, is read again from L2, not from memory). Masked
    lanes load 0 (and the bias 0), gelu(0) = 0, so the absmax ignores them. h and g never reach memory."""
    row = tl.program_id(0).to(tl.int64)
    absmax = tl.full((), 0.0, tl.float32)
    scale = tl.full((), 1.0, tl.float32)
    for step in tl.static_range(2):
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:  # y + bias (already in y's dtype), rounded to y's dtype, as fp8.Float8FrozenLinear adds it
                h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                if not INTERPRETER:
                    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
                elif y_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter's casts truncate: to nearest even
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
            if step == 0:
                # tl.max spelt as what it calls: tl.max is jitted when triton is imported, so the interpreter cannot
                # call it unless TRITON_INTERPRET was set before that import; it does run tl.reduce with this combine
                absmax = tl.maximum(absmax, tl.reduce(tl.abs(g), 0, tl.standard._elementwise_max))
            else:
                # IEEE division, as torch's (a plain / is the GPU's 2-ulp approximation)
                q = tl.minimum(tl.maximum(tl.math.div_rn(g, scale), -448.0), 448.0)
                if INTERPRETER:  # its e4m3 cast does not round to nearest even either: round |q| on the e4m3 grid
                    # (3 mantissa bits: spacing 2^(exponent - 3), 2^-9 below the normals' 2^-6) by adding and taking
                    # away 1.5 * 2^23 spacings, then cast an exact value; the sign bit kept (so -0 stays -0)
                    bits = q.to(tl.int32, bitcast=True)
                    big = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), 0.015625) * 0.125 * 12582912.0
                    rounded = ((tl.abs(q) + big) - big).to(tl.int32, bitcast=True)
                    q = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)
                tl.store(q_ptr + row * n_cols + cols, q.to(tl.float8e4nv), mask=mask)
        if step == 0:
            scale = tl.math.div_rn(tl.maximum(absmax, 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)


def _gelu_backward_quant_rows_kernel(dg_ptr, y_ptr, bias_ptr, col_scale_ptr, scale_ptr, q_ptr, n_cols,
                                     HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
    """The backward's twin of _gelu_quant_rows_kernel, one row per program: v = gelu_backward(dg, y + bias) * s_up
    (the up projection's row scales folded in, as fp8.input_gradient folds them), then v's row quantisation. Reads
    dg and y once each from memory (the second pass finds them in L2); the bf16 gradient of y is never written.
    Roundings as the unfused path's: y + bias and gelu_backward's output to y's dtype, the rest in float32."""
    row = tl.program_id(0).to(tl.int64)
    absmax = tl.full((), 0.0, tl.float32)
    scale = tl.full((), 1.0, tl.float32)
    for step in tl.static_range(2):
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:  # h = y + bias as the forward had it (the same roundings: interpreter notes there)
                h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                if not INTERPRETER:
                    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
                elif y_ptr.dtype.element_ty == tl.bfloat16:
                    bits = h.to(tl.int32, bitcast=True)
                    h = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            inner = 0.7978845608028654 * (h + 0.044715 * (h * h * h))
            if INTERPRETER:
                e = tl.exp(-2.0 * tl.abs(inner))
                t = tl.where(inner < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
            else:
                t = libdevice.tanh(inner)
            # aten's tanh-GELU derivative term by term: 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2 / pi) (1 + 3 k h^2)
            slope = 0.7978845608028654 * (1.0 + 0.134145 * (h * h))
            derivative = 0.5 * (1.0 + t) + (0.5 * h) * (1.0 - t * t) * slope
            v = tl.load(dg_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32) * derivative
            if not INTERPRETER:
                v = v.to(y_ptr.dtype.element_ty).to(tl.float32)
            elif y_ptr.dtype.element_ty == tl.bfloat16:
                bits = v.to(tl.int32, bitcast=True)
                v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            v = v * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
            if step == 0:
                absmax = tl.maximum(absmax, tl.reduce(tl.abs(v), 0, tl.standard._elementwise_max))
            else:
                q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
                if INTERPRETER:  # e4m3 to nearest even by hand, as in _gelu_quant_rows_kernel
                    bits = q.to(tl.int32, bitcast=True)
                    big = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), 0.015625) * 0.125 * 12582912.0
                    q = (((tl.abs(q) + big) - big).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(
                        tl.float32, bitcast=True)
                tl.store(q_ptr + row * n_cols + cols, q.to(tl.float8e4nv), mask=mask)
        if step == 0:
            scale = tl.math.div_rn(tl.maximum(absmax, 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)


@functools.cache
def _kernel(interpret: bool, backward: bool = False):
    """A jitted kernel; jitted at first use (and again if TRITON_INTERPRET changes), since triton.jit reads
    TRITON_INTERPRET when it wraps the function."""
    return triton.jit(_gelu_backward_quant_rows_kernel if backward else _gelu_quant_rows_kernel)


def _outputs(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(e4m3 rows, fp32 row scales, launch options) for a kernel over the rows of `like` (M, N)."""
    rows, cols = like.shape
    q = torch.empty((rows, cols), dtype=fp8.E4M3, device=like.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=like.device)
    interpret = interpreted()
    block = min(BLOCK_COLS, triton.next_power_of_2(cols)) if not interpret else INTERPRETER_BLOCK_COLS
    return q, scale, dict(BLOCK=block, INTERPRETER=interpret, num_warps=max(1, block // 256))


def _launch(y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y (M, N) contiguous, bias (N,) in y's dtype (the callers cast it) or None -> (e4m3 (M, N), fp32 scale (M, 1)):
    fp8.quantize_rows(gelu_tanh(y + bias)) in one pass over y."""
    q, scale, options = _outputs(y)
    wrap_triton(_kernel(options["INTERPRETER"]))[(y.shape[0],)](
        y, y if bias is None else bias, scale, q, y.shape[1], HAS_BIAS=bias is not None, **options)
    return q, scale


def _launch_backward(dg: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                     col_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dg, y (M, N) contiguous, bias (N,) in y's dtype or None, col_scale (N,) fp32 -> (e4m3, fp32 scale (M, 1)):
    fp8.quantize_rows(aten.gelu_backward(dg, y + bias) * col_scale) in one pass over dg and y."""
    q, scale, options = _outputs(y)
    wrap_triton(_kernel(options["INTERPRETER"], backward=True))[(y.shape[0],)](
        dg, y, y if bias is None else bias, col_scale, scale, q, y.shape[1], HAS_BIAS=bias is not None, **options)
    return q, scale


if triton is not None:
    gelu_quant_rows = triton_op("qwen_edit::gelu_quant_rows", _launch, mutates_args=())
    gelu_backward_quant_rows = triton_op("qwen_edit::gelu_backward_quant_rows", _launch_backward, mutates_args=())


def kernel_runs(y: torch.Tensor) -> bool:
    """Whether the kernels can run on `y` here: triton, a CUDA tensor or the interpreter, and a dtype whose roundings
    the interpreter's path emulates (else: the unfused computation)."""
    return (triton is not None and (y.device.type == "cuda" or interpreted())
            and y.dtype in (torch.bfloat16, torch.float32))


def gelu_quantized(y2: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows(gelu_tanh(y2 + bias)) for y2 (M, N): by the fused kernel, or unfused where it cannot run."""
    if use_kernel:  # the bias cast here as Float8FrozenLinear casts it (an (N,) vector: nothing to fuse)
        return gelu_quant_rows(y2.contiguous(), None if bias is None else bias.to(y2.dtype))
    return fp8.quantize_rows(torch.nn.functional.gelu(_add_bias(y2, bias), approximate="tanh"))


def gelu_backward_quantized(dg2: torch.Tensor, y2: torch.Tensor, bias: torch.Tensor | None, col_scale: torch.Tensor,
                            use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows(aten.gelu_backward(dg2, y2 + bias) * col_scale): the up projection's input gradient's
    quantisation with GELU's gradient before it, by the fused kernel or unfused."""
    if use_kernel:
        bias = None if bias is None else bias.to(y2.dtype)
        return gelu_backward_quant_rows(dg2.contiguous(), y2.contiguous(), bias, col_scale.float())
    grad_h = torch.ops.aten.gelu_backward(dg2, _add_bias(y2, bias), approximate="tanh")
    return fp8.quantize_rows(grad_h * col_scale.view(1, -1))


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class _GeluFloat8Matmul(torch.autograd.Function):
    """z = gelu_tanh(h) W^T for a frozen e4m3 weight with per-row scales; gradient for h only (the MLPs whose up
    projection carries LoRA: h is its output, bias and LoRA included)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_t: torch.Tensor | None,
                use_kernel: bool) -> torch.Tensor:
        ctx.save_for_backward(h, weight, scale, weight_t)  # h: what GELU's gradient needs, as unfused
        q, q_scale = gelu_quantized(h.reshape(-1, h.shape[-1]), None, use_kernel)
        z = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.view(1, -1), out_dtype=h.dtype)
        return z.view(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight, scale, weight_t = ctx.saved_tensors
        grad_g = fp8.input_gradient(grad_out, weight, scale, weight_t)
        return torch.ops.aten.gelu_backward(grad_g, h, approximate="tanh"), None, None, None, None


class _FusedMLP(torch.autograd.Function):
    """z = gelu_tanh(x U^T + b) D^T for frozen e4m3 weights U (up) and D (down) with per-row scales; gradient for x
    only. Forward: U's matmul, the GELU + quantise kernel (bias folded in), D's matmul. Backward: D's input gradient
    dg, the GELU-gradient + quantise kernel (U's row scales folded in), U's input-gradient matmul."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, up_w: torch.Tensor, up_scale: torch.Tensor, up_wt: torch.Tensor | None,
                up_bias: torch.Tensor | None, down_w: torch.Tensor, down_scale: torch.Tensor,
                down_wt: torch.Tensor | None, use_kernel: bool) -> torch.Tensor:
        # each projection: e4m3 weight, row scales, transposed copy or None
        y = fp8.scaled_matmul(x.reshape(-1, x.shape[-1]), up_w, up_scale, x.dtype)  # no bias: the kernels add it
        q, q_scale = gelu_quantized(y, up_bias, use_kernel)
        z = torch._scaled_mm(q, down_w.t(), scale_a=q_scale, scale_b=down_scale.view(1, -1), out_dtype=x.dtype)
        # saved: y (what the unfused path saves as GELU's input, the same bytes); no activation of x or of z
        ctx.save_for_backward(y, up_bias, up_w, up_scale, up_wt, down_w, down_scale, down_wt)
        ctx.use_kernel = use_kernel
        return z.view(*x.shape[:-1], down_w.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y, up_bias, up_w, up_scale, up_wt, down_w, down_scale, down_wt = ctx.saved_tensors
        grad_g = fp8.input_gradient(grad_out, down_w, down_scale, down_wt).reshape(y.shape)
        q, q_scale = gelu_backward_quantized(grad_g, y, up_bias, up_scale, ctx.use_kernel)
        grad_x = fp8.transposed_matmul(q, q_scale, up_w, up_wt, grad_out.dtype)
        return grad_x.view(*grad_out.shape[:-1], up_w.shape[1]), *([None] * 8)


class GeluFloat8Linear(fp8.Float8FrozenLinear):
    """An MLP's fp8 down projection with the tanh GELU before it folded in: forward(h) = linear(gelu(h)), the GELU
    and the row quantisation in one kernel where it can run (a CUDA tensor, or the Triton interpreter). With `up`
    (the MLP's up projection, a bare Float8FrozenLinear, whose PreActivation then passes x through), it runs the
    whole MLP: forward(x) = linear(gelu(up(x))), so that the backward fuses too (_FusedMLP)."""

    @classmethod
    def from_float8(cls, linear: fp8.Float8FrozenLinear, up: fp8.Float8FrozenLinear | None = None) -> GeluFloat8Linear:
        """The same e4m3 buffers and bias under the same names (nothing copied or quantised again)."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        for name in ("weight_fp8", "weight_scale", "weight_fp8_t"):
            module.register_buffer(name, getattr(linear, name), persistent=False)
        module.bias = linear.bias
        module.in_features, module.out_features, module.kind = linear.in_features, linear.out_features, "token"
        # A reference, not a submodule: `up` stays net.0.proj (its names, device moves and offloading as before),
        # and its tensors are read at each call, so they are whatever that module holds then.
        module._up = () if up is None else (up,)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = (self.weight_fp8, self.weight_scale, self.weight_fp8_t)
        if self._up:
            up = self._up[0]
            z = _FusedMLP.apply(x, up.weight_fp8, up.weight_scale, up.weight_fp8_t, up.bias, *down, kernel_runs(x))
        else:
            z = _GeluFloat8Matmul.apply(x, *down, kernel_runs(x))
        return z if self.bias is None else z + self.bias.to(z.dtype)

    def extra_repr(self) -> str:
        whole = "the whole MLP (net.0.proj's weights too)" if self._up else "tanh GELU on its input"
        return super().extra_repr() + f", {whole}, GELU fused with the row quantisation"


class PreActivation(torch.nn.Module):
    """diffusers' GELU module without its activation: the same `proj` (LoRA-wrapped or not) under the same name;
    the GELU moves into the GeluFloat8Linear that follows. passthrough (a bare fp8 proj): return x itself, since
    that GeluFloat8Linear runs proj too."""

    def __init__(self, gelu: GELU, passthrough: bool = False):
        super().__init__()
        self.proj, self.passthrough = gelu.proj, passthrough

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.passthrough else self.proj(x)


def why_not(ff: torch.nn.Module) -> str | None:
    """Why the FeedForward `ff` cannot take the fused path (None: it can)."""
    net = getattr(ff, "net", None)
    if net is None or len(net) != 3 or not isinstance(net[0], GELU) or net[0].approximate != "tanh":
        return "not diffusers' GELU(tanh) -> dropout -> linear FeedForward"
    if not (isinstance(net[1], torch.nn.Identity) or (isinstance(net[1], torch.nn.Dropout) and net[1].p == 0)):
        return "the dropout is not 0"
    if type(net[2]) is not fp8.Float8FrozenLinear:
        return ("the down projection (net.2) carries LoRA, which reads the bf16 GELU output"
                if hasattr(net[2], "base_layer") else "the down projection is not an fp8 token linear")
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
            whole = type(proj) is fp8.Float8FrozenLinear and proj.kind == "token"  # no LoRA around it
            ff.net[0] = PreActivation(ff.net[0], passthrough=whole)
            ff.net[2] = GeluFloat8Linear.from_float8(ff.net[2], proj if whole else None)
            count += 1
    return count


def describe(transformer: torch.nn.Module) -> str:
    """One line for the log: how many MLPs take the fused path (whole, or forward only), why the others do not (or
    why none can here)."""
    reason = unavailable()
    if reason is not None:
        return f"train.fused_quant: {reason}; the unfused fp8 path runs"
    downs = [ff.net[2] for _, ff in _mlps(transformer)]
    fused = [d for d in downs if isinstance(d, GeluFloat8Linear)]
    whole = sum(bool(d._up) for d in fused)
    parts = [f"{whole} whole (forward and backward kernels)"] if whole else []
    parts += [f"{len(fused) - whole} forward only (LoRA wraps their up projection)"] if len(fused) > whole else []
    reasons = sorted({why_not(ff) for _, ff in _mlps(transformer) if not isinstance(ff.net[2], GeluFloat8Linear)})
    rest = f"; {len(downs) - len(fused)} unfused: {'; '.join(reasons)}" if reasons else ""
    return f"train.fused_quant: {len(fused)} of {len(downs)} MLPs fused{': ' if parts else ''}{', '.join(parts)}{rest}"
