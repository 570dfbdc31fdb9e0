"""DeepSpeed checkpoints and the final exports (diffusers-format LoRA or transformer directory)."""

from __future__ import annotations

from pathlib import Path

import torch

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def checkpoint_tag(step: int) -> str:
    return f"global_step{step}"


def save(engine, out_dir: str | Path, step: int, resolved_config: dict) -> None:
    """Every rank calls this: ZeRO-2 gives each rank its own optimizer shard to write.

    Frozen weights are left out (they are the base model on disk): a LoRA checkpoint of the 20 B
    transformer is then megabytes, not 41 GB.
    """
    state = {"step": step, "config": resolved_config}
    engine.save_checkpoint(str(out_dir), tag=checkpoint_tag(step), client_state=state, exclude_frozen_parameters=True)


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def export_lora(transformer, out_dir: str | Path) -> Path:
    """OUT/pytorch_lora_weights.safetensors, loadable by the edit pipelines' load_lora_weights."""
    from diffusers import QwenImageEditPipeline

    out_dir = Path(out_dir)
    QwenImageEditPipeline.save_lora_weights(out_dir, transformer_lora_layers=lora_state_dict(transformer),
                                            weight_name=LORA_WEIGHT_NAME, safe_serialization=True)
    return out_dir / LORA_WEIGHT_NAME


def export_full(transformer, out_dir: str | Path) -> Path:
    """OUT/transformer/: a diffusers QwenImageTransformer2DModel directory (config + safetensors)."""
    out = Path(out_dir) / "transformer"
    transformer.save_pretrained(out, safe_serialization=True)
    return out
