"""FlashAttention-4's kernels (`flash-attn-4` on PyPI: CuTe DSL kernels for compute capability 9.0 and newer) as the
fused kernel behind train/model/kept_attention.py's fused_forward and fused_backward, in place of the one torch's
SDPA picks (cuDNN on Hopper), where train.attention_kernel chooses it (kept_attention.choose_kernel; docs/levers.md,
41) and in `python -m train.bench --attention_kernel fa4` and `python -m train.bench --attention_kernel_probe`.

Both ops that call these functions (Qwen-Image-2.1's segmented attention, the kept attention of checkpointed blocks)
hand over (B, H, S, D) views of contiguous (B, S, H, D) tensors: FlashAttention's own layout, one transpose away.
The forward returns its log-sum-exp (B, H, S) in float32, natural log, as the segmented op merges calls by it; the
backward takes an out and log-sum-exp that may belong to a larger attention the call is one part of (FlashAttention's
backward computes its softmax from the log-sum-exp and the output's row sums from the output it is given, as cuDNN's
does), which gives the call's share of that attention's gradients. A causal call aligns its triangle bottom-right
(query i of S sees keys 0..i + K - S; FlashAttention's convention since version 2.1), so a text run after the first
is one causal call over every key up to its end (train/model/qwen_image21/attention.py), where SDPA's top-left
triangle needs two calls and a merge. Both functions write into output tensors they are given (FlashAttention-4's
`out`, `lse`, `dq`, `dk`, `dv`), so the segmented op's calls write their rows of the whole attention's output and
gradients in place.
"""

from __future__ import annotations

import torch

from train.config.checks import flash_attention_4_problem

CAUSAL_BOTTOM_RIGHT = True  # a causal call over K keys and S <= K queries: query i sees keys 0..i + K - S
WRITES_INTO = True  # the kernels write into given output tensors: no copy of a call's output into the whole


def check(device: torch.device) -> None:
    """Raise a RuntimeError naming the fix when the kernels cannot run on `device` (the config's pre-flight asks the
    same question: train.config.checks.flash_attention_4_problem)."""
    problem = flash_attention_4_problem(device)
    if problem:
        raise RuntimeError(problem)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out (B, H, S, D) with q's layout, lse (B, H, S) float32) of one call; causal: query i of S sees keys
    0..i + K - S of K (bottom-right, CAUSAL_BOTTOM_RIGHT). Given `out` (B, H, S, D, its last dimension contiguous) and
    `lse` (B, H, S), the kernel writes into them (views of a whole attention's output, say) and returns them."""
    from flash_attn.cute.interface import _flash_attn_fwd

    o, m = _flash_attn_fwd(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=scale, causal=causal,
                           return_lse=True, out=None if out is None else out.transpose(1, 2), lse=lse)[:2]
    return (o.transpose(1, 2) if out is None else out), (m.contiguous() if lse is None else lse)


def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float | None, causal: bool,
             into: tuple = (None, None, None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), (B, H, S, D) each, of forward's call given the (possibly larger attention's) out and lse; where
    `into` gives a tensor for one of them (B, H, S, D, its last dimension contiguous), the kernel writes it there."""
    from flash_attn.cute.interface import _flash_attn_bwd

    given = [None if x is None else x.transpose(1, 2) for x in into]
    grads = _flash_attn_bwd(*(x.transpose(1, 2) for x in (q, k, v, out, grad)), lse.contiguous(),
                            softmax_scale=scale, causal=causal, dq=given[0], dk=given[1], dv=given[2])[:3]
    return tuple(g.transpose(1, 2) if x is None else x for g, x in zip(grads, into, strict=True))
