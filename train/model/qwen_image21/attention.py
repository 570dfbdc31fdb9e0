"""Qwen-Image-2.1's block-causal attention as mask-free fused-kernel calls (an attention processor for the
transformer).

The mask is diffusers' `build_qwenimage21_block_causal_mask`: a query sees every key at or before its own position,
and every key of its own image block; padded prompt keys are seen by none. The model cuts the prefix (text and
references) into runs of one block (diffusers' `_qwenimage21_prefix_segments`, once per forward) and hands them to
every processor; per run, the mask is:

    a reference [s, e)      keys [0, e), all of them              one kernel call
    the target [p, L)       every key                             one kernel call
    the first text [0, e)   a causal triangle                     one causal call (a square)
    later text [s, e)       keys [0, s) all, [s, e) causally      one causal call over keys [0, e) (FlashAttention-4),
                                                                  or two calls merged by their log-sum-exps (SDPA)

SDPA's kernels align a causal triangle top-left (query i sees keys 0..i), so on them a later text run is split into
a call over the keys before it and a causal call over its own keys (a square, where top-left is right), merged
exactly: lse = logaddexp(lse_1, lse_2), out = sum_p exp(lse_p - lse) out_p. FlashAttention-4 aligns it bottom-right
(query i of S sees keys 0..i + K - S), which is the later text run's mask over keys [0, e) in one call
(kept_attention.causal_bottom_right).

All of it is one custom op, `qwen_edit::block_causal_attention`, opaque to torch.compile. Its forward calls the
fused kernel torch's SDPA picks (cuDNN or FlashAttention on CUDA, the flash kernel on the CPU) through the aten ops
that return the log-sum-exp (train/model/kept_attention.py's fused_forward), and keeps the whole attention's output
and log-sum-exp. Its backward runs each call's own backward kernel with those: a kernel's backward reads the
softmax from the log-sum-exp and the output it is given, so each call over part of the keys yields exactly its
share of the whole attention's gradients, as ring attention splits the keys across devices. The shares of a key
are summed in float32 and rounded once, region by region between the calls' key bounds (on CUDA one compiled kernel
per region, which reads each share once). Where the kernel writes into tensors it is given (FlashAttention-4's;
kept_attention.writes_into), each call writes its rows of the output, the log-sum-exp and dq in place, and the target
call, over every key, writes dk and dv, to which the prefix regions then add the other calls' shares in the same
order (sum_shares_into): no copies of the calls' outputs. The run boundaries are SymInts in the ops' schemas, so a
compiled block traces them as symbols: once its shapes are dynamic, a row of another layout runs the same graph
instead of compiling one per layout.

Without a mask this needs the same keys hidden from every row: a micro-batch whose rows are padded (prompts of
different lengths; encoder_hidden_states_mask), a float32 model on CUDA, or an older GPU without the fused kernels
go to diffusers' QwenImage21AttnProcessor (one SDPA call per run, with masks). So does the pipeline's prefix KV
cache: its cached steps attend over the whole cached prefix.

Shapes: B batch, H heads, S sequence length, D head dim; the kernels take (B, H, S, D).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from itertools import pairwise

import torch
from diffusers.models.transformers import transformer_qwenimage21 as T

from train.model import kept_attention

Segments = list[tuple[int, int, bool]]  # the prefix's (start, end, is_text) runs; the target is what follows them


class SegmentedSDPAProcessor:
    """In place of diffusers' QwenImage21AttnProcessor (same call signature); exact, and without a mask where the rows
    share their keys."""

    def __init__(self):
        self._masked = T.QwenImage21AttnProcessor()
        kept_attention.detect_cuda()  # eligible() reads it: without it every CUDA call would take the masked path

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_emb=None,
        layer_cache=None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: Segments | None = None,
        key_valid: torch.Tensor | None = None,
    ):
        if segments is None or key_valid is not None or not kept_attention.eligible(hidden_states):
            return self._masked(attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode,
                                cache_write_slice, segments, key_valid)
        query, key, value, _ = T._qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice
        )
        out_BHSD = block_causal_attention(*(t.transpose(1, 2) for t in (query, key, value)), segments)
        out = out_BHSD.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def processor_name(choice: str, compiled_on_cuda: bool) -> str:
    """train.attention resolved: "auto" is segmented where the blocks are compiled on a CUDA GPU (the fastest there,
    ahead of compiled flex at text-to-image, one and three references: docs/results/segmented21_h200_2026-12-05.md),
    else sdpa (diffusers' processor, as the pipeline runs it)."""
    if choice != "auto":
        return choice
    return "segmented" if compiled_on_cuda else "sdpa"


def set_attention(transformer, choice: str, compiled_on_cuda: bool) -> str:
    """Give every block the processor of train.attention (`choice`, resolved by processor_name); returns its name."""
    name = processor_name(choice, compiled_on_cuda)
    make = {
        "flex": T.QwenImage21FlexAttnProcessor,
        "sdpa": T.QwenImage21AttnProcessor,
        "segmented": SegmentedSDPAProcessor,
    }[name]
    for block in transformer.transformer_blocks:
        block.attn.set_processor(make())
    return name


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The block-causal attention of (B, H, S, D) tensors whose rows share their keys (no padding); the output has
    q's strides."""
    return torch.ops.qwen_edit.block_causal_attention(q, k, v, flat_bounds(segments))[0]


def flat_bounds(segments: Segments) -> list[int]:
    """The prefix runs as the op takes them: flat (start, end, is_text) triples."""
    return [x for start, end, is_text in segments for x in (start, end, int(is_text))]


def kernel_calls(bounds: list[int], length: int, bottom_right: bool = False) -> list[tuple[int, int, int, int, bool]]:
    """The fused-kernel calls of the attention over `length` tokens whose prefix runs are `bounds` (flat start, end,
    is_text triples): (query start, query end, key start, key end, causal) each. A later text run is one causal call
    over keys [0, end) where the kernel aligns causal calls bottom-right, else two adjacent calls."""
    calls, prefix_len = [], 0
    for start, end, is_text in zip(bounds[0::3], bounds[1::3], bounds[2::3], strict=True):
        if not is_text:
            calls.append((start, end, 0, end, False))
        elif bottom_right:
            calls.append((start, end, 0, end, True))
        else:
            if start > 0:
                calls.append((start, end, 0, start, False))
            calls.append((start, end, start, end, True))
        prefix_len = end
    if prefix_len < length:
        calls.append((prefix_len, length, 0, length, False))
    return calls


def _runs(bounds: list[int], length: int):
    """kernel_calls grouped by their queries: (query start, query end, [(key start, key end, causal), ...])."""
    runs: list = []
    for q0, q1, k0, k1, causal in kernel_calls(bounds, length, kept_attention.causal_bottom_right()):
        if runs and runs[-1][0] == q0:
            runs[-1][2].append((k0, k1, causal))
        else:
            runs.append((q0, q1, [(k0, k1, causal)]))
    return runs


def _dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, H, T, D) tensor with the strides of a contiguous (B, T, H, D) one, as the kernels take q, k, v, the
    output and its gradient alike: a view of a slice along T when B is 1, a copy of it otherwise."""
    return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in tensors)


@torch.library.custom_op("qwen_edit::block_causal_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, SymInt[] bounds) -> (Tensor, Tensor)")
def _attention(q, k, v, bounds):
    """(out, lse): out with q's strides, lse (B, H, S) float32."""
    kept_attention.backend(q)  # the kernel is chosen (once) for the whole sequence, not for a short first segment
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for q0, q1, keys in _runs(bounds, q.shape[2]):
        if len(keys) == 1:  # the call's results are its rows of out and lse
            ((k0, k1, causal),) = keys
            kept_attention.fused_forward(*_dense(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]), None, causal,
                                         out=out[:, :, q0:q1], lse=lse[:, :, q0:q1])
            continue
        parts = [kept_attention.fused_forward(*_dense(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]), None, causal)
                 for k0, k1, causal in keys]
        total = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
        out[:, :, q0:q1] = sum(o.float() * (part_lse - total).exp()[..., None] for o, part_lse in parts)
        lse[:, :, q0:q1] = total
    return out, lse


@_attention.register_fake
def _(q, k, v, bounds):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("qwen_edit::block_causal_attention_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, SymInt[] bounds) "
                                "-> (Tensor, Tensor, Tensor)")
def _attention_backward(grad, q, k, v, out, lse, bounds):
    """(dq, dk, dv), each with its input's strides: every call's backward with the whole attention's out and lse.
    A prefix key's gradient is the float32 sum of the shares of the calls that saw it, taken region by region
    between the calls' key bounds (sum_shares); the target's keys have one share, the target call's. Where the kernel
    writes into given tensors (kept_attention.writes_into), a run's one call writes its rows of dq, and the target
    call, over every key, writes its shares into dk and dv, to which the prefix regions add the other calls'."""
    prefix_len, length = (bounds[-2] if bounds else 0), q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    direct = kept_attention.writes_into()
    shares: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (key start, dk share, dv share) of the other calls
    for q0, q1, keys in _runs(bounds, length):
        rows = slice(q0, q1)
        grad_rows, q_rows, out_rows = _dense(grad[:, :, rows], q[:, :, rows], out[:, :, rows])
        calls = []
        for k0, k1, causal in keys:
            whole = direct and k1 - k0 == length  # the target's call, writing dk and dv
            into = (dq[:, :, rows] if len(keys) == 1 else None, dk if whole else None, dv if whole else None)
            calls.append(kept_attention.fused_backward(grad_rows, q_rows, *_dense(k[:, :, k0:k1], v[:, :, k0:k1]),
                                                       out_rows, lse[:, :, rows].contiguous(), None, causal, into))
        if len(calls) > 1:  # a later text run's two calls (top-left kernels)
            summer(q.device)(dq[:, :, rows], *(call[0] for call in calls))
        for (k0, k1, _), (_, dk_share, dv_share) in zip(keys, calls, strict=True):
            if direct and k1 - k0 == length:
                continue
            shares.append((k0, dk_share, dv_share))
            if k1 > prefix_len:  # the target's call, over every key
                dk[:, :, prefix_len:] = dk_share[:, :, prefix_len - k0:]
                dv[:, :, prefix_len:] = dv_share[:, :, prefix_len - k0:]
    _sum_prefix(dk, dv, shares, prefix_len, summer(q.device, into=direct))
    return dq, dk, dv


def _sum_prefix(dk, dv, shares, prefix_len: int, add: Callable) -> None:
    """dk and dv over the prefix's keys from the calls' `shares`, region by region between their key bounds (`add`:
    sum_shares, or sum_shares_into where dk and dv hold the target call's shares already)."""
    spans = [(k0, k0 + dk_share.shape[2]) for k0, dk_share, _ in shares]
    cuts = sorted({0, prefix_len, *(min(end, prefix_len) for _, end in spans), *(start for start, _ in spans)})
    for a, b in pairwise(cuts):
        seen = [share for share, (start, end) in zip(shares, spans, strict=True) if start <= a and b <= end]
        if seen:
            add(dk[:, :, a:b], *(dk_share[:, :, a - k0:b - k0] for k0, dk_share, _ in seen))
            add(dv[:, :, a:b], *(dv_share[:, :, a - k0:b - k0] for k0, _, dv_share in seen))


def sum_shares(out: torch.Tensor, *shares: torch.Tensor) -> None:
    """out = the shares summed in float32 in their order, rounded once to out's dtype."""
    total = shares[0].float()
    for share in shares[1:]:
        total = total + share
    out.copy_(total)


def sum_shares_into(out: torch.Tensor, *shares: torch.Tensor) -> None:
    """out = the shares summed in float32 in their order and out (the last share) added, rounded once."""
    total = shares[0].float()
    for share in shares[1:]:
        total = total + share
    out.copy_(total + out)


_sums: dict[tuple[str, int, str], Callable] = {}  # (function, number of shares, backend) -> its compiled form


def compiled_sum(count: int, backend: str = "inductor", fn: Callable = sum_shares) -> Callable:
    """`fn` (sum_shares or sum_shares_into) for `count` shares, compiled with dynamic shapes, as a function with a code
    object of its own. Dynamo keeps a function's graphs on its code object and runs it eagerly once it has compiled it
    recompile_limit (8) times; one compiled sum for every count would pass that in a run whose layouts make many
    counts (the first text's keys are seen by every call of a row, more with every reference)."""
    key = (fn.__name__, count, backend)
    if key not in _sums:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{count}")
        _sums[key] = torch.compile(types.FunctionType(code, fn.__globals__, code.co_name), dynamic=True,
                                   backend=backend)
    return _sums[key]


def compiled_sum_shares(out: torch.Tensor, *shares: torch.Tensor) -> None:
    """sum_shares through the compiled function for that many shares (one kernel per region that reads each share
    once)."""
    compiled_sum(len(shares))(out, *shares)


def compiled_sum_shares_into(out: torch.Tensor, *shares: torch.Tensor) -> None:
    """sum_shares_into through the compiled function for that many shares."""
    compiled_sum(len(shares), fn=sum_shares_into)(out, *shares)


def summer(device: torch.device, into: bool = False) -> Callable:
    """The backward's sum of key shares (sum_shares, or sum_shares_into with `into`): compiled on CUDA (in place of a
    float32 accumulator added to share by share), as written elsewhere."""
    if device.type != "cuda":
        return sum_shares_into if into else sum_shares
    return compiled_sum_shares_into if into else compiled_sum_shares


@_attention_backward.register_fake
def _(grad, q, k, v, out, lse, bounds):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.bounds = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*torch.ops.qwen_edit.block_causal_attention_backward(grad_out, q, k, v, out, lse, ctx.bounds), None)


_attention.register_autograd(_backward, setup_context=_setup_context)
