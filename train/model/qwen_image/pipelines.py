"""diffusers' Qwen-Image pipelines for validation images and batch inference: build, and one edit.

The same code path serves `train.trainer.validation` (the live, LoRA-wrapped transformer of a training run plus its
already-loaded encoders) and `train.infer` (a model directory, optional LoRA files). Every edit draws its noise
from its own CPU `torch.Generator` seeded per request, so an image depends on its request only: not on the device,
the process that renders it, or the number of processes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from train.config import InferenceConfig
from train.model.interface import Encoders
from train.model.qwen_image import components, conditioning, vae_frames

# the pipelines' methods that run the frozen encoders (QwenImagePipeline has the first only)
ENCODER_CALLS = ("encode_prompt", "_encode_vae_image")


def _pipeline_class(variant: str):
    import diffusers

    return getattr(diffusers, conditioning.PIPELINE_CLASSES[variant])


def load_pipeline(model_dir: str | Path, dtype: torch.dtype, variant: str = "auto", models: dict | None = None,
                  vae_2d_frames: bool = True):
    """The variant's pipeline from a local diffusers directory (on the CPU; placement.place puts it on devices).
    models: modules already built ({"transformer": ..., ...}, e.g. components.random_pipeline_models'), which
    diffusers' from_pretrained takes in place of loading them; the other components (scheduler, tokenizer,
    processor) load from the files.
    vae_2d_frames (model.vae_2d_frames): the VAE's images take vae_frames.py's 2D path, or not."""
    variant = components.detect_variant(model_dir, variant)
    pipe = _pipeline_class(variant).from_pretrained(model_dir, dtype=dtype, local_files_only=True, **(models or {}))
    # before placement.place: its offloading hooks wrap the layers' forwards
    (vae_frames.apply if vae_2d_frames else vae_frames.remove)(pipe.vae)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_from_components(model_dir: str | Path, variant: str, transformer, encoders: Encoders):
    """A pipeline around modules that are already loaded (a training run's live transformer and encoders).

    Nothing is moved or copied: the pipeline computes on the encoders' device, and `bridge` adapts the
    transformer's inputs when its device or dtype differ.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler",
                                                                local_files_only=True)
    tokenizer = Qwen2Tokenizer.from_pretrained(Path(model_dir) / "tokenizer", local_files_only=True)
    processor = {} if variant == "t2i" else {"processor": encoders.processor}  # QwenImagePipeline takes none
    pipe = _pipeline_class(variant)(scheduler=scheduler, vae=encoders.vae, text_encoder=encoders.text_encoder,
                                    tokenizer=tokenizer, transformer=transformer, **processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_to_image_pipeline(pipe):
    """`pipe` itself when it is a QwenImagePipeline, else one around an edit pipeline's modules (shared, not copied;
    LoRAs loaded into the edit pipeline's transformer apply): how a request without references is sampled, with the
    prompt encoding the trainer uses for rows without references."""
    from diffusers import QwenImagePipeline

    if isinstance(pipe, QwenImagePipeline):
        return pipe
    if getattr(pipe, "_text_to_image", None) is None:
        t2i = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer, transformer=pipe.transformer)
        t2i.set_progress_bar_config(disable=True)
        pipe._text_to_image = t2i
    return pipe._text_to_image


def edit(pipe, variant: str, images: list[Image.Image], prompt: str, seed: int, inference: InferenceConfig,
         ) -> Image.Image:
    """One edit with the sampler settings of `inference`, sized to inference.area (not the pipelines' fixed 1 MP);
    without images a text-to-image sample (QwenImagePipeline), square, of inference.area."""
    guided = inference.true_cfg_scale > 1
    if not images:
        width, height = conditioning.dimensions(inference.area, Image.new("RGB", (1, 1)))
        return text_to_image_pipeline(pipe)(
            prompt=prompt, negative_prompt=inference.negative_prompt if guided else None,
            true_cfg_scale=inference.true_cfg_scale, height=height, width=width,
            num_inference_steps=inference.num_inference_steps, generator=torch.Generator("cpu").manual_seed(seed),
        ).images[0]
    with conditioning.pipeline_areas(inference.area, inference.condition_area):
        return pipe(
            image=images[0] if variant == "edit" else images,
            prompt=prompt,
            negative_prompt=inference.negative_prompt if guided else None,
            true_cfg_scale=inference.true_cfg_scale,
            num_inference_steps=inference.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(seed),  # CPU noise: the same image on any device
        ).images[0]




def sampling_pipeline(pipe, has_references: bool):
    """The pipeline that samples a request: a request without references goes to the text-to-image one."""
    return pipe if has_references else text_to_image_pipeline(pipe)
