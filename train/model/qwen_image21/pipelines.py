"""diffusers' QwenImage21Pipeline for validation images and batch inference: build, and one render.

The same code serves `train.trainer.validation` (a training run's live transformer and frozen encoders) and
`train.infer` (a model directory, optional LoRA files). One pipeline renders text-to-image (no reference) and edits
with 1-10 references; the images keep their alpha channel on the way in (the pipeline composites the VL encoder's
copy on white, the VAE reads all four channels) and on the way out (an RGBA image, saved as a PNG with alpha). The
pipeline's prefix KV cache (`use_kv_cache`, on by default with the released `causal_condition`) is left on: the
text and reference keys and values are computed at the first step and reused, which is exact. Every render draws
its noise from its own CPU `torch.Generator` seeded per request, so an image depends on its request only.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from diffusers.pipelines.qwenimage21 import pipeline_qwenimage21
from PIL import Image

from train.config import InferenceConfig
from train.model.interface import Encoders
from train.model.qwen_image21 import components, conditioning, variant

# the pipeline's methods that run the frozen encoders (recorded where the encoders are, replayed where the
# transformer is: train/trainer/replay.py); _encode_vae_image runs once per reference
ENCODER_CALLS = ("encode_prompt", "_encode_vae_image")


def load_pipeline(
    model_dir: str | Path,
    dtype: torch.dtype,
    name: str = "auto",
    models: dict | None = None,
    vae_2d_frames: bool = True,
):
    """QwenImage21Pipeline from a local diffusers directory (on the CPU; placement.place puts it on devices).
    models: modules already built ({"transformer": ...}), which from_pretrained takes in place of loading them."""
    from diffusers import QwenImage21Pipeline

    variant.detect_variant(model_dir, name)
    pipe = QwenImage21Pipeline.from_pretrained(model_dir, dtype=dtype, local_files_only=True, **(models or {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_from_components(model_dir: str | Path, name: str, transformer, encoders: Encoders):
    """A pipeline around modules that are already loaded (a training run's live transformer and encoders; for a
    replaying render only the VAE: the processor then loads from the directory, since the pipeline reads its chat
    template when built). Nothing is moved or copied; placement.bridge adapts the transformer's inputs when its
    device or dtype differ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler", local_files_only=True)
    sigmas = json.loads((Path(model_dir) / "model_index.json").read_text()).get("sample_sigmas")
    pipe = QwenImage21Pipeline(
        scheduler=scheduler,
        vae=encoders.vae,
        text_encoder=encoders.text_encoder,
        processor=encoders.processor or components.load_processor(model_dir),
        transformer=transformer,
        sample_sigmas=sigmas,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sampling_pipeline(pipe, has_references: bool):
    """One pipeline renders requests with and without references."""
    return pipe


@contextlib.contextmanager
def pipeline_area(area: int):
    """Make QwenImage21Pipeline size its references and its output to about `area` pixels: it sizes them from
    `output_resolution` squared, so an area that is no square of an integer (or a model trained at another area,
    as the tiny demo's) needs its module-level sizing swapped for the duration of the block."""
    original = pipeline_qwenimage21.calculate_dimensions
    pipeline_qwenimage21.calculate_dimensions = lambda _area, ratio: original(area, ratio)
    try:
        yield
    finally:
        pipeline_qwenimage21.calculate_dimensions = original


def output_size(images: list[Image.Image], area: int) -> tuple[int, int]:
    """(width, height) of a render: the last reference's aspect ratio at `area` (how the pipeline sizes an edit),
    a square without references, sides multiples of 32."""
    return conditioning.dimensions(images[-1].size if images else (1, 1), area)


def sample(
    pipe, name: str, images: list[Image.Image], prompt: str, seed: int, inference: InferenceConfig
) -> Image.Image:
    """One render with the sampler settings of `inference` at inference.area: an edit of `images` (RGB or RGBA, in
    order; the output takes the last one's aspect ratio) or, without images, text-to-image (square). The output
    is RGBA."""
    guided = inference.true_cfg_scale > 1
    width, height = output_size(images, inference.area)
    with pipeline_area(inference.area):
        return pipe(
            prompt=prompt,
            image=list(images) or None,
            negative_prompt=inference.negative_prompt if guided else None,
            true_cfg_scale=inference.true_cfg_scale,
            height=height,
            width=width,
            num_inference_steps=inference.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(seed),  # CPU noise: the same image on any device
        ).images[0]
