"""The frozen components of a local Qwen-Image-2.1 directory: Qwen3-VL with its processor, and the RGBA VAE.

Everything loads with `local_files_only=True` from the directory given; under QWEN_EDIT_RANDOM_INIT=1 the networks
are built from their configs at random init (measurements on a directory of configs alone).
"""

from __future__ import annotations

from pathlib import Path

import torch

from train.config.files import random_init
from train.model import streaming
from train.model.interface import Encoders
from train.model.loading import random_init_scope, streamed_transformer


def load_processor(model_dir: str | Path):
    """The model's Qwen3VLProcessor (its tokenizer and chat template): the pipeline reads the template even when
    it only replays recorded conditioning (the system turn's length)."""
    from transformers import Qwen3VLProcessor

    return Qwen3VLProcessor.from_pretrained(Path(model_dir) / "processor", local_files_only=True)


def load_text_encoder(model_dir: str | Path, dtype: torch.dtype, device: torch.device):
    """Qwen3-VL, frozen and in eval mode, on `device`."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    path = Path(model_dir) / "text_encoder"
    if random_init():
        with random_init_scope("text encoder", dtype, device):
            model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(path, local_files_only=True))
    else:
        model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.requires_grad_(False).eval().to(device)


def load_encoders(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    stream_text_encoder: bool = False,
    vae_2d_frames: bool = True,
) -> Encoders:
    """Qwen3-VL, its processor and the VAE, frozen, on `device`. stream_text_encoder and vae_2d_frames (the MMDiT's
    block streaming and 2D VAE path) have no 2.1 counterpart yet: the whole encoder sits on `device`, the VAE
    runs as diffusers builds it."""
    return Encoders(
        load_text_encoder(model_dir, dtype, device), load_processor(model_dir), load_vae(model_dir, dtype, device)
    )


def load_vae(model_dir: str | Path, dtype: torch.dtype, device: torch.device, vae_2d_frames: bool = True):
    """The frozen AutoencoderKLQwenImage21 alone (what a render that replays recorded conditioning decodes with)."""
    from diffusers import AutoencoderKLQwenImage21

    if random_init():
        with random_init_scope("VAE", dtype):
            vae = AutoencoderKLQwenImage21.from_config(AutoencoderKLQwenImage21.load_config(Path(model_dir) / "vae"))
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

    host = torch.device("cpu")
    kept = host if on_host else device
    text_encoder = load_text_encoder(model_dir, dtype, kept)
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
