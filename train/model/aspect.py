"""Aspect ratios snapped to a fixed grid (data.bucket_aspect_steps), for every family: similar ratios coincide, so
images of nearby shapes share a shape bucket, and each image is cropped at its centre to its snapped ratio."""

from __future__ import annotations

import math

from PIL import Image


def snapped_ratio(ratio: float, aspect_steps: int = 0) -> float:
    """`ratio` (width / height) snapped to the nearest of 2^(k / aspect_steps) for whole k (log scale), a fixed set
    in which similar aspect ratios coincide (data.bucket_aspect_steps); 0 = unchanged."""
    if not aspect_steps:
        return ratio
    return 2.0 ** (round(aspect_steps * math.log2(ratio)) / aspect_steps)


def crop_size(width: int, height: int, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) of the centred window of a `width` x `height` image with its snapped aspect ratio: the largest
    (all of it when `aspect_steps` is 0; else at most 1 - 2^(-1 / (2 aspect_steps)) of one side is cut)."""
    ratio = snapped_ratio(width / height, aspect_steps)
    if width > height * ratio:  # wider than the snapped ratio: trim the sides
        return max(1, min(width, round(height * ratio))), height
    return width, max(1, min(height, round(width / ratio)))


def centre_crop(image: Image.Image, aspect_steps: int = 0) -> Image.Image:
    """`image` cropped at its centre to `crop_size` (itself when nothing is cut). Images of one size get the same
    window, so a target and a reference of one size still land on the same pixel lattice."""
    width, height = crop_size(image.width, image.height, aspect_steps)
    if (width, height) == image.size:
        return image
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))
