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
triangle needs two calls and a merge.
"""

from __future__ import annotations

import torch

from train.config.checks import flash_attention_4_problem

CAUSAL_BOTTOM_RIGHT = True  # a causal call over K keys and S <= K queries: query i sees keys 0..i + K - S


def check(device: torch.device) -> None:
    """Raise a RuntimeError naming the fix when the kernels cannot run on `device` (the config's pre-flight asks the
    same question: train.config.checks.flash_attention_4_problem)."""
    problem = flash_attention_4_problem(device)
    if problem:
        raise RuntimeError(problem)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool):
    """(out (B, H, S, D) with q's layout, lse (B, H, S) float32) of one call; causal: query i of S sees keys
    0..i + K - S of K (bottom-right, CAUSAL_BOTTOM_RIGHT)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=scale, causal=causal,
                               return_lse=True)[:2]
    return out.transpose(1, 2), lse.contiguous()


def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), (B, H, S, D) each, of forward's call given the (possibly larger attention's) out and lse."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(*(x.transpose(1, 2) for x in (q, k, v, out, grad)), lse.contiguous(),
                                 softmax_scale=scale, causal=causal)[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
