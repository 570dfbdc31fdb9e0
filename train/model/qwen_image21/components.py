"""The components of a local Qwen-Image-2.1 directory as training loads them: Qwen3-VL with its processor and the
RGBA VAE, frozen (at random init from their configs under QWEN_EDIT_RANDOM_INIT=1). Everything loads with
`local_files_only=True` from the directory given."""

from __future__ import annotations

from pathlib import Path

import torch

from train.config.files import random_init  # QWEN_EDIT_RANDOM_INIT=1 (what it means: there)
from train.model import streaming
from train.model.interface import Encoders
from train.model.loading import load_text_encoder, random_init_scope, streamed_transformer


def load_processor(model_dir: str | Path):
    """MODEL/processor: the Qwen3VLProcessor (tokenizer, image processor and chat template) the pipeline uses."""
    from transformers import Qwen3VLProcessor

    return Qwen3VLProcessor.from_pretrained(Path(model_dir) / "processor", local_files_only=True)


def load_encoders(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    stream_text_encoder: bool = False,
    vae_2d_frames: bool = True,
) -> Encoders:
    """Qwen3-VL, its processor and the VAE, frozen, on `device`; with stream_text_encoder Qwen3-VL stays in host
    memory and runs on `device` block by block (loading.stream_from_host). vae_2d_frames: see load_vae."""
    from transformers import Qwen3VLForConditionalGeneration

    text_encoder = load_text_encoder(Qwen3VLForConditionalGeneration, model_dir, dtype, device, stream_text_encoder)
    return Encoders(text_encoder, load_processor(model_dir), load_vae(model_dir, dtype, device, vae_2d_frames))


def load_vae(model_dir: str | Path, dtype: torch.dtype, device: torch.device, vae_2d_frames: bool = True):
    """The frozen AutoencoderKLQwenImage21 (RGBA in and out). model.vae_2d_frames does not apply: its 2D path is
    written for the Qwen-Image VAE's layers, so this VAE always runs diffusers' own."""
    from diffusers import AutoencoderKLQwenImage21

    if random_init():
        with random_init_scope("VAE", dtype):
            config = AutoencoderKLQwenImage21.load_config(Path(model_dir) / "vae")
            vae = AutoencoderKLQwenImage21.from_config(config)
    else:
        vae = AutoencoderKLQwenImage21.from_pretrained(
            model_dir, subfolder="vae", torch_dtype=dtype, local_files_only=True
        )
    return vae.requires_grad_(False).eval().to(device)


def random_pipeline_models(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    transformer_device: torch.device | None = None,
    on_host: bool = False,
) -> dict:
    """QWEN_EDIT_RANDOM_INIT=1 for train.infer: {text_encoder, vae, transformer} at random init (with the same
    notices as training), for the pipeline's from_pretrained to take in place of the weights. They are made on
    `device` (the transformer on `transformer_device`, default `device`), or with on_host (the pipeline's CPU
    offload) kept in host memory, the transformer's values drawn on `device` tensor by tensor."""
    from diffusers import QwenImage21Transformer2DModel
    from transformers import Qwen3VLForConditionalGeneration

    host = torch.device("cpu")
    kept = host if on_host else device
    text_encoder = load_text_encoder(Qwen3VLForConditionalGeneration, model_dir, dtype, kept)
    vae = load_vae(model_dir, dtype, kept)
    num_blocks = QwenImage21Transformer2DModel.load_config(Path(model_dir) / "transformer")["num_layers"]
    blocks = set(range(num_blocks)) if on_host else set()
    placement = streaming.Placement(transformer_device or device, dtype, offload=blocks)
    transformer, _ = streamed_transformer(model_dir, placement, frozen=True, kept=host if on_host else None)
    return {
        "text_encoder": text_encoder,
        "vae": vae,
        "transformer": transformer.to(host if on_host else placement.device).requires_grad_(False).eval(),
    }
