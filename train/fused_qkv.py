"""One matmul for each stream's q, k and v projections when the frozen base is in fp8 (train.fp8_base).

diffusers' Qwen double-stream attention projects the image stream three times (attn.to_q, to_k, to_v) and the
text stream three times (add_q_proj, add_k_proj, add_v_proj), each a peft LoRA layer over a frozen linear. With
`install(transformer)` each stream instead runs
- one fp8 matmul against the three e4m3 weights stacked [3N, K] (the per-layer weights become views of the stack,
  so no memory is added; train.fp8_transposed keeps one transposed stack instead of three transposed weights), and
- one matmul against the three LoRA A matrices stacked [3r, K], then each layer's own B.
The backward then also takes one matmul per stream for the input gradient (K = 3N) instead of three plus adds.
What changes numerically: the backward's output gradient is quantised with one scale per row over the 3N columns
instead of one per N (tests/test_fused_qkv.py bounds the difference; the forward is the same computation).

The attention itself stays diffusers': `FusedQKVProcessor` computes the six projections, then calls diffusers'
processor with a stand-in for the attention module whose projections return those results. Any layer that is not
a plain LoRA layer over a converted fp8 linear (LoRA dropout, DoRA, several adapters, merged or disabled adapters,
LoRA on some of the three only) makes that call fall back to diffusers' per-layer projections.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from train.fp8 import Float8FrozenLinear, _Float8Matmul

STREAMS = {"fused_qkv": ("to_q", "to_k", "to_v"), "fused_add_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
# What diffusers' processor reads from the attention module besides the six projections.
PASSED_THROUGH = ("heads", "inner_dim", "norm_q", "norm_k", "norm_added_q", "norm_added_k", "to_out", "to_add_out")


def _base(layer: torch.nn.Module) -> torch.nn.Module:
    return getattr(layer, "base_layer", layer)


class StackedFloat8(torch.nn.Module):
    """Three token Float8FrozenLinear of the same input size as one: y = x [W1; W2; W3]^T + [b1; b2; b3]."""

    def __init__(self, bases: list[Float8FrozenLinear], keep_transposed: bool):
        super().__init__()
        stack = torch.cat([b.weight_fp8 for b in bases])
        self.register_buffer("weight_fp8", stack, persistent=False)
        self.register_buffer("weight_scale", torch.cat([b.weight_scale for b in bases]), persistent=False)
        biases = [b.bias for b in bases]
        bias = None if any(b is None for b in biases) else torch.cat([b.detach() for b in biases])
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("weight_fp8_t", stack.t().contiguous() if keep_transposed else None, persistent=False)
        start = 0
        for b in bases:  # the layers keep working alone (the fallback), on views of the stack
            b.weight_fp8 = stack[start:start + b.out_features]
            b.weight_fp8_t = None
            start += b.out_features
        self.out_features = [b.out_features for b in bases]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Float8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.weight_fp8_t)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _plain_lora(layer: torch.nn.Module) -> str | None:
    """The adapter name if `layer` is a peft LoRA layer that adds x A^T B^T * scaling and nothing else."""
    if not hasattr(layer, "lora_A") or getattr(layer, "merged", True) or getattr(layer, "disable_adapters", True):
        return None
    active = list(layer.active_adapters)
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in getattr(layer, "lora_variant", {}):
        return None
    if not isinstance(layer.lora_dropout[active[0]], torch.nn.Identity):
        return None
    return active[0]


def project(attn: torch.nn.Module, key: str, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The three projections of `x` for stream `key` of STREAMS through the stack, or None (fall back)."""
    stacked = getattr(attn, key, None)
    layers = [getattr(attn, name) for name in STREAMS[key]]
    adapters = [_plain_lora(layer) for layer in layers]
    if stacked is None or None in adapters:
        return None
    a_weights = [layer.lora_A[a].weight for layer, a in zip(layers, adapters, strict=True)]
    rank = a_weights[0].shape[0]
    if any(w.shape[0] != rank or w.dtype != a_weights[0].dtype for w in a_weights):
        return None
    base = stacked(x).split(stacked.out_features, dim=-1)
    h = torch.nn.functional.linear(x.to(a_weights[0].dtype), torch.cat(a_weights)).split(rank, dim=-1)
    return [(y + torch.nn.functional.linear(hi, layer.lora_B[a].weight) * layer.scaling[a]).to(y.dtype)
            for y, hi, layer, a in zip(base, h, layers, adapters, strict=True)]


class _Given:
    """A projection whose result is already computed."""

    def __init__(self, result: torch.Tensor):
        self.result = result

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.result


class _Projected:
    """Stands in for the attention module in diffusers' processor: projections given, the rest passed through."""

    def __init__(self, attn: torch.nn.Module, img: list[torch.Tensor], txt: list[torch.Tensor]):
        for name, result in zip(STREAMS["fused_qkv"] + STREAMS["fused_add_qkv"], img + txt, strict=True):
            setattr(self, name, _Given(result))
        for name in PASSED_THROUGH:
            setattr(self, name, getattr(attn, name))


class FusedQKVProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' double-stream attention with each stream's q/k/v projected by `project`."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        img = project(attn, "fused_qkv", hidden_states)
        txt = None if encoder_hidden_states is None else project(attn, "fused_add_qkv", encoder_hidden_states)
        target = attn if img is None or txt is None else _Projected(attn, img, txt)
        return super().__call__(target, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                attention_mask, image_rotary_emb)


def install(transformer: torch.nn.Module, keep_transposed: bool = False) -> int:
    """Stack the fp8 q/k/v weights of every attention whose six projections are converted token linears and give
    it FusedQKVProcessor; returns how many attentions were changed. Call after fp8.convert_frozen_linears."""
    count = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        groups = {key: [_base(getattr(attn, n, None)) for n in names] for key, names in STREAMS.items()}
        if not all(isinstance(b, Float8FrozenLinear) and b.kind == "token" for bases in groups.values() for b in bases):
            continue
        if not isinstance(attn.processor, QwenDoubleStreamAttnProcessor2_0):
            continue
        for key, bases in groups.items():
            if not hasattr(attn, key):
                setattr(attn, key, StackedFloat8(bases, keep_transposed))
        if not isinstance(attn.processor, FusedQKVProcessor):
            new = FusedQKVProcessor()
            new._attention_backend = attn.processor._attention_backend  # as set_attention_backend left them
            new._parallel_config = attn.processor._parallel_config
            attn.set_processor(new)
        count += 1
    return count
