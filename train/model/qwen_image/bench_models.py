"""What the benchmarks (train/benchmarks/) build of the Qwen-Image family: the released transformer's config at any
depth, the tests' tiny transformer, a synthetic micro-batch, Qwen2.5-VL-7B and the released VAE at random init, the
released scheduler's settings, and the online encoding in its timed parts (the VL model, its processor, the VAE both
ways)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.model.interface import Encoders
from train.model.qwen_image import batches, conditioning, tiny, vae_frames
from train.model.qwen_image.archs import FULL_ARCH, VL_PIXELS, VL_TEXT, VL_VISION
from train.model.tiny_tokenizer import build_tokenizer, special_token_ids

SCHEDULER = tiny.SCHEDULER_CONFIG  # the released family's dynamic shift (about 2.0 at 1024^2)
synthetic_batch = batches.synthetic_batch  # a benchmark workload's micro-batch: text tokens are the prompt's


def min_text_tokens(refs: int) -> int:
    """Fewest text tokens a benchmark workload can have: the references are a separate stream."""
    return 1


def released_config(variant: str, num_layers: int | None = None) -> dict:
    """The released transformer's config (Qwen-Image-Edit's; 2511's sets zero_cond_t), `num_layers` deep (None:
    the released 60)."""
    return {
        **FULL_ARCH,
        "num_layers": num_layers or FULL_ARCH["num_layers"],
        "zero_cond_t": variant == "edit_plus_2511",
    }


def tiny_transformer(variant: str) -> torch.nn.Module:
    """The tests' tiny transformer of `variant` (train.make_tiny's)."""
    return tiny.build_transformer(zero_cond_t=variant == "edit_plus_2511")


def full_encoders(data_dir: Path, device: torch.device, dtype: torch.dtype, vae_2d_frames: bool) -> Encoders:
    """Qwen2.5-VL-7B and the released VAE architecture at random init, created on `device` in `dtype` (the VAE
    with vae_frames.py's 2D path when vae_2d_frames, as components.load_vae gives it); the processor has the
    released image limits and a BPE tokenizer trained on the templates and `data_dir`'s prompts."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    prompts = [json.loads(line)["prompt"] for line in (Path(data_dir) / "metadata.jsonl").read_text().splitlines()]
    tokenizer = build_tokenizer([*conditioning.PROMPT_TEMPLATES.values(), *prompts])
    ids = special_token_ids(tokenizer)
    vl_config = Qwen2_5_VLConfig(
        text_config={**VL_TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        vision_config=VL_VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no fp32 copy of 8 B weights first
    try:
        with torch.device(device):
            text_encoder = Qwen2_5_VLForConditionalGeneration(vl_config)
            vae = AutoencoderKLQwenImage()
    finally:
        torch.set_default_dtype(saved)
    for module in (text_encoder, vae):
        module.requires_grad_(False).eval()
    if vae_2d_frames:
        vae_frames.apply(vae)
    return Encoders(text_encoder, tiny.build_processor(tokenizer, **VL_PIXELS), vae)


def encode_parts(raw: dict, encoders: Encoders, variant: str) -> dict:
    """{name: call} of the online encoding of the collated micro-batch `raw`: Qwen2.5-VL (processor included), its
    processor alone (tokenising, resizing and patching the images on the host, then the copy to the device), the
    VAE on the target, on the references, and the whole encode_batch."""
    texts = conditioning.prompt_texts(raw["prompts"], len(raw["vl_images"][0]), variant)
    flat = [im for sample in raw["vl_images"] for im in sample]
    return {
        "encode_vl_s": lambda: conditioning.encode_prompts(
            encoders.text_encoder, encoders.processor, raw["prompts"], raw["vl_images"], variant
        ),
        "encode_vl_processor_s": lambda: encoders.processor(
            text=texts, images=flat, padding=True, return_tensors="pt"
        ).to(encoders.text_encoder.device),
        "encode_vae_target_s": lambda: conditioning.encode_latents(encoders.vae, raw["target"]),
        "encode_vae_references_s": lambda: conditioning.encode_references(encoders.vae, raw["reference_pixels"]),
        "encode_batch_s": lambda: batches.encode_batch(raw, encoders, variant),
    }


# the VAE's two paths (model.vae_2d_frames on and off), to time its parts both ways
VAE_PATHS = {"2d": vae_frames.apply, "3d": vae_frames.remove}


def vae_path(vae) -> str:
    """The VAE_PATHS key of the path `vae` takes now."""
    return "2d" if vae_frames.is_applied(vae) else "3d"
