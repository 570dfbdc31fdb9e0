"""A SwiGLU MLP's input side on an fp8 base in one autograd function, its backward in one Triton kernel.

With train.fp8_base, a SwiGLU MLP out(silu(g) * u) with g = x Wg^T (+ LoRA) and u = x Wu^T (+ LoRA) has, in its
backward, the SwiGLU's input gradients dg and du (bf16, for LoRA's matmuls) and their e4m3 copies with one scale per
row (dg and du times the weights' row scales, for the frozen weights' input-gradient matmuls: train/model/fp8.py).
Compiled, inductor fuses all of it into one kernel per block, which on an H100 runs at about 40% of the memory's
rate (docs/levers.md, 39). `fuse` gives each MLP a forward that computes the same values through `SwiGLUFp8`: x is
quantised once for both base matmuls, the LoRA updates come from peft's own modules, and the backward's gradients
come from `swiglu_backward`: on CUDA one Triton kernel that reads dh, g and u once per row, writes dg and du, and
quantises them from what it wrote (still in the L2 cache); elsewhere the same math in torch (`reference_backward`).

The family's record names its SwiGLU MLP (interface.SwiGLU); the bench's `--fused_swiglu` uses it.
"""

from __future__ import annotations

import functools
import os

import torch

from train.model import fp8
from train.model.interface import SwiGLU

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path below computes the same values
    triton = None

BLOCK, WARPS = 2048, 8  # the kernel's columns per loop iteration and warps: 8 columns a thread, 16-byte bf16 loads
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: compiled code does not read the environment


def reference_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, g_scale: torch.Tensor,
                       u_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For h = silu(g) * u, all (M, N): (dg, du) in dh's dtype, then e4m3 copies of dg * g_scale and du * u_scale
    (g_scale, u_scale (N,): the base weights' row scales, folded in as fp8.py's backward folds them) quantised per
    row, with their scales (M, 1): (dg, du, dg8, dg_rows, du8, du_rows)."""
    gf, uf, dhf = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(gf)
    dg = (dhf * uf * sig * (1 + gf * (1 - sig))).to(dh.dtype)
    du = (dhf * gf * sig).to(dh.dtype)
    return dg, du, *fp8.quantize_rows(dg * g_scale.view(1, -1)), *fp8.quantize_rows(du * u_scale.view(1, -1))


if triton is not None:

    @triton.jit
    def _backward_kernel(dh_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, dg_ptr, du_ptr, dg8_ptr, du8_ptr, grows_ptr,
                         urows_ptr, n_cols, BLOCK: tl.constexpr):
        """One program per row: pass 1 reads dh, g, u, writes dg, du and keeps the running absmax of the scaled
        gradients; pass 2 reads back dg, du (this program's own writes, still cached) and writes the e4m3 copies."""
        row = tl.program_id(0).to(tl.int64) * n_cols
        amax_g = tl.zeros([BLOCK], dtype=tl.float32)
        amax_u = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            dh = tl.load(dh_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            dg = (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty)
            du = (dh * g * sig).to(du_ptr.dtype.element_ty)
            tl.store(dg_ptr + row + cols, dg, mask=inside)
            tl.store(du_ptr + row + cols, du, mask=inside)
            gs = tl.load(gs_ptr + cols, mask=inside, other=0.0)
            us = tl.load(us_ptr + cols, mask=inside, other=0.0)
            amax_g = tl.maximum(amax_g, tl.abs(dg.to(tl.float32) * gs))
            amax_u = tl.maximum(amax_u, tl.abs(du.to(tl.float32) * us))
        g_row = tl.maximum(tl.max(amax_g, axis=0), 1e-12) / 448.0
        u_row = tl.maximum(tl.max(amax_u, axis=0), 1e-12) / 448.0
        tl.store(grows_ptr + tl.program_id(0), g_row)
        tl.store(urows_ptr + tl.program_id(0), u_row)
        tl.debug_barrier()  # pass 2 reads what other threads of this program may have written
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            dg = tl.load(dg_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            du = tl.load(du_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            gs = tl.load(gs_ptr + cols, mask=inside, other=0.0)
            us = tl.load(us_ptr + cols, mask=inside, other=0.0)
            dg8 = tl.clamp(dg * gs / g_row, -448.0, 448.0).to(dg8_ptr.dtype.element_ty)
            du8 = tl.clamp(du * us / u_row, -448.0, 448.0).to(du8_ptr.dtype.element_ty)
            tl.store(dg8_ptr + row + cols, dg8, mask=inside)
            tl.store(du8_ptr + row + cols, du8, mask=inside)

    def launch(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, g_scale: torch.Tensor, u_scale: torch.Tensor,
               q_dtype: torch.dtype = fp8.E4M3, block: int = BLOCK, num_warps: int = WARPS) -> tuple[torch.Tensor, ...]:
        """The kernel over contiguous (M, N) inputs, reference_backward's outputs; q_dtype: the quantised copies'
        dtype (float32 shows the values before the cast, which the CPU test reads); block, num_warps: its launch
        (`python -m train.bench --swiglu_probe` times others)."""
        rows, cols = dh.shape
        dg, du = torch.empty_like(dh), torch.empty_like(dh)
        dg8 = torch.empty(rows, cols, dtype=q_dtype, device=dh.device)
        du8 = torch.empty_like(dg8)
        g_rows = torch.empty(rows, 1, dtype=torch.float32, device=dh.device)
        u_rows = torch.empty_like(g_rows)
        torch.library.wrap_triton(_backward_kernel)[(rows,)](
            dh, g, u, g_scale, u_scale, dg, du, dg8, du8, g_rows, u_rows, cols,
            BLOCK=min(block, triton.next_power_of_2(cols)), num_warps=num_warps)
        return dg, du, dg8, g_rows, du8, u_rows

    @torch.library.triton_op("qwen_edit::swiglu_backward_fp8", mutates_args=())
    def _kernel_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, g_scale: torch.Tensor,
                         u_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
        return launch(dh, g, u, g_scale, u_scale)


def kernel_runs(device: torch.device) -> bool:
    """Whether `swiglu_backward` runs the Triton kernel on `device` (CUDA, or any device under Triton's
    interpreter, TRITON_INTERPRET=1, which the CPU tests use)."""
    return triton is not None and (device.type == "cuda" or INTERPRETED)


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, g_scale: torch.Tensor,
                    u_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """reference_backward's values, by the Triton kernel where it runs (kernel_runs)."""
    args = (dh.contiguous(), g.contiguous(), u.contiguous(), g_scale.float().contiguous(), u_scale.float().contiguous())
    return _kernel_backward(*args) if kernel_runs(dh.device) else reference_backward(*args)


class SwiGLUFp8(torch.autograd.Function):
    """h = silu(x Wg^T + lora_g) * (x Wu^T + lora_u) for frozen e4m3 weights with row scales (fp8.Float8FrozenLinear's
    buffers); gradients for x (the base's share) and for the LoRA updates. lora_g / lora_u: None where the linear has
    no LoRA."""

    @staticmethod
    def forward(ctx, x, lora_g, lora_u, wg, g_scale, wg_t, wu, u_scale, wu_t, fast_accum):
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_rows = fp8.quantize_rows(x2)  # once for both matmuls
        g = fp8.scaled_mm(x8, x_rows, wg, g_scale, x.dtype, fast_accum)
        u = fp8.scaled_mm(x8, x_rows, wu, u_scale, x.dtype, fast_accum)
        if lora_g is not None:
            g = g + lora_g.reshape(g.shape)
        if lora_u is not None:
            u = u + lora_u.reshape(u.shape)
        ctx.save_for_backward(g, u, wg, g_scale, wg_t, wu, u_scale, wu_t)
        ctx.fast_accum, ctx.x_shape = fast_accum, x.shape
        return (torch.nn.functional.silu(g) * u).view(*x.shape[:-1], wg.shape[0])

    @staticmethod
    def backward(ctx, dh):
        g, u, wg, g_scale, wg_t, wu, u_scale, wu_t = ctx.saved_tensors
        dg, du, dg8, g_rows, du8, u_rows = swiglu_backward(dh.reshape(g.shape), g, u, g_scale, u_scale)
        dx = fp8.input_gradient(dg8, g_rows, wg, wg_t, dh.dtype, ctx.fast_accum)  # dx = dg Wg + du Wu
        dx = dx + fp8.input_gradient(du8, u_rows, wu, wu_t, dh.dtype, ctx.fast_accum)
        shape = (*ctx.x_shape[:-1], wg.shape[0])
        return (dx.view(ctx.x_shape), dg.view(shape) if ctx.needs_input_grad[1] else None,
                du.view(shape) if ctx.needs_input_grad[2] else None, None, None, None, None, None, None, None)


def lora_update(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """What peft's LoRA layer adds to its base layer's output for x (its forward without the base), None for a
    layer without LoRA or with its adapters off. Plain LoRA only: a LoRA variant (DoRA...) is refused."""
    if not hasattr(layer, "lora_A") or layer.disable_adapters:
        return None
    update = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in layer.lora_variant:
            raise ValueError(f"fused SwiGLU: adapter {name!r} is a LoRA variant; only plain LoRA is fused")
        lora_a = layer.lora_A[name]
        y = layer.lora_B[name](lora_a(layer.lora_dropout[name](x.to(lora_a.weight.dtype)))) * layer.scaling[name]
        update = y if update is None else update + y
    return None if update is None else update.to(x.dtype)


def _base(layer: torch.nn.Module, what: str) -> fp8.Float8FrozenLinear:
    base = getattr(layer, "base_layer", layer)
    if not isinstance(base, fp8.Float8FrozenLinear) or base.kind != "token" or base.bias is not None:
        raise ValueError(f"fused SwiGLU: {what} is {type(base).__name__}, not a bias-free fp8 token linear; it "
                         "needs the fp8 base (train.fp8_base) on the MLP's linears")
    if getattr(layer, "merged", False):
        raise ValueError(f"fused SwiGLU: {what} has its LoRA merged into the base; unmerge it first")
    return base


def fused_forward(mlp: torch.nn.Module, names: SwiGLU, hidden_states: torch.Tensor) -> torch.Tensor:
    """The MLP's forward through SwiGLUFp8: the same values as out(silu(gate(x)) * up(x))."""
    gate, up = getattr(mlp, names.gate), getattr(mlp, names.up)
    bg, bu = getattr(gate, "base_layer", gate), getattr(up, "base_layer", up)  # peft's wrapped layer, or the linear
    h = SwiGLUFp8.apply(hidden_states, lora_update(gate, hidden_states), lora_update(up, hidden_states),
                        bg.weight_fp8, bg.weight_scale, bg.weight_fp8_t, bu.weight_fp8, bu.weight_scale,
                        bu.weight_fp8_t, bg.fast_accum)
    return getattr(mlp, names.out)(h)


def fuse(blocks: torch.nn.ModuleList, names: SwiGLU) -> int:
    """Give every block's SwiGLU MLP (names: the family's record) the forward through SwiGLUFp8, in place; call
    after the fp8 conversion. Returns how many MLPs were fused; ValueError naming the first layer that cannot be."""
    mlps = []
    for i, block in enumerate(blocks):
        mlp = block.get_submodule(names.module)
        where = f"block {i}'s {names.module}"
        if not isinstance(getattr(mlp, names.activation), torch.nn.SiLU):
            raise ValueError(f"fused SwiGLU: {where}.{names.activation} is not SiLU")
        _base(getattr(mlp, names.gate), f"{where}.{names.gate}")
        _base(getattr(mlp, names.up), f"{where}.{names.up}")
        mlps.append(mlp)
    for mlp in mlps:
        mlp.forward = functools.partial(fused_forward, mlp, names)
    return len(mlps)


def unfuse(blocks: torch.nn.ModuleList, names: SwiGLU) -> int:
    """Undo fuse: every block's MLP back on its class's forward. Returns how many were fused."""
    mlps = [block.get_submodule(names.module) for block in blocks]
    fused = [mlp for mlp in mlps if "forward" in vars(mlp)]
    for mlp in fused:
        del mlp.forward
    return len(fused)
