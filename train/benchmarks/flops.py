"""Model FLOPs of the benchmarked training step and its MFU (model FLOPs utilisation; recomputation under
checkpointing is not counted):

    FLOPs per sample and step = k_lin x F_lin + 3 x F_attn
      k_lin = 2 for LoRA (frozen base: forward + input-gradient GEMMs; LoRA's own FLOPs ignored), 3 for full
      F_lin  = 2 x sum over the transformer's nn.Linear layers of tokens x in_features x out_features, where
               tokens = image tokens (target + references) for image-stream linears (img_in, attn.to_q/k/v,
               attn.to_out.0, img_mlp, proj_out), text tokens for text-stream linears (txt_in, attn.add_q/k/v_proj,
               attn.to_add_out, txt_mlp), and 1 for modulation / timestep linears (img_mod, txt_mod, norm_out,
               time_text_embed)
      F_attn = blocks x 4 x L^2 x inner_dim (QK^T and AV; L = all tokens, inner_dim = heads x head_dim = 3072)
    MFU = FLOPs per step (x micro-batch x GPUs) / (s/step x 989e12 FLOP/s x GPUs)

989e12 FLOP/s is the bf16 dense peak of one H100/H200 SXM (datasheet; `--peak_tflops` changes it). The linears
are found by walking the module, so the count is right for `--num_layers` and `--tiny`. Sanity check: the full
model at 1024^2 + one 1024^2 reference + 256 text tokens gives 3.87e14 FLOPs per LoRA step, so 1.28 s/step is
about 31% MFU. On a CPU the figure is printed but means nothing. Qwen-Image-2.1's count (its single stream, its
block-causal attention) is train/benchmarks/flops21.py's; step.model_flops picks the family's.
"""

from __future__ import annotations

import re

import torch

PEAK_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense, per GPU (datasheet)
# Which stream's tokens each nn.Linear sees; the first pattern that matches the module name wins.
_STREAMS = (
    ("one", re.compile(r"(^|\.)(time_text_embed|norm_out|img_mod|txt_mod)\.")),
    ("text", re.compile(r"(^|\.)(txt_in|txt_mlp\..+|attn\.(add_[qkv]_proj|to_add_out))$")),
    ("image", re.compile(r"(^|\.)(img_in|proj_out|img_mlp\..+|attn\.(to_[qkv]|to_out\.0))$")),
)


def linear_stream(name: str) -> str:
    """'image', 'text' or 'one' (one vector per sample): whose tokens the nn.Linear called `name` sees."""
    return classify(name, _STREAMS, "stream; extend _STREAMS in train/benchmarks/flops.py")


def classify(name: str, table: tuple[tuple[str, re.Pattern], ...], fix: str) -> str:
    """The kind of the first (kind, pattern) of `table` whose pattern matches the nn.Linear called `name` (a
    peft-wrapped linear counts as its base layer); ValueError naming `fix` when none does."""
    name = name.replace(".base_layer", "")
    for kind, pattern in table:
        if pattern.search(name):
            return kind
    raise ValueError(f"nn.Linear {name!r} belongs to no known {fix}")


def forward_linear_flops(model: torch.nn.Module, image_tokens: int, text_tokens: int) -> float:
    """2 x tokens x in x out summed over the model's nn.Linear layers (LoRA's own layers skipped)."""
    tokens = {"image": image_tokens, "text": text_tokens, "one": 1}
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            total += 2 * tokens[linear_stream(name)] * module.in_features * module.out_features
    return float(total)


def forward_attention_flops(model: torch.nn.Module, tokens: int) -> float:
    """QK^T and AV of the joint attention: blocks x 4 x L^2 x inner_dim."""
    return float(len(model.transformer_blocks) * 4 * tokens**2 * model.inner_dim)


def step_flops(model: torch.nn.Module, image_tokens: int, text_tokens: int, mode: str, batch: int = 1) -> float:
    """Model FLOPs of one training step of `batch` samples on one GPU (see the module docstring)."""
    k_lin = 2 if mode == "lora" else 3
    linear = forward_linear_flops(model, image_tokens, text_tokens)
    attention = forward_attention_flops(model, image_tokens + text_tokens)
    return batch * (k_lin * linear + 3 * attention)


def mfu(flops_per_step: float, s_per_step: float, num_gpus: int, peak_tflops: float = PEAK_TFLOPS) -> float:
    """Model FLOPs utilisation: `flops_per_step` is the global count (all GPUs together)."""
    return flops_per_step / (s_per_step * peak_tflops * 1e12 * num_gpus)
