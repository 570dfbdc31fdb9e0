"""The Qwen-Image-2.1 family's record for the generic trainer (train/model/interface.py), with what is wired so far:
variant detection, the encoders, a row's images and its prompt's room, the conditioning of a batch, the
transformer's inputs and the target's prediction, the LoRA targets and export keys (ComfyUI's fused gate_up
included), the fp8 base's linears, the pipelines of validation and inference, and the tiny checkpoint. The parts
left None (the latent cache, the memory plan's hooks, model-parallel cuts, kept attention) are refused at start-up
by train/model/support.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from train.model.interface import Fp8Linears, LoraKeys, ModelFamily, Variant
from train.model.qwen_image21 import (
    attention,
    batches,
    components,
    conditioning,
    lora_keys,
    pipelines,
    rows,
    tiny,
    variant,
)


def make_tiny(out: str | Path, name: str = variant.VARIANT, num_samples: int = 0, size: int = 0, seed: int = 0) -> Path:
    """OUT/model: the tiny 2.1 checkpoint (the family has no tiny dataset yet: `num_samples` and `size` are
    unused)."""
    tiny.make_tiny_model(Path(out) / "model", seed)
    return Path(out)


FAMILY = ModelFamily(
    name="qwen_image21",
    title=variant.MODEL_NAME,
    variants=(Variant(variant.VARIANT, variant.MODEL_NAME, variant.PIPELINE_CLASS, conditioning.MAX_REFERENCES),),
    transformer_class=variant.TRANSFORMER_CLASS,
    pixels_per_latent=conditioning.PIXELS_PER_TOKEN,
    patch_size=1,  # the transformer reads the latents unpatched
    lora=LoraKeys(
        lora_keys.DEFAULT_TARGETS, variant.PIPELINE_CLASS, lora_keys.comfyui_state_dict, lora_keys.split_comfyui
    ),
    detect_variant=variant.detect_variant,
    transformer_inputs=batches.transformer_inputs,
    target_prediction=batches.target_prediction,
    # every linear of a block is a token linear; the one shared modulation sits outside the blocks
    fp8_linears=Fp8Linears(lora_keys.DEFAULT_TARGETS),
    rgba=True,
    load_encoders=components.load_encoders,
    load_vae=components.load_vae,
    random_pipeline_models=components.random_pipeline_models,
    prompt_tokenizer=rows.prompt_tokenizer,
    image_size=rows.image_size,
    condition_size=rows.condition_size,
    prompt_overflow=rows.prompt_overflow,
    sample_images=rows.sample_images,
    encode_batch=batches.encode_batch,
    join_conditioning=batches.join_conditioning,
    load_pipeline=pipelines.load_pipeline,
    pipeline_from_components=pipelines.pipeline_from_components,
    sample=pipelines.sample,
    sampling_pipeline=pipelines.sampling_pipeline,
    encoder_calls=pipelines.ENCODER_CALLS,
    make_tiny=make_tiny,
    bench=SimpleNamespace(attention_processor=attention.SegmentedSDPAProcessor),  # train/benchmarks/attention21.py
)
