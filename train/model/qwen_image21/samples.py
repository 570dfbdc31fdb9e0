"""A Qwen-Image-2.1 row's images as training feeds them, and the pre-flight's checks of a row against what the
pipeline and the transformer accept.

Every image of a row (references and target) is sized as the pipeline sizes an image: about `area` pixels, sides
multiples of 32, its own aspect ratio (with data.bucket_aspect_steps, first cropped at its centre to its snapped
ratio, train/model/aspect.py); conditioning.prepare_image then makes its RGBA VAE pixels and the VL model's copy.
"""

from __future__ import annotations

from PIL import Image

from train.model import aspect
from train.model.qwen_image21 import conditioning
from train.model.qwen_image21.conditioning import PIXELS_PER_TOKEN

ROPE_POSITIONS = 8192  # the frame positions QwenImage21Rope precomputes; a sequence past them wraps silently


def image_size(area: int, width: int, height: int, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) an image of this size is resized to: the pipeline's calculate_dimensions for its aspect
    ratio, snapped by `aspect_steps` (0: its own ratio, as the pipeline)."""
    ratio = aspect.snapped_ratio(width / height, aspect_steps)
    return conditioning.dimensions((ratio, 1.0), area)


def condition_size(variant: str, condition_area: int, width: int, height: int, aspect_steps: int = 0) -> None:
    """The VL model sees each reference at its VAE size (composited on white): no copy of its own size."""
    return None


def prepare(image: Image.Image, area: int, aspect_steps: int = 0):
    """(VL copy, VAE pixels (4, H, W)) of one image, cropped to its snapped ratio first, at `image_size`."""
    cropped = aspect.centre_crop(image, aspect_steps)
    width, height = image_size(area, image.width, image.height, aspect_steps)
    return conditioning.prepare_image(cropped, area, size=(width, height))


def sample_images(
    target: Image.Image,
    references: list[Image.Image],
    variant: str,
    area: int,
    condition_area: int,
    aspect_steps: int = 0,
) -> dict:
    """A row's images as encode_batch reads them: the target's VAE pixels, and per reference its VAE pixels and
    its VL copy (references in the row's order). RGB and RGBA images alike (RGB is made opaque RGBA)."""
    refs = [prepare(im, area, aspect_steps) for im in references]
    return {
        "target": prepare(target, area, aspect_steps)[1],
        "reference_pixels": [pixels for _, pixels in refs],
        "vl_images": [vl for vl, _ in refs],
    }


def text_positions(processor, prompt: str, num_references: int) -> int:
    """Text tokens of the joint sequence for `prompt` with that many references: the template and prompt as the
    processor tokenizes them, less the dropped system turn and the image slots (which hold latents)."""
    ids = processor.tokenizer(conditioning.prompt_text(prompt, num_references))["input_ids"]
    return len(ids) - num_references - conditioning.drop_index(processor)


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
    """(text positions, room) when the prompt next to references of (width, height) `sizes` (the target's first
    when `with_target`) runs past the rotary embedding's frame positions, else None. Each text token takes one
    position and each reference as many as its longer latent side (QwenImage21Rope), the target the next one."""
    refs = sizes[1:] if with_target else sizes
    taken = sum(max(image_size(area, w, h, aspect_steps)) // PIXELS_PER_TOKEN for w, h in refs)
    length, room = text_positions(processor, prompt, len(refs)), ROPE_POSITIONS - 1 - taken
    return (length, room) if length > room else None


def image_problems(processor, sizes: list[tuple[int, int]], area: int, aspect_steps: int = 0) -> list[tuple[int, str]]:
    """(index in `sizes`, problem and fix) for each reference of a row (sizes: the target's, then the references')
    whose image slots the VL processor would count otherwise than its latents need (conditioning.slot_mismatch):
    the transformer would refuse the row at its step."""
    problems = []
    for k, (width, height) in enumerate(sizes[1:], start=1):
        size = image_size(area, width, height, aspect_steps)
        mismatch = conditioning.slot_mismatch(processor, size)
        if mismatch:
            made, needed = mismatch
            limits = processor.image_processor.size
            problems.append(
                (
                    k,
                    f"{width}x{height} px is resized to {size[0]}x{size[1]}, which the VL processor "
                    f"(pixel limits {limits.get('shortest_edge')}-{limits.get('longest_edge')}) turns "
                    f"into {made} image slots where the latents need {needed}; change data.area so that "
                    "references land within those limits, or resize the image",
                )
            )
    return problems
