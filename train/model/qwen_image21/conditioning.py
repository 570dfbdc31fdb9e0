"""Prompts, images and latents for Qwen-Image-2.1, encoded exactly as diffusers' QwenImage21Pipeline encodes them.

One Qwen3-VL call reads the prompt and every reference together: the user turn starts with one
"<imageK><|vision_start|><|image_pad|><|vision_end|>" slot per reference, then the prompt. The hidden states are
taken at the last decoder layer before the language model's final norm, the system turn is dropped, and the
positions of the image-pad tokens (each one stands for a 2x2 group of latent tokens) come back as a mask: the
transformer puts the references' latents there. A row without references uses the text-to-image template and no
images. Every image is made RGBA (the VAE reads four channels) and resized once to about `area` pixels; the copy
the VL model sees is that resized image composited on white. tests/test_qwen_image21_conditioning.py checks each
tensor against what the pipeline passes to its transformer.

Shape legend: B batch, T prompt tokens (image slots included), D text width, C latent channels, h/w latent grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
_SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
_ASSISTANT_TURN = "<|im_end|>\n<|im_start|>assistant\n"
T2I_TEMPLATE = _SYSTEM_TURN + "<|im_start|>user\n{}" + _ASSISTANT_TURN
IMAGE_SLOT = "<image{}><|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
PIXELS_PER_TOKEN = 16  # the VAE's spatial factor; the transformer reads latents unpatched
SIZE_MULTIPLE = 32  # one VL image slot covers 2x2 latent tokens
TOKENS_PER_SLOT = 4
MAX_REFERENCES = 10
DEFAULT_AREA = 1024 * 1024  # the pipeline's output_resolution 1024, squared

_image_processor = VaeImageProcessor(vae_scale_factor=PIXELS_PER_TOKEN)


def prompt_text(prompt: str, num_references: int) -> str:
    """The VL model's input text for a prompt and that many references (an empty prompt reads as one space, since
    the encoder would otherwise have nothing to read)."""
    prompt = prompt or " "
    if num_references == 0:
        return T2I_TEMPLATE.format(prompt)
    slots = " ".join(IMAGE_SLOT.format(k + 1) for k in range(num_references))
    return _SYSTEM_TURN + "<|im_start|>user\n" + slots + prompt + _ASSISTANT_TURN


def drop_index(processor) -> int:
    """Tokens of the system turn, dropped from the hidden states: counted from the processor's chat template, as
    the pipeline counts them."""
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


def image_token_id(processor) -> int:
    return processor.tokenizer.encode(IMAGE_PAD)[0]


def dimensions(size: tuple[int, int], area: int = DEFAULT_AREA) -> tuple[int, int]:
    """(width, height) of an image of `size` (width, height) scaled to about `area` pixels, multiples of 32 (the
    pipeline's calculate_dimensions)."""
    ratio = size[0] / size[1]
    width = math.sqrt(area * ratio)
    return round(width / SIZE_MULTIPLE) * SIZE_MULTIPLE, round(width / ratio / SIZE_MULTIPLE) * SIZE_MULTIPLE


def on_white(image: Image.Image) -> Image.Image:
    """The VL model's copy of an RGBA image: composited on white (the checkpoint was trained so)."""
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


def prepare_image(
    image: Image.Image, area: int = DEFAULT_AREA, size: tuple[int, int] | None = None
) -> tuple[Image.Image, torch.Tensor]:
    """(the VL model's RGB copy, VAE pixels (4, H, W) in [-1, 1]) of one image: made RGBA, resized to
    `dimensions(area)` (or to `size`, (width, height)) once for both. A target goes through the same path (its VL
    copy unused)."""
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    width, height = size or dimensions(rgba.size, area)
    vl_copy = on_white(_image_processor.resize(rgba, height=height, width=width))
    return vl_copy, _image_processor.preprocess(rgba, height=height, width=width)[0]


def slot_mismatch(processor, size: tuple[int, int]) -> tuple[int, int] | None:
    """(image slots the VL processor makes, slots the latents need) for an image at the pipeline's size (width,
    height), when they differ, else None. The processor resizes an image outside its pixel limits; the transformer
    then refuses the row (img_shapes and the slots disagree), so the pre-flight names such rows."""
    width, height = size
    image = processor.image_processor
    made = image.get_number_of_image_patches(height, width) // image.merge_size**2
    needed = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN) // TOKENS_PER_SLOT
    return None if made == needed else (made, needed)


@torch.no_grad()
def encode_prompts(text_encoder, processor, prompts: list[str], vl_images: list[list[Image.Image]]):
    """Qwen3-VL hidden states of each row's prompt with its references' VL copies (all rows hold as many).

    Returns (embeds_BTD, mask_BT or None, slots_BT): right-padded embeddings, the padding mask (None when no row is
    padded, as the pipeline passes it) and the image-pad positions (bool).
    """
    assert len({len(images) for images in vl_images}) == 1, "rows with different numbers of references"
    texts = [prompt_text(p, len(images)) for p, images in zip(prompts, vl_images, strict=True)]
    kwargs = {"images": [im for images in vl_images for im in images]} if vl_images[0] else {}
    inputs = processor(text=texts, padding=True, padding_side="left", return_tensors="pt", **kwargs)
    inputs = inputs.to(text_encoder.device)
    keep_BT = inputs["attention_mask"].bool()
    hidden_BTD = _last_layer_states(text_encoder, inputs)
    drop, image_id = drop_index(processor), image_token_id(processor)
    states = [hidden_BTD[b][keep_BT[b]][drop:] for b in range(len(texts))]
    slots = [inputs["input_ids"][b][keep_BT[b]][drop:] == image_id for b in range(len(texts))]
    length = max(s.shape[0] for s in states)
    embeds_BTD = torch.stack([torch.cat([s, s.new_zeros(length - s.shape[0], s.shape[1])]) for s in states])
    slots_BT = torch.stack([torch.cat([s, s.new_zeros(length - s.shape[0])]) for s in slots])
    mask_BT = torch.stack([torch.arange(length, device=s.device) < s.shape[0] for s in states]).long()
    return embeds_BTD, (None if bool(mask_BT.all()) else mask_BT), slots_BT


def _last_layer_states(text_encoder, inputs) -> torch.Tensor:
    """The last decoder layer's output before the language model's final RMSNorm, where the transformer was trained
    to read it. transformers 5 returns the normed states as hidden_states[-1], so the norm is bypassed for this
    call (a forward hook that returns the norm's input), as the pipeline does."""
    names = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    language_model = getattr(text_encoder.model, "language_model", text_encoder.model)
    handle = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        out = text_encoder(**{k: inputs[k] for k in names if k in inputs}, output_hidden_states=True)
    finally:
        handle.remove()
    return out.hidden_states[-1]


@torch.no_grad()
def encode_latents(vae, pixels_B4HW: torch.Tensor) -> torch.Tensor:
    """VAE posterior mode normalised by the VAE's latents_mean/std: (B, C, 1, h, w).

    Row by row, in channels-last strides, as the pipeline hands the VAE each image: CPU convolutions round
    differently per batch size and layout (~1e-6), and so a row's latents do not depend on its micro-batch."""
    x = pixels_B4HW.contiguous(memory_format=torch.channels_last).to(vae.device, vae.dtype)[:, :, None]
    z = torch.cat([vae.encode(row).latent_dist.mode() for row in x.split(1)])
    mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def pack(latents_BC1hw: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) -> (B, h*w, C): one token per latent pixel, row-major."""
    return latents_BC1hw.flatten(2).transpose(1, 2)


def unpack(tokens_BLC: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return tokens_BLC.transpose(1, 2).reshape(tokens_BLC.shape[0], tokens_BLC.shape[2], 1, h, w)


@dataclass
class Conditioning:
    """Everything but the noisy target that the transformer takes for one micro-batch (rows of one slot layout)."""

    prompt_embeds: torch.Tensor  # B T D
    prompt_mask: torch.Tensor | None  # B T, None when no row is padded
    image_slots: torch.Tensor  # B T bool: the image-pad positions of the prompt sequence
    reference_tokens: torch.Tensor  # B Lr C: the references' latents, one after the other
    reference_shapes: list[tuple[int, int, int]]  # (1, h, w) per reference


def encode_references(vae, reference_pixels: list[torch.Tensor], batch_size: int = 1):
    """(tokens (B, Lr, C), shapes [(1, h, w)]) of every reference slot (each (B, 4, H, W)), concatenated in order;
    none (text-to-image) gives an empty (B, 0, C) sequence."""
    if not reference_pixels:
        return torch.zeros(batch_size, 0, vae.config.z_dim, device=vae.device, dtype=vae.dtype), []
    latents = [encode_latents(vae, pixels) for pixels in reference_pixels]
    return torch.cat([pack(z) for z in latents], dim=1), [(1, z.shape[-2], z.shape[-1]) for z in latents]
