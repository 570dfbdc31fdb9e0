"""What the transformer sees, built exactly as diffusers' Qwen-Image pipelines build it.

QwenImageEditPipeline ("edit", v1) and QwenImageEditPlusPipeline ("edit_plus", 2509) differ in three places:
the prompt template (v1 puts one vision block in the template; 2509 prefixes "Picture i: " blocks to the
instruction), the image the VL model sees (v1: the same ~1 MP reference the VAE encodes; 2509: a ~384^2 copy),
and the number of references (v1: 1; 2509: 1-3). Edit-2511 ("edit_plus_2511") is conditioned as 2509; its
transformer (config zero_cond_t) does the rest. A sample without references (text-to-image rows, and the
"t2i" variant, Qwen-Image / 2512) is encoded as QwenImagePipeline encodes a prompt: its own template and drop
index, the tokenizer alone, no vision blocks. tests/test_conditioning.py checks every tensor built here against
what the pipelines pass to the transformer.

Shape legend: B batch, C latent channels (16), h/w latent height/width, L packed tokens, T text tokens, D width.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from PIL import Image

from train.model import aspect
from train.model.aspect import snapped_ratio

VARIANTS = ("edit", "edit_plus", "edit_plus_2511", "t2i")
MAX_REFERENCES = {"edit": 1, "edit_plus": 3, "edit_plus_2511": 3, "t2i": 0}
# model_index.json's _class_name -> variant; 2511 names the 2509 pipeline and is told apart by its transformer config
PIPELINE_CLASS_NAMES = {"QwenImageEditPipeline": "edit", "QwenImageEditPlusPipeline": "edit_plus",
                        "QwenImagePipeline": "t2i"}
MODEL_NAMES = {"edit": "Qwen-Image-Edit", "edit_plus": "Qwen-Image-Edit-2509",
               "edit_plus_2511": "Qwen-Image-Edit-2511, zero_cond_t", "t2i": "Qwen-Image / -2512, text-to-image"}
PIPELINE_CLASSES = {"edit": "QwenImageEditPipeline", "edit_plus": "QwenImageEditPlusPipeline",
                    "edit_plus_2511": "QwenImageEditPlusPipeline", "t2i": "QwenImagePipeline"}

_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT_TEMPLATES = {
    "edit": _SYSTEM + _VISION + "{}<|im_end|>\n<|im_start|>assistant\n",
    "edit_plus": _SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n",
}
DROP_IDX = 64  # template tokens before the instruction's own; dropped from the hidden states
# QwenImagePipeline's (text-to-image) template, its dropped prefix, and its tokenizer and embedding length limits
T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
T2I_DROP_IDX = 34
T2I_TOKENIZER_MAX_LENGTH = 1024  # + T2I_DROP_IDX tokens, truncated: the pipeline's tokenizer call
T2I_MAX_SEQUENCE_LENGTH = 512  # embeddings kept per prompt: the pipeline's default max_sequence_length
PIXELS_PER_LATENT = 8  # VAE spatial factor; tokens are 2x2 latent patches, so sizes are multiples of 16
# Defaults of the released pipelines: target and VAE copies ~1 MP, the 2509 VL copies ~384^2.
DEFAULT_AREA = 1024 * 1024
DEFAULT_CONDITION_AREA = 384 * 384

_image_processor = VaeImageProcessor(vae_scale_factor=PIXELS_PER_LATENT * 2)
# Bound at import so that `pipeline_areas`, which swaps the pipelines' function, never rescales our sizing.
_calculate_dimensions = pipeline_qwenimage_edit_plus.calculate_dimensions


def dimensions(area: int, image: Image.Image, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) of `image` scaled to about `area` pixels, multiples of 32, as the pipelines round; with
    `aspect_steps`, the pipelines' size for its snapped aspect ratio (the image is then cropped to it, `fit`)."""
    width, height = _calculate_dimensions(area, snapped_ratio(image.width / image.height, aspect_steps))
    return int(width), int(height)


def crop_size(image: Image.Image, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) of the centred window of `image` that `fit` keeps (train/model/aspect.py)."""
    return aspect.crop_size(image.width, image.height, aspect_steps)


def fit(image: Image.Image, area: int, aspect_steps: int = 0) -> tuple[Image.Image, tuple[int, int]]:
    """`image` cropped at its centre to its snapped aspect ratio (unchanged when `aspect_steps` is 0) and the size
    (width, height) to resize it to (aspect.centre_crop)."""
    size = dimensions(area, image, aspect_steps)  # of the whole image: the crop's own ratio is a pixel off
    return aspect.centre_crop(image, aspect_steps), size


def resize(image: Image.Image, area: int, aspect_steps: int = 0) -> Image.Image:
    image, (width, height) = fit(image, area, aspect_steps)
    return _image_processor.resize(image, height, width)


def to_pixels(image: Image.Image, area: int, aspect_steps: int = 0) -> torch.Tensor:
    """Resize to ~`area` (cropped to its snapped aspect ratio with `aspect_steps`, see `fit`) and map to a [-1, 1]
    tensor of shape (3, H, W), as the pipelines' preprocess."""
    image, (width, height) = fit(image, area, aspect_steps)
    return _image_processor.preprocess(image, height, width)[0]


def reference_inputs(images: list[Image.Image], variant: str, area: int, condition_area: int,
                     aspect_steps: int = 0):
    """The references as the pipelines feed them: (images for the VL model, VAE pixel tensors (3, H, W)). With
    `aspect_steps` each reference is first cropped to its snapped aspect ratio (`fit`); the VL model sees the crop."""
    if variant == "edit":
        # v1 resizes once and gives that same image to the VL model and the VAE.
        resized = [resize(im, area, aspect_steps) for im in images]
        return resized, [_image_processor.preprocess(im, im.height, im.width)[0] for im in resized]
    fitted = [fit(im, area, aspect_steps) for im in images]
    return ([resize(im, condition_area) for im, _ in fitted],
            [_image_processor.preprocess(im, height, width)[0] for im, (width, height) in fitted])


def prompt_texts(prompts: list[str], num_references: int, variant: str) -> list[str]:
    if num_references == 0:
        return [T2I_TEMPLATE.format(p) for p in prompts]
    if variant == "edit":
        return [PROMPT_TEMPLATES["edit"].format(p) for p in prompts]
    prefix = "".join(f"Picture {i + 1}: {_VISION}" for i in range(num_references))
    return [PROMPT_TEMPLATES["edit_plus"].format(prefix + p) for p in prompts]


# Positions diffusers' QwenEmbedRope precomputes; the prompt's positions start after the largest half-side (in
# 2x2-packed tokens) of the images in the sequence, and a prompt that runs past the end fails in the forward.
ROPE_POSITIONS = 4096


def text_room(latent_hw: list[tuple[int, int]]) -> int:
    """Prompt embeddings the transformer's rotary embedding has positions for next to images whose latents are
    `latent_hw` (height, width) each, as QwenEmbedRope places them (scale_rope: half-sides)."""
    return ROPE_POSITIONS - max(max(h // 2 // 2, w // 2 // 2) for h, w in latent_hw)


def prompt_length(processor, prompt: str, variant: str, vl_sizes: list[tuple[int, int]]) -> int:
    """Prompt embeddings encode_prompts yields for `prompt` with VL images of (width, height) `vl_sizes`: the
    template's tokens, each image placeholder expanded as the processor expands it, less DROP_IDX."""
    ids = processor.tokenizer(prompt_texts([prompt], len(vl_sizes), variant)[0])["input_ids"]
    image = processor.image_processor
    expanded = sum(image.get_number_of_image_patches(h, w) // image.merge_size**2 - 1 for w, h in vl_sizes)
    return len(ids) + expanded - DROP_IDX


def prompt_overflow(processor, prompt: str, variant: str, sizes: list[tuple[int, int]], area: int,
                    condition_area: int, with_target: bool = True,
                    aspect_steps: int = 0) -> tuple[int, int] | None:
    """(prompt length, room) when `prompt` with references of (width, height) `sizes` needs more text positions
    than the transformer has (sized as training and the pipelines size them, with `aspect_steps`), else None. `sizes`
    starts with the target's when `with_target`."""
    images = [SimpleNamespace(width=w, height=h) for w, h in sizes]
    dims = [dimensions(area, im, aspect_steps) for im in images]
    refs = images[1:] if with_target else images
    vl = dims[len(sizes) - len(refs):] if variant == "edit" else [
        dimensions(condition_area, SimpleNamespace(width=w, height=h))
        for w, h in (crop_size(im, aspect_steps) for im in refs)]
    length = prompt_length(processor, prompt, variant, vl)
    room = text_room([(h // PIXELS_PER_LATENT, w // PIXELS_PER_LATENT) for w, h in dims])
    return (length, room) if length > room else None


@torch.no_grad()
def encode_prompts(text_encoder, processor, prompts: list[str], vl_images: list[list[Image.Image]], variant: str):
    """Qwen2.5-VL last hidden states of the instructions, template prefix dropped.

    Returns (embeds_BTD, mask_BT) with padding on the right; mask is None when no sample is padded, as the
    pipelines pass it (an all-ones mask would only keep SDPA off its fastest kernels). Samples without references
    are encoded as QwenImagePipeline does: `processor` may then be the tokenizer alone (text-to-image models ship
    no processor).
    """
    texts = prompt_texts(prompts, len(vl_images[0]), variant)
    if not vl_images[0]:
        return _encode_text_only(text_encoder, getattr(processor, "tokenizer", processor), texts)
    flat_images = [im for sample in vl_images for im in sample]
    inputs = processor(text=texts, images=flat_images, padding=True, return_tensors="pt").to(text_encoder.device)
    out = text_encoder(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        pixel_values=inputs.get("pixel_values"),
        image_grid_thw=inputs.get("image_grid_thw"),
        output_hidden_states=True,
    )
    return _pad(out.hidden_states[-1], inputs["attention_mask"].bool(), DROP_IDX)


def _encode_text_only(text_encoder, tokenizer, texts: list[str]):
    """QwenImagePipeline's prompt encoding: the tokenizer (truncating), no images, its drop index and length cap."""
    inputs = tokenizer(texts, max_length=T2I_TOKENIZER_MAX_LENGTH + T2I_DROP_IDX, padding=True, truncation=True,
                       return_tensors="pt").to(text_encoder.device)
    out = text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       output_hidden_states=True)
    embeds_BTD, mask_BT = _pad(out.hidden_states[-1], inputs["attention_mask"].bool(), T2I_DROP_IDX)
    embeds_BTD = embeds_BTD[:, :T2I_MAX_SEQUENCE_LENGTH]
    if mask_BT is not None:
        mask_BT = mask_BT[:, :T2I_MAX_SEQUENCE_LENGTH]
        mask_BT = None if bool(mask_BT.all()) else mask_BT
    return embeds_BTD, mask_BT


def _pad(hidden_BTD: torch.Tensor, keep_BT: torch.Tensor, drop_idx: int):
    """Per sample its unpadded hidden states after the template prefix, right-padded again; mask None if unpadded."""
    per_sample = [hidden_BTD[i][keep_BT[i]][drop_idx:] for i in range(hidden_BTD.shape[0])]
    max_len = max(e.shape[0] for e in per_sample)
    embeds_BTD = torch.stack([torch.cat([e, e.new_zeros(max_len - e.shape[0], e.shape[1])]) for e in per_sample])
    mask_BT = torch.stack([torch.arange(max_len, device=e.device) < e.shape[0] for e in per_sample]).long()
    return embeds_BTD, (None if bool(mask_BT.all()) else mask_BT)


@torch.no_grad()
def encode_latents(vae, pixels_B3HW: torch.Tensor) -> torch.Tensor:
    """VAE posterior mode, normalised with the VAE's latents_mean/std: (B, C, 1, h, w).

    The pipelines' preprocess hands the VAE channels-last strides (its tensors come from HWC numpy arrays);
    a collated (torch.stack-ed, contiguous) batch gets the same layout here, since CPU convolutions round
    differently per layout (~1e-5) and the latents must equal the pipelines' bit for bit.
    """
    x = pixels_B3HW.contiguous(memory_format=torch.channels_last).to(vae.device, vae.dtype)[:, :, None]
    z = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def pack(latents_BC1hw: torch.Tensor) -> torch.Tensor:
    """2x2 patches to tokens: (B, C, 1, h, w) -> (B, h/2 * w/2, 4C), channel-major inside a patch."""
    b, c, _, h, w = latents_BC1hw.shape
    x = latents_BC1hw.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens_BLC: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack` for latent size (h, w)."""
    b, _, c4 = tokens_BLC.shape
    x = tokens_BLC.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 1, h, w)


def encode_references(vae, reference_pixels: list[torch.Tensor], batch_size: int = 1,
                      ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Pack every reference slot (each (B, 3, H, W)) and concatenate them along the sequence; no slots (a
    text-to-image micro-batch of `batch_size`) give an empty (B, 0, 4C) sequence."""
    if not reference_pixels:
        channels = 4 * vae.config.z_dim
        return torch.zeros(batch_size, 0, channels, device=vae.device, dtype=vae.dtype), []
    tokens, shapes = [], []
    for pixels in reference_pixels:
        latents = encode_latents(vae, pixels)
        tokens.append(pack(latents))
        shapes.append((1, latents.shape[-2] // 2, latents.shape[-1] // 2))
    return torch.cat(tokens, dim=1), shapes


def img_shapes(target_hw: tuple[int, int], reference_shapes, batch_size: int) -> list[list[tuple[int, int, int]]]:
    """The pipelines' img_shapes: per sample, the target's token grid then each reference's."""
    return [[(1, target_hw[0] // 2, target_hw[1] // 2), *reference_shapes]] * batch_size


@contextlib.contextmanager
def pipeline_areas(area: int, condition_area: int = DEFAULT_CONDITION_AREA):
    """Make the diffusers edit pipelines size images to `area` (and 2509's VL copies to `condition_area`).

    The pipelines hard-code ~1 MP (1024*1024) whatever height/width is asked; a model trained at another
    area (the tiny demo trains at 128^2) must be sampled at that area, so their module-level sizing is
    swapped for the duration of the block (2509 passes its own area constants through the same function).
    """
    areas = {DEFAULT_AREA: area, DEFAULT_CONDITION_AREA: condition_area}
    saved = []
    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        original = module.calculate_dimensions

        def scaled(target_area, ratio, _original=original):
            return _original(areas.get(target_area, target_area), ratio)

        saved.append((module, original))
        module.calculate_dimensions = scaled
    try:
        yield
    finally:
        for module, original in saved:
            module.calculate_dimensions = original
