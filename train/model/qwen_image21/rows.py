"""A Qwen-Image-2.1 row as the data and the renders read it: the size each image is resized to, the images a
batch is encoded from, and whether a prompt fits the transformer's rotary positions next to its images.

Sizes follow the pipeline (conditioning.dimensions: about `area` pixels, sides multiples of 32). With `aspect_steps`
(data.bucket_aspect_steps, when micro-batches stack several rows) an image is first cropped at its centre to its
aspect ratio snapped to the nearest 2^(k / aspect_steps), so that rows of similar shapes share a bucket; every size
below is that of the crop, the one sample_images resizes.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image

from train.model.qwen_image21 import components, conditioning

# QwenImage21Rope's positive positions: a frame index past them reads the table's negative half (a wrong angle,
# silently), so a prompt must leave the images' positions inside it
ROPE_POSITIONS = 8192


def crop_size(width: int, height: int, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) of the centred window kept of an image: the largest with its aspect ratio snapped to the
    nearest 2^(k / aspect_steps) (all of it when `aspect_steps` is 0)."""
    if not aspect_steps:
        return width, height
    ratio = 2.0 ** (round(aspect_steps * math.log2(width / height)) / aspect_steps)
    if width > height * ratio:  # wider than the snapped ratio: trim the sides
        return max(1, min(width, round(height * ratio))), height
    return width, max(1, min(height, round(width / ratio)))


def image_size(area: int, width: int, height: int, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) an image of this size is resized to for `area` pixels (of its crop, with `aspect_steps`)."""
    return conditioning.dimensions(crop_size(width, height, aspect_steps), area)


def condition_size(*_args, **_kwargs) -> None:
    """None: the VL encoder reads each reference at the VAE copy's size (no copy of its own size)."""
    return None


def _cropped(image: Image.Image, aspect_steps: int) -> Image.Image:
    width, height = crop_size(*image.size, aspect_steps)
    if (width, height) == image.size:
        return image
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


def sample_images(
    target: Image.Image,
    references: list[Image.Image],
    variant: str,
    area: int,
    condition_area: int,
    aspect_steps: int = 0,
) -> dict:
    """A row's images as batches.encode_batch reads them: the target's VAE pixels (4, H, W), each reference's
    pixels and its VL copy (conditioning.prepare_image, RGB or RGBA in; condition_area is unused)."""
    pairs = [conditioning.prepare_image(_cropped(im, aspect_steps), area) for im in references]
    return {
        "target": conditioning.prepare_image(_cropped(target, aspect_steps), area)[1],
        "reference_pixels": [pixels for _, pixels in pairs],
        "vl_images": [vl for vl, _ in pairs],
    }


def prompt_tokenizer(model_dir: str | Path):
    """What prompt_overflow counts a prompt's tokens with: the model's processor."""
    return components.load_processor(model_dir)


def text_positions(processor, prompt: str, num_references: int) -> int:
    """Text positions of the joint sequence that `prompt` takes with that many references: the template's tokens
    after the dropped system turn, less one image-pad token per reference (the images' latents sit there)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = tokenizer(conditioning.prompt_text(prompt, num_references))["input_ids"]
    return len(ids) - conditioning.drop_index(processor) - num_references


def prompt_overflow(
    processor,
    prompt: str,
    variant: str,
    sizes: list[tuple[int, int]],
    area: int,
    condition_area: int,
    with_target: bool = True,
    aspect_steps: int = 0,
) -> tuple[int, int] | None:
    """(prompt length, room) when `prompt` with references of (width, height) `sizes` (the target's first when
    `with_target`) needs more text positions than the rotary embedding leaves next to them, else None.

    Every text token advances the frame position by one and every reference by its longer latent side; the
    target's block sits at the position reached after them, which must stay inside ROPE_POSITIONS."""
    references = sizes[1:] if with_target else sizes
    grids = [image_size(area, w, h, aspect_steps) for w, h in references]
    room = ROPE_POSITIONS - 1 - sum(max(w, h) // conditioning.PIXELS_PER_TOKEN for w, h in grids)
    length = text_positions(processor, prompt, len(references))
    return (length, room) if length > room else None
