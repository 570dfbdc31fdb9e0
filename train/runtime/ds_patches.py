"""Multi-tensor versions of two per-tensor loops in DeepSpeed 0.19.8's ZeRO-1/2 optimizer step, and its Muon module
imported without compiling.

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

Only DeepSpeed 0.19.8 (the pinned version) is patched, since the replaced methods are internal; everything
around them (the all-reduces over the data- and model-parallel groups, the NaN masking) is kept.
"""

from __future__ import annotations

import functools
import sys

import torch

PATCHED_VERSION = "0.19.8"


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
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    if float(norm_type) != 2.0:
        return _ORIGINAL["get_grad_norm_direct"](self, gradients, params, norm_type)
    selected = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params, strict=False):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:  # counted once, on another stage
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            selected.append(g.data.detach())
    if selected:
        total_norm = _norms(selected).double().pow(2).sum().float()
    else:
        total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    total_norm = total_norm.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


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
    return True
