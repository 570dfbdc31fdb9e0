"""Multi-tensor versions of two per-tensor loops in DeepSpeed 0.19.8's ZeRO-1/2 optimizer step, the step lighter on the
host, and its Muon module imported without compiling.

Why: a LoRA optimizer holds about a thousand small tensors (r64 on the attention projections of 60 blocks:
960). After the backward, DeepSpeed's overflow check (amax + amin + isfinite per tensor) and its gradient norm
(one vector_norm per tensor, in float64) issue some 9,000 tiny kernels, and the GPU sits idle while the CPU
launches them: 0.1-0.15 s of a 1 s step on an H200 (docs/levers.md, lever 8). The replacements compute the same
quantities with `torch._foreach_norm` (a few launches): a tensor holds an inf/NaN exactly when its norm is not
finite (or overflows, which DeepSpeed would then skip as well), and the global norm is the same sum of
squared per-tensor norms, accumulated in float64 as DeepSpeed does.

DeepSpeed's ZeRO optimizers import its Muon optimizer module in deepspeed.initialize and in every gradient
reduction, for an isinstance check. That module decorates three kernels with torch.compile, whose first use loads
inductor: seconds of every rank's start, for functions that only a Muon optimizer calls. For any other
optimizer the module is imported first with those compiles put off until a kernel is called (import_muon_uncompiled).

The step itself (ZeRO-1/2 in bf16, gradients on the device) is made lighter on the host, with the same result:
- the overflow check is folded into the gradient norm: the step already skips on an invalid norm (inf/NaN, which a
  gradient holding an inf or NaN makes, marked -1), so the separate pass over every gradient and its host
  synchronisation are dropped (check_overflow);
- the clipping factor for an invalid norm is chosen on the device (a masked fill) instead of by a host
  synchronisation (unscale_and_clip_grads), and the norm is marked invalid with a scalar fill instead of a tensor
  copied from the host, which synchronises as well (get_grad_norm_direct);
- after the all-gather DeepSpeed points every bit16 parameter at its slice of the flat buffer again (a narrow and a
  view per parameter, about a thousand for a LoRA); the parameters that point there already are left as they are
  (_update_model_bit16_weights).
One host synchronisation is left in the step: whether it is skipped (DeepSpeed's fused Adam takes no on-device skip
flag). On CUDA the others stopped the host until the GPU had run everything queued, after which it idled while the
host issued the next kernels (docs/levers.md, 46).

Only DeepSpeed 0.19.8 (the pinned version) is patched, since the replaced methods are internal; everything
around them (the all-reduces over the data- and model-parallel groups, the NaN masking) is kept.
"""

from __future__ import annotations

import functools
import sys

import torch

PATCHED_VERSION = "0.19.8"


@torch.no_grad()
def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms as one float32 vector (multi-tensor kernels; empty tensors give 0)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def has_overflow_partitioned_grads_serial(self) -> torch.Tensor:
    """[1] bool tensor: any averaged gradient holds an inf or NaN (DeepSpeed's semantics, one pass)."""
    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    device = torch.device(self.device) if not isinstance(self.device, torch.device) else self.device
    if not grads:
        return torch.zeros([1], dtype=torch.bool, device=device)
    return (~torch.isfinite(_norms(grads)).all()).view(1).to(device)


def get_grad_norm_direct(self, gradients, params, norm_type=2):
    """L2 norm of the gradients over the data-parallel (and model-parallel) group, as DeepSpeed computes it."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    if float(norm_type) != 2.0:
        return _ORIGINAL["get_grad_norm_direct"](self, gradients, params, norm_type)
    grads = [g for g in gradients if not getattr(g, "_zero_padding", False)][:len(params)]
    if self.model_parallel_rank == 0 and not _any_pipe_replicated(self, params):  # every gradient counts
        selected = grads
    else:
        selected = []
        for g, p in zip(grads, params, strict=False):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:  # counted once, on another stage
                continue
            if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                selected.append(g.detach())
    if selected:
        total_norm = _norms(selected).double().pow(2).sum().float()
    else:
        total_norm = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    total_norm = total_norm.pow(0.5)
    # DeepSpeed's -1 mark of an invalid norm (mask_nan_or_inf_with_val_inplace) without its host-made -1 tensor, whose
    # copy to the device waits for the stream
    return total_norm.masked_fill_(~torch.isfinite(total_norm), -1.0)


def _any_pipe_replicated(self, params: list) -> bool:
    """Whether one of `params` is counted on another pipeline stage (DeepSpeed's ds_pipe_replicated); asked once per
    list and kept on the optimizer (its per-group lists live as long as it does)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    known = self.__dict__.setdefault("_pipe_replicated_lists", {})
    key = (id(params), len(params))
    if key not in known:
        known[key] = any(getattr(p, PIPE_REPLICATED, False) and p.ds_pipe_replicated for p in params)
    return known[key]


def _norm_decides(self) -> bool:
    """Whether the step's check of the gradient norm (inf/NaN or DeepSpeed's -1 mark: skip the step) already covers
    the overflow check: bf16 (no loss scaler whose scale the check would move), gradients on the device, a norm
    computed, none of the optimizer's other step paths."""
    return (self.dtype == torch.bfloat16 and self.compute_grad_norm and not self.cpu_offload
            and not self.has_moe_layers and not self.custom_loss_scaler
            and not getattr(self, "torch_autocast_gradscaler", None) and not getattr(self, "zenflow", False))


def check_overflow(self, partition_gradients=True):
    """DeepSpeed's overflow check where the norm does not decide (_norm_decides); else no overflow yet: the step
    computes the norm next and skips on an invalid one, which a gradient with an inf or NaN makes."""
    if _norm_decides(self):
        self.overflow = False
        return
    _ORIGINAL["check_overflow"](self, partition_gradients)


def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeed's unscale and clip, the factor for an invalid norm (inf: the gradients become zeros, as DeepSpeed
    makes them) chosen on the device."""
    if not torch.is_tensor(total_norm) or self.clip_grad <= 0.0:
        return _ORIGINAL["unscale_and_clip_grads"](self, grad_groups_flat, total_norm)
    invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
    clip_norm = total_norm.masked_fill(invalid, float("inf"))
    clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
    scale = 1.0 / (clip * self.loss_scale)
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(scale)


def _update_model_bit16_weights(self, group_index):
    """DeepSpeed's re-pointing of the bit16 parameters at their slices of the flat buffer, for a group where one
    points elsewhere (after a checkpoint load, say); nothing where all point there already."""
    flat = self.bit16_groups_flat[group_index]
    ordered = self.round_robin_bit16_groups[group_index]
    expected = self.__dict__.setdefault("_bit16_pointers", {})
    key = (group_index, flat.data_ptr())
    if key not in expected:
        size = flat.element_size()
        expected[key] = [flat.data_ptr() + offset * size for offset in self.round_robin_bit16_offsets[group_index]]
    if [p.data_ptr() for p in ordered] == expected[key] and all(
            p is ordered[new] for p, new in zip(self.bit16_groups[group_index],
                                                self.round_robin_bit16_indices[group_index], strict=True)):
        return
    _ORIGINAL["_update_model_bit16_weights"](self, group_index)


STEP_PATCHES = ("check_overflow", "unscale_and_clip_grads", "_update_model_bit16_weights")


def lean_step(on: bool) -> None:
    """The lighter step's three replacements (STEP_PATCHES) in or out; apply() puts them in. The benchmark's A/B
    (`train.bench --ab_lever lean_step`) switches them between rounds."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    for name in STEP_PATCHES:
        setattr(Zero, name, globals()[name] if on else _ORIGINAL[name])


_ORIGINAL: dict = {}
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _compile_on_first_call(compile_now):
    """A decorator like `compile_now()` (DeepSpeed's compiler.compile) that compiles on the function's first call."""

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now()(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


def import_muon_uncompiled() -> bool:
    """Import DeepSpeed's Muon optimizer module with its torch.compile decorations put off to each kernel's first call
    (for an engine whose optimizer is not Muon, which never calls them); False when it was imported already or the
    version differs."""
    import deepspeed
    from deepspeed.runtime import compiler

    if deepspeed.__version__ != PATCHED_VERSION or MUON_MODULE in sys.modules:
        return False
    compile_now = compiler.compile
    compiler.compile = lambda: _compile_on_first_call(compile_now)
    try:
        __import__(MUON_MODULE)
    finally:
        compiler.compile = compile_now
    return True


def apply() -> bool:
    """Install the replacements on DeepSpeedZeroOptimizer (idempotent); False when the version differs."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    if deepspeed.__version__ != PATCHED_VERSION:
        return False
    if not _ORIGINAL:
        _ORIGINAL.update(get_grad_norm_direct=Zero.get_grad_norm_direct,
                         has_overflow_partitioned_grads_serial=Zero.has_overflow_partitioned_grads_serial)
        Zero.get_grad_norm_direct = get_grad_norm_direct
        Zero.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial
        _ORIGINAL.update((name, getattr(Zero, name)) for name in STEP_PATCHES)
        lean_step(True)
    return True
