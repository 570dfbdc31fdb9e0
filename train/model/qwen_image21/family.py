"""The Qwen-Image-2.1 family's record for the generic trainer (train/model/interface.py). The parts left None
(model-parallel decoder cuts, kept attention) are refused at start-up by
train/model/support.py."""

from __future__ import annotations

from train.model.interface import Fp8Linears, LoraKeys, ModelFamily, SwiGLU, Variant
from train.model.qwen_image21 import (
    attention,
    batches,
    bench_models,
    components,
    conditioning,
    forward,
    lora_keys,
    pipelines,
    rope,
    samples,
    tiny,
    variant,
)

FAMILY = ModelFamily(
    name="qwen_image21",
    title=variant.MODEL_NAME,
    variants=(  # one model generates from text alone and edits with 1-10 references
        Variant(variant.VARIANT, variant.MODEL_NAME, variant.PIPELINE_CLASS, conditioning.MAX_REFERENCES, True),
    ),
    transformer_class=variant.TRANSFORMER_CLASS,
    pixels_per_latent=conditioning.PIXELS_PER_TOKEN,
    patch_size=1,  # the transformer reads the latents unpatched
    lora=LoraKeys(
        lora_keys.DEFAULT_TARGETS, variant.PIPELINE_CLASS, lora_keys.comfyui_state_dict, lora_keys.split_comfyui
    ),
    detect_variant=variant.detect_variant,
    transformer_inputs=batches.transformer_inputs,
    target_prediction=batches.target_prediction,
    rgba=True,
    # every linear of a block is a token linear; the one shared modulation sits outside the blocks
    fp8_linears=Fp8Linears(lora_keys.DEFAULT_TARGETS),
    swiglu=SwiGLU("img_mlp", "gate_layer", "proj", "out", "activation_fn"),
    set_attention=attention.set_attention,
    real_rope=rope.use_real_pairs,
    training_forward=forward.use_layout_cache,
    random_pipeline_models=components.random_pipeline_models,
    load_encoders=components.load_encoders,
    load_vae=components.load_vae,
    prompt_tokenizer=components.load_processor,
    image_size=samples.image_size,
    condition_size=samples.condition_size,
    prompt_overflow=samples.prompt_overflow,
    image_problems=samples.image_problems,
    sample_images=samples.sample_images,
    encode_batch=batches.encode_batch,
    join_conditioning=batches.join_conditioning,
    cached_bucket_key=batches.cached_bucket_key,
    conditioning_fingerprint=batches.fingerprint,
    load_pipeline=pipelines.load_pipeline,
    pipeline_from_components=pipelines.pipeline_from_components,
    sample=pipelines.sample,
    sampling_pipeline=pipelines.sampling_pipeline,
    encoder_calls=pipelines.ENCODER_CALLS,
    make_tiny=tiny.make_tiny,
    make_dataset=tiny.make_dataset,
    synthetic_batch=batches.synthetic_batch,
    text_tokens_bound=batches.text_tokens_bound,
    bench=bench_models,
)
