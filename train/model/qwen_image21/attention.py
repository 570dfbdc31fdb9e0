"""Qwen-Image-2.1's block-causal attention as mask-free SDPA calls (an attention processor for the transformer).

The mask is diffusers' `build_qwenimage21_block_causal_mask`: a query sees every key at or before its own position,
and every key of its own image block; padded prompt keys are seen by none. The model cuts the prefix (text and
references) into runs of one block (diffusers' `_qwenimage21_prefix_segments`, once per forward) and hands them to
every processor; per run, the mask is:

    a reference [s, e)      keys [0, e), all of them              one SDPA call, no mask
    the target [p, L)       every key                             one SDPA call, no mask
    the first text [0, e)   a causal triangle                     one SDPA call, is_causal (a square)
    later text [s, e)       keys [0, s) all, [s, e) causally      two calls, merged by their log-sum-exps

SDPA's is_causal aligns its triangle top-left (query i sees keys 0..i), so a later text run cannot be one call over
keys [0, e): its queries must see s keys more. It is split into a call over the keys before it (no mask) and a
causal call over its own keys (a square, where top-left is the right alignment); the two are merged exactly by
their log-sum-exps: out = sum_p exp(lse_p - logsumexp_p lse_p) out_p. SDPA does not return its log-sum-exp, so
`_LogSumExp` computes it (and its gradient) for those text queries only, in float32, chunked over the keys; the
text runs are short next to the references and the target, which keep the fused kernels.

A micro-batch whose rows are padded (prompts of different lengths; encoder_hidden_states_mask) passes the key
mask to every call, as diffusers' processor does; without padding no call takes a mask. The pipeline's prefix KV
cache goes through diffusers' own projection code; its cached steps attend over the whole cached prefix (with the
key mask if any).

Shapes: B batch, H heads, S/T sequence lengths, D head dim; SDPA takes (B, H, S, D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prepare_qkv

_CHUNK_SCORES = 1 << 24  # float32 scores held at once by _LogSumExp (64 MiB)


class SegmentedSDPAProcessor:
    """In place of diffusers' QwenImage21AttnProcessor (same call signature); exact, and without a dense mask."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_emb=None,
        layer_cache=None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ):
        query, key, value, _ = _qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice
        )
        q_BHSD, k_BHSD, v_BHSD = (t.transpose(1, 2) for t in (query, key, value))
        if segments is None:  # a cached step: the target's queries over [cached prefix, target]
            out_BHSD = F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=attention_mask)
        else:
            out_BHSD = block_causal_attention(q_BHSD, k_BHSD, v_BHSD, segments, key_valid)
        out = out_BHSD.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def processor_name(choice: str, compiled_on_cuda: bool) -> str:
    """train.attention resolved: "auto" is flex where the blocks are compiled on a CUDA GPU (the fastest there:
    docs/results/attention21_h200_2026-12-04.md), else sdpa (an uncompiled flex_attention builds a dense float32
    score matrix)."""
    if choice != "auto":
        return choice
    return "flex" if compiled_on_cuda else "sdpa"


def set_attention(transformer, choice: str, compiled_on_cuda: bool) -> str:
    """Give every block the processor of train.attention (`choice`, resolved by processor_name); returns its name."""
    from diffusers.models.transformers import transformer_qwenimage21 as T

    name = processor_name(choice, compiled_on_cuda)
    make = {
        "flex": T.QwenImage21FlexAttnProcessor,
        "sdpa": T.QwenImage21AttnProcessor,
        "segmented": SegmentedSDPAProcessor,
    }[name]
    for block in transformer.transformer_blocks:
        block.attn.set_processor(make())
    return name


def block_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[tuple[int, int, bool]],
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block-causal attention of (B, H, S, D) tensors: `segments` are the prefix's (start, end, is_text) runs,
    the target is everything after them; key_valid (B, S) bool marks unpadded keys (None: all, and no call takes a
    mask)."""
    prefix_len = segments[-1][1] if segments else 0
    valid = None if key_valid is None else key_valid[:, None, None, :].to(torch.bool)
    outs = []
    for start, end, is_text in segments:
        if is_text:
            outs.append(_text_attention(q, k, v, start, end, valid))
        else:
            mask = None if valid is None else valid[..., :end]
            outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask))
    outs.append(F.scaled_dot_product_attention(q[:, :, prefix_len:], k, v, attn_mask=valid))
    return torch.cat(outs, dim=2)


def _text_attention(q, k, v, start: int, end: int, valid: torch.Tensor | None) -> torch.Tensor:
    """A text run [start, end): the keys before it, all of them, and its own keys causally."""
    q_text = q[:, :, start:end]
    own_mask = None if valid is None else _triangle(end - start, q.device) & valid[..., start:end]
    own = (k[:, :, start:end], v[:, :, start:end], own_mask)
    if start == 0:
        return _causal(q_text, *own)
    before = (k[:, :, :start], v[:, :, :start], None if valid is None else valid[..., :start])
    return merge_by_lse(q_text, before, own)


def _causal(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal SDPA in a square: is_causal, or `mask` when keys are padded (it then holds the triangle)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def merge_by_lse(q: torch.Tensor, before: tuple, own: tuple) -> torch.Tensor:
    """Attention of text queries `q` over the keys `before` them (all; (k, v, key mask or None)) and their `own`
    keys (causally; (k, v, mask holding the triangle or None)), from one SDPA call each, merged exactly."""
    k_before, v_before, before_mask = before
    k_own, _, own_mask = own
    outs = [F.scaled_dot_product_attention(q, k_before, v_before, attn_mask=before_mask), _causal(q, *own)]
    own_lse_mask = own_mask if own_mask is not None else _triangle(q.shape[2], q.device)
    lses = [_LogSumExp.apply(q, k_before, before_mask), _LogSumExp.apply(q, k_own, own_lse_mask)]
    total = torch.logaddexp(*lses)
    merged = sum(out.float() * (lse - total).exp()[..., None] for out, lse in zip(outs, lses, strict=True))
    return merged.to(q.dtype)


def _triangle(size: int, device: torch.device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


class _LogSumExp(torch.autograd.Function):
    """lse_i = log sum_j exp(q_i . k_j / sqrt(D)) over the keys `mask` allows (all when None), float32, (B, H, T).
    Chunked over the keys; its gradient is the softmax-weighted keys (for q) and queries (for k), chunked alike."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        running = torch.full(q.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        for scores in _score_chunks(q, k, mask):
            running = torch.logaddexp(running, scores.logsumexp(dim=-1))
        ctx.save_for_backward(q, k, mask, running)
        return running

    @staticmethod
    def backward(ctx, grad_BHT: torch.Tensor):
        q, k, mask, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_k = []
        for (first, last), scores in zip(_chunk_bounds(q, k), _score_chunks(q, k, mask), strict=True):
            weights = (scores - lse[..., None]).exp() * grad_BHT[..., None].float()  # B H T chunk
            grad_q += weights @ k[:, :, first:last].float()
            grad_k.append(weights.transpose(-1, -2) @ q.float())
        grad_k = torch.cat(grad_k, dim=2) * scale if grad_k else torch.zeros_like(k, dtype=torch.float32)
        return (grad_q * scale).to(q.dtype), grad_k.to(k.dtype), None


def _chunk_bounds(q: torch.Tensor, k: torch.Tensor) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_SCORES // max(1, q.shape[0] * q.shape[1] * q.shape[2]))
    return [(first, min(first + step, k.shape[2])) for first in range(0, k.shape[2], step)]


def _score_chunks(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None):
    """Scaled float32 scores q k^T over each chunk of keys, disallowed ones -inf."""
    q_scaled = q.float() * q.shape[-1] ** -0.5
    for first, last in _chunk_bounds(q, k):
        scores = q_scaled @ k[:, :, first:last].float().transpose(-1, -2)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., first:last], -torch.inf)
        yield scores
