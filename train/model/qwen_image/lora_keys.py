"""The Qwen-Image transformer's LoRA names: the default targets and the ComfyUI key layout of its exports (the
diffusers layout is the pipelines' own save_lora_weights, `transformer.X.lora_A.weight`)."""

from __future__ import annotations

import torch

# attention (image and text streams) and MLP projections of every block
TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
# reads and writes this family's LoRA files (lora_state_dict converts the other trainers' layouts)
PIPELINE_CLASS = "QwenImageEditPipeline"


def comfyui(layers: dict[str, torch.Tensor], alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """`diffusion_model.X.lora_A.weight`, `.lora_B.weight` and `X.alpha` for peft's `X.lora_A.weight` layers:
    ComfyUI's LoRA loader and diffusers' Qwen-Image converter both read this layout (and scale by alpha / rank,
    the rank being lora_A's rows: nothing to change for `rank` here)."""
    sd = {f"diffusion_model.{k}": v for k, v in layers.items()}
    for key in layers:
        if key.endswith(".lora_A.weight"):
            sd[f"diffusion_model.{key.removesuffix('.lora_A.weight')}.alpha"] = torch.tensor(alpha)
    return sd
