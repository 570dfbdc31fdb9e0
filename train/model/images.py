"""Opening an image file as the 8-bit RGB picture a person sees in a viewer: one helper for every reader.

Three things separate the decoded pixels from what a viewer shows, and all are handled here:
- EXIF orientation: phone cameras store the sensor's pixels and an Orientation tag; viewers apply the tag, so the
  pixels are transposed with Pillow's own `ImageOps.exif_transpose` (and `oriented_size` reads the shown size).
- Transparency: RGBA/LA/PA, palette images with transparent entries and grey/RGB images whose tRNS chunk names a
  transparent colour are composited over a background colour (data.alpha_background, white by default), as a
  viewer on a white page shows them, instead of dropping alpha (which turns transparent pixels into whatever
  colour they hide, often black).
- Bit depth: 16-bit grey ("I;16", "I;16B" ...) is scaled to 8 bits (65535 -> 255) rather than clipped, 32-bit grey
  ("I") from its 16- or 32-bit range, float ("F") from [0, 1]. Pillow itself decodes 16-bit RGB, RGBA and grey +
  alpha PNGs and TIFFs to 8 bits per channel (keeping the high byte, within one level of scaling). What Pillow
  cannot decode (a float RGB TIFF, say) is refused by `decoded_size` with the file named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from train.config.files import DEFAULT_BACKGROUND, background_rgb

# EXIF orientations 5-8 rotate by 90 or 270 degrees, so the shown width and height are swapped.
_SWAPS_SIDES = {5, 6, 7, 8}
_ALPHA_MODES = ("RGBA", "LA", "RGBa", "La")  # what Pillow decodes with an alpha channel
_HIGH_DEPTH = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535, "I": 65535}


def _to_8bit(im: Image.Image) -> Image.Image:
    """High-depth grey scaled (not clipped) into an 8-bit "L" image ("LA" when a 16-bit PNG's tRNS chunk names a
    transparent grey value: those pixels get alpha 0, to be composited as any other transparency)."""
    values = np.asarray(im, dtype=np.float64)
    if im.mode == "F":
        scaled = values * 255.0  # float images hold [0, 1]
    else:
        # "I" holds 16-bit samples (older Pillows' 16-bit PNGs) or 32-bit ones (TIFF): a value past 16 bits says
        # which, so a 32-bit image is scaled from its own range instead of saturating
        top = _HIGH_DEPTH[im.mode] if im.mode != "I" or values.max(initial=0) <= 65535 else 2**31 - 1
        scaled = values * (255.0 / top)
    grey = Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")
    key = im.info.get("transparency")
    if not isinstance(key, int):
        return grey
    alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8), mode="L")
    return Image.merge("LA", (grey, alpha))


def to_rgba(im: Image.Image) -> Image.Image:
    """An opened image as 8-bit RGBA when it has transparency (an alpha channel, a palette's transparent entries, a
    tRNS chunk's colour), else as 8-bit RGB: oriented by its EXIF tag, high bit depths scaled. What a model whose
    VAE reads RGBA takes (Qwen-Image-2.1); `to_rgb` composites the same RGBA over a background."""
    im = ImageOps.exif_transpose(im)
    if im.mode in _HIGH_DEPTH or im.mode == "F":
        im = _to_8bit(im)
    if ("transparency" in im.info and im.mode in ("P", "L", "RGB")) or im.mode == "PA":
        # a palette's transparent entries, or the one transparent colour of a grey/RGB PNG's tRNS chunk (or a
        # GIF's): Pillow's convert turns them into alpha
        im = im.convert("RGBA")
    return im.convert("RGBA") if im.mode in _ALPHA_MODES else im.convert("RGB")


def to_rgb(im: Image.Image, background: str = DEFAULT_BACKGROUND) -> Image.Image:
    """An opened image as 8-bit RGB: oriented by its EXIF tag, alpha composited over `background`, high bit
    depths scaled. Every mode Pillow decodes converts (CMYK, YCbCr, palette, 1-bit ...)."""
    im = to_rgba(im)
    if im.mode == "RGBA":
        canvas = Image.new("RGBA", im.size, background_rgb(background) + (255,))
        return Image.alpha_composite(canvas, im).convert("RGB")
    return im


def open_rgb(path: str | Path, background: str = DEFAULT_BACKGROUND, keep_alpha: bool = False) -> Image.Image:
    """Decode `path` fully into 8-bit RGB as a viewer shows it (see `to_rgb`); with `keep_alpha`, into RGBA when it
    has transparency (`to_rgba`). The file is closed on return."""
    with Image.open(path) as im:
        im.load()
        return to_rgba(im) if keep_alpha else to_rgb(im, background)


def alpha_problem(path: str | Path) -> str | None:
    """Why the transparency of an image that a model reads as RGBA is broken, or None (also for an image without
    transparency). Broken: every pixel is fully transparent (alpha 0 everywhere once decoded as `to_rgba` decodes
    it), so the image shows nothing and its colour channels hold whatever an editor left under the alpha, often
    black; an export that wrote the alpha plane inverted or empty does that. A file whose alpha cannot be decoded at
    all is refused by `decoded_size` already."""
    with Image.open(path) as im:
        im.load()
        rgba = to_rgba(im)
    if rgba.mode != "RGBA" or rgba.getchannel("A").getextrema()[1] > 0:
        return None
    return ("its alpha channel is 0 everywhere (fully transparent: nothing of it shows); re-export it with its "
            "alpha channel, or without one (opaque)")


def open_image(path: str | Path, background: str = DEFAULT_BACKGROUND, alpha: bool = False) -> Image.Image:
    """`open_rgb`, or with `alpha` the 8-bit RGBA picture (`to_rgba`; an image without transparency is opaque
    RGBA); the file is closed on return."""
    if not alpha:
        return open_rgb(path, background)
    return open_rgb(path, keep_alpha=True).convert("RGBA")


def oriented_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) as shown after the EXIF orientation, read from the header (nothing is decoded)."""
    orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
    return (im.height, im.width) if orientation in _SWAPS_SIDES else im.size


def shown_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of the file as a viewer shows it, from its header (see `oriented_size`)."""
    with Image.open(path) as im:
        return oriented_size(im)


class ImageProblem(ValueError):
    """An image file that cannot be read as RGB; the message says why and how to fix the file."""


def decoded_size(path: str | Path) -> tuple[int, int]:
    """Decode `path` fully as every reader does (`open_rgb`) and return its shown (width, height); ImageProblem
    says why it cannot be (not decodable, too large, a mode that does not convert) and the fix. The checks before
    training and before rendering use it, so what passes them is what the readers can open."""
    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            try:
                return to_rgb(im).size
            except (ValueError, KeyError) as e:  # raised by Pillow's convert for a mode it cannot map
                raise ImageProblem(f"image mode {mode!r} cannot be converted to RGB ({e}); re-save it as 8-bit "
                                   "RGB") from e
    except ImageProblem:
        raise
    except Image.DecompressionBombError as e:  # an Exception of its own, not an OSError
        raise ImageProblem(f"too large to decode safely ({e}); downscale it") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
        raise ImageProblem(f"cannot be decoded ({type(e).__name__}: {e}); re-save it as PNG/JPEG (8 or 16 bits "
                           "per channel)") from e


def file_problem(path: Path, rgba: bool = False) -> str | None:
    """Why the image file cannot be trained on, with the fix, or None; `rgba`: the model reads its transparency (the
    family's `rgba`), which must then show something (`alpha_problem`)."""
    if not path.is_file():
        return "file not found; fix the path (relative to the data folder) or remove the row"
    if path.stat().st_size == 0:
        return "file is empty (0 bytes); re-export the image or remove the row"
    try:
        decoded_size(path)  # what the dataset will do with it (orientation, alpha, bit depth)
    except ImageProblem as e:
        return f"{e} or remove the row"
    broken = alpha_problem(path) if rgba else None
    return f"{broken} or remove the row" if broken else None
