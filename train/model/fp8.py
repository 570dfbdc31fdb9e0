"""Frozen base weights in float8 (LoRA only): half the weight memory, and fp8 matmuls on GPUs that have them.

`train.fp8_base = true` replaces each frozen nn.Linear inside the transformer blocks that the model family names
(its record's `fp8_linears`, train/model/interface.py) by `Float8FrozenLinear`: the weight is stored as float8 e4m3
with one fp32 scale per output row (absmax / 448). Two kinds:

- token linears (Qwen-Image: attention q/k/v/out of both streams, both MLPs): y = x W^T with x quantised to e4m3 per row
  (dynamic absmax scale) and `torch._scaled_mm` (rowwise scales, bf16 out). The input gradient
  dx = dy W = (dy * s) W8 is computed the same way, with the per-row weight scale s folded into dy before it is
  quantised, so per-row weight scales serve both directions. The weight gets no gradient (it is frozen).
- vector linears (Qwen-Image's img_mod / txt_mod: one vector per sample, 1/3 of the block weights): weight-only, W8 is
  dequantised to the activation dtype for each call (a matrix-vector product; the matmul is not the cost).

Every layer outside the blocks (embeddings, output layers, time embedding) stays in the model dtype. The
LoRA branch (peft wraps the base layer; we swap the base layer under it) keeps its own dtype. Quantisation
changes the frozen model a little (e4m3 keeps 3 mantissa bits); docs/performance.md reports the effect on the
loss curve next to the speed and memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scale (M, 1)) with x ~= q * scale, absmax per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def scaled_mm(a8: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a8 * a_scale) @ (b_t * b_scale[:, None])^T for e4m3 a8 (M, K) with row scales a_scale (M, 1) and e4m3 b_t
    (N, K) with row scales b_scale (N,). fast_accum: torch's use_fast_accum (Hopper's fp8 tensor cores accumulate
    without the periodic fp32 promotion; faster, less exact over a long K: train.fp8_fast_accum, measured by
    `python -m train.bench --gemm_probe`)."""
    return torch._scaled_mm(a8, b_t.t(), scale_a=a_scale, scale_b=b_scale.view(1, -1), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def scaled_matmul(a: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
                  fast_accum: bool = False) -> torch.Tensor:
    """a (M, K) high precision, quantised per row, @ b_t^T as scaled_mm computes it."""
    return scaled_mm(*quantize_rows(a), b_t, b_scale, out_dtype, fast_accum)


def input_gradient(g8: torch.Tensor, g_rows: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None,
                   out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """dx = (g8 * g_rows) @ W8 for an e4m3 output gradient g8 (M, N) with row scales (M, 1), the weight's row scales
    already folded in, and the frozen e4m3 weight (N, K). _scaled_mm wants its second operand column-major, i.e.
    W8^T stored row-major: weight_t where it was kept from the conversion (train.fp8_transposed), otherwise
    transposed here, a pass over the weight per call."""
    ones = torch.ones(weight.shape[1], dtype=torch.float32, device=weight.device)
    w_t = weight.t().contiguous() if weight_t is None else weight_t
    return scaled_mm(g8, g_rows, w_t, ones, out_dtype, fast_accum)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen weight (N, K) -> (e4m3 (N, K), fp32 scale (N,)), absmax per output row."""
    scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / E4M3_MAX
    return (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class _Float8Matmul(torch.autograd.Function):
    """y = x W^T for a frozen e4m3 weight with per-row scales; gradient for x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                weight_t: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
        ctx.save_for_backward(weight, scale, weight_t)
        ctx.fast_accum = fast_accum
        x2 = x.reshape(-1, x.shape[-1])
        return scaled_matmul(x2, weight, scale, x.dtype, fast_accum).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, scale, weight_t = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]) * scale.view(1, -1)  # fold W's row scales into dy
        grad_x = input_gradient(*quantize_rows(g2), weight, weight_t, grad_out.dtype, ctx.fast_accum)
        return grad_x.view(*grad_out.shape[:-1], weight.shape[1]), None, None, None, None


class Float8FrozenLinear(torch.nn.Module):
    """A frozen nn.Linear kept in e4m3 with per-output-row scales (see the module docstring for `kind`)."""

    def __init__(self, linear: torch.nn.Linear, kind: str, keep_transposed: bool = False,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None, fast_accum: bool = False):
        super().__init__()
        if kind not in ("token", "vector"):
            raise ValueError(f"kind must be 'token' or 'vector', got {kind!r}")
        # quantized: (e4m3 weight, scale) made by the streaming loader; linear.weight is then a placeholder.
        weight_fp8, scale = quantize_weight(linear.weight.detach()) if quantized is None else quantized
        # Non-persistent: checkpoints hold trainable weights only, and exports never see these.
        self.register_buffer("weight_fp8", weight_fp8, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        # The backward's operand layout, stored once (token kind only): the same bytes again, no pass per step.
        transposed = self.weight_fp8.t().contiguous() if keep_transposed and kind == "token" else None
        self.register_buffer("weight_fp8_t", transposed, persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features, self.kind = linear.in_features, linear.out_features, kind
        self.fast_accum = fast_accum and kind == "token"  # train.fp8_fast_accum: both directions' _scaled_mm

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_fp8.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "vector":
            y = torch.nn.functional.linear(x, self.dequantized(x.dtype))
        else:
            y = _Float8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.weight_fp8_t, self.fast_accum)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, e4m3"


def convert_frozen_linears(transformer: torch.nn.Module, kind_of: Callable[[str], str | None],
                           keep_transposed: bool | Callable[[str], bool] = False,
                           quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                           fast_accum: bool = False) -> int:
    """Swap the blocks' frozen linears (peft's base_layer where LoRA wraps one) for Float8FrozenLinear in place;
    returns how many were converted. Call after LoRA is added. kind_of: "token", "vector" or None (not converted)
    for a linear's name, the family's (ModelFamily.fp8_kind). keep_transposed: also store each token linear's
    weight transposed for the backward (train.fp8_transposed: twice the fp8 weight memory, no transpose per step);
    a function of the linear's name decides per linear. quantized: {linear name: (e4m3 weight, scale)} already
    made (by train.model.streaming), for linears whose weight is only a placeholder. fast_accum: the token linears'
    matmuls accumulate as `torch._scaled_mm(use_fast_accum=True)` does (train.fp8_fast_accum)."""
    quantized = quantized or {}
    transposed = keep_transposed if callable(keep_transposed) else (lambda name: keep_transposed)
    targets = []
    for name, module in transformer.named_modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and not isinstance(module, torch.nn.Linear):
            kind = kind_of(name)  # a peft LoRA layer: keep the adapter, swap what it wraps
            if kind:
                targets.append((name, module, "base_layer", base, kind))
        elif type(module) is torch.nn.Linear and ".lora_" not in name and not name.endswith(".base_layer"):
            kind = kind_of(name)
            if kind:
                parent_name, _, attr = name.rpartition(".")
                targets.append((name, transformer.get_submodule(parent_name), attr, module, kind))
    for name, parent, attr, linear, kind in targets:
        if linear.weight.requires_grad:
            raise ValueError("fp8 base weights need a frozen base (train.mode = 'lora')")
        setattr(parent, attr, Float8FrozenLinear(linear, kind, transposed(name), quantized.pop(name, None),
                                                 fast_accum))
    return len(targets)
