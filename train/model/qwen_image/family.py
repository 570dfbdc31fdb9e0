"""The Qwen-Image MMDiT family's record for the generic trainer (train/model/interface.py): Qwen-Image-Edit (v1),
-2509, -2511 and the text-to-image Qwen-Image / 2512, with the few adapters from the generic calls to this folder's
functions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from train.model.interface import Fp8Linears, LoraKeys, ModelFamily, Variant
from train.model.qwen_image import (
    batches,
    bench_models,
    components,
    conditioning,
    cut,
    lora_keys,
    pipelines,
    rope,
    tiny,
)


def image_size(area: int, width: int, height: int, aspect_steps: int = 0) -> tuple[int, int]:
    """(width, height) an image of this size is resized to for `area` pixels, as the pipelines round (multiples
    of 32), on the aspect-ratio grid of `aspect_steps`."""
    return conditioning.dimensions(area, SimpleNamespace(width=width, height=height), aspect_steps)


def condition_size(
    variant: str, condition_area: int, width: int, height: int, aspect_steps: int = 0
) -> tuple[int, int] | None:
    """(width, height) of the copy of a reference that the VL encoder sees at `condition_area` (2509, 2511: from
    the reference's crop); None for v1, whose VL encoder sees the VAE's copy."""
    if variant == "edit":
        return None
    crop_w, crop_h = conditioning.crop_size(SimpleNamespace(width=width, height=height), aspect_steps)
    return image_size(condition_area, crop_w, crop_h)


def sample_images(
    target: Image.Image,
    references: list[Image.Image],
    variant: str,
    area: int,
    condition_area: int,
    aspect_steps: int = 0,
) -> dict:
    """A row's images as the pipelines feed them: the target's and the references' VAE pixels, the VL images."""
    vl_images, reference_pixels = conditioning.reference_inputs(references, variant, area, condition_area, aspect_steps)
    return {
        "target": conditioning.to_pixels(target, area, aspect_steps),
        "reference_pixels": reference_pixels,
        "vl_images": vl_images,
    }


def prompt_tokenizer(model_dir: str | Path):
    """The model's Qwen2VLProcessor (for the pre-flight's prompt lengths), None for text-to-image models (which
    ship none, and whose prompts the pipeline truncates)."""
    from transformers import Qwen2VLProcessor

    path = Path(model_dir) / "processor"
    return Qwen2VLProcessor.from_pretrained(path, local_files_only=True) if path.is_dir() else None


def fingerprint() -> str:
    """What the cached prompt embeddings depend on besides the model files: the templates, dropped prefixes and
    lengths."""
    return json.dumps(
        [
            conditioning.PROMPT_TEMPLATES,
            conditioning.DROP_IDX,
            conditioning.T2I_TEMPLATE,
            conditioning.T2I_DROP_IDX,
            conditioning.T2I_MAX_SEQUENCE_LENGTH,
        ],
        sort_keys=True,
    )


FAMILY = ModelFamily(
    name="qwen_image",
    title="Qwen-Image",
    variants=tuple(
        Variant(v, conditioning.MODEL_NAMES[v], conditioning.PIPELINE_CLASSES[v], conditioning.MAX_REFERENCES[v],
                v == "t2i")
        for v in conditioning.VARIANTS
    ),
    transformer_class="QwenImageTransformer2DModel",
    pixels_per_latent=conditioning.PIXELS_PER_LATENT,
    patch_size=2,
    lora=LoraKeys(lora_keys.TARGETS, lora_keys.PIPELINE_CLASS, lora_keys.comfyui),
    # every LoRA target is a token linear (both streams' attention and MLPs); the modulation gives one vector a sample
    fp8_linears=Fp8Linears(lora_keys.TARGETS, ("img_mod.1", "txt_mod.1")),
    attention_module="diffusers.models.transformers.transformer_qwenimage",
    # the last block's text stream after its attention: the transformer returns the image stream only
    unreached=("attn.to_add_out", "txt_mlp"),
    detect_variant=components.detect_variant,
    load_encoders=components.load_encoders,
    load_vae=components.load_vae,
    random_pipeline_models=components.random_pipeline_models,
    prompt_tokenizer=prompt_tokenizer,
    image_size=image_size,
    condition_size=condition_size,
    prompt_overflow=conditioning.prompt_overflow,
    sample_images=sample_images,
    encode_batch=batches.encode_batch,
    join_conditioning=batches.join_conditioning,
    cached_bucket_key=batches.cached_bucket_key,
    conditioning_fingerprint=fingerprint,
    transformer_inputs=batches.transformer_inputs,
    target_prediction=batches.target_prediction,
    real_rope=rope.use_real_pairs,
    cut=cut,
    load_pipeline=pipelines.load_pipeline,
    pipeline_from_components=pipelines.pipeline_from_components,
    sample=pipelines.edit,
    sampling_pipeline=pipelines.sampling_pipeline,
    encoder_calls=pipelines.ENCODER_CALLS,
    make_tiny=tiny.make_tiny,
    make_dataset=tiny.make_dataset,
    synthetic_batch=batches.synthetic_batch,
    text_tokens_bound=batches.text_tokens_bound,
    bench=bench_models,
)
