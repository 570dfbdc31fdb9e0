"""The components of a local diffusers-format Qwen-Image directory: its variant, Qwen2.5-VL with its processor, the
VAE, and QWEN_EDIT_RANDOM_INIT=1's models built from their configs at random init.

Everything loads with `local_files_only=True` from the directory given; nothing is fetched from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.config.files import random_init  # QWEN_EDIT_RANDOM_INIT=1 (what it means: there)
from train.model import streaming
from train.model.interface import Encoders, ModelError
from train.model.loading import load_text_encoder, random_init_scope, random_text_encoder, streamed_transformer
from train.model.qwen_image import conditioning, vae_frames


def detect_variant(model_dir: str | Path, override: str = "auto") -> str:
    """The model's variant from model_index.json's pipeline class and the transformer config together: edit (v1),
    edit_plus (2509), edit_plus_2511 (the 2509 pipeline with `zero_cond_t`), t2i (Qwen-Image / 2512).

    An explicit `override` (qwen_edit.model.variant) must agree with the files; it is what a directory whose
    pipeline class is not one of these is trained as. First checks that the installed diffusers builds the
    transformer from every key of its config (`check_diffusers_supports`).
    """
    model_dir = Path(model_dir)
    transformer_config = check_diffusers_supports(model_dir)
    zero_cond_t = bool(transformer_config.get("zero_cond_t", False))
    name = json.loads((model_dir / "model_index.json").read_text()).get("_class_name", "")
    base = conditioning.PIPELINE_CLASS_NAMES.get(name)
    if base is None and override == "auto":
        raise ModelError(
            f"{model_dir}/model_index.json names pipeline {name!r}, not one of "
            f"{', '.join(conditioning.PIPELINE_CLASS_NAMES)}; set qwen_edit.model.variant to one of "
            f"{', '.join(conditioning.VARIANTS)}"
        )
    if base is None:  # an unknown pipeline class: trained as the variant asked for, if the transformer agrees
        base = "edit_plus" if override == "edit_plus_2511" else override
    if zero_cond_t and base != "edit_plus":
        raise ModelError(f"{model_dir}: transformer/config.json sets zero_cond_t, which only Qwen-Image-Edit-2511 "
                         f"(QwenImageEditPlusPipeline) uses, but the pipeline is {name!r}; fix the config")
    detected = "edit_plus_2511" if zero_cond_t else base
    if override not in ("auto", detected):
        raise ModelError(
            f"qwen_edit.model.variant is {override!r} but {model_dir} is {detected!r} (model_index.json: {name!r}, "
            f"transformer zero_cond_t: {str(zero_cond_t).lower()}); set the variant to {detected!r} or \"auto\""
        )
    return detected


# Keys of released configs that no diffusers version has used (Qwen-Image's transformer carries
# pooled_projection_dim); diffusers drops them with a warning, and that changes nothing.
UNUSED_CONFIG_KEYS = {"pooled_projection_dim"}


def check_diffusers_supports(model_dir: str | Path) -> dict:
    """The transformer's config, after checking that the installed diffusers' QwenImageTransformer2DModel takes
    every key of it: an older diffusers drops keys it does not know with only a warning (a 2511 checkpoint would
    silently train as 2509 without `zero_cond_t`), so such a key is an error naming it and the versions."""
    import diffusers
    from diffusers import QwenImageTransformer2DModel

    path = Path(model_dir) / "transformer" / "config.json"
    if not path.is_file():
        raise ModelError(f"{path} does not exist; point the model path at a diffusers-format directory")
    config = json.loads(path.read_text())
    _, dropped, _ = QwenImageTransformer2DModel.extract_init_dict(dict(config))
    dropped = sorted(set(dropped) - UNUSED_CONFIG_KEYS)
    if dropped:
        written_by = config.get("_diffusers_version", "a newer version")
        raise ModelError(
            f"{path} sets {', '.join(f'{k}={json.dumps(config[k])}' for k in dropped)}, which "
            f"QwenImageTransformer2DModel of the installed diffusers {diffusers.__version__} does not take (it would "
            f"drop it and train another model); the config was written by diffusers {written_by}: install "
            f"diffusers>={written_by} (pip install -U diffusers)"
        )
    return config


def load_encoders(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                  stream_text_encoder: bool = False, vae_2d_frames: bool = True) -> Encoders:
    """Qwen2.5-VL, its processor and the VAE, frozen, on `device`; with stream_text_encoder Qwen2.5-VL stays in
    host memory and runs on `device` block by block (stream_from_host). vae_2d_frames: see load_vae."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor

    model_dir = Path(model_dir)
    if (model_dir / "processor").is_dir():
        processor = Qwen2VLProcessor.from_pretrained(model_dir / "processor", local_files_only=True)
    else:  # Qwen-Image / 2512 (text-to-image): its prompts are tokenized without images
        processor = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
    text_encoder = load_text_encoder(Qwen2_5_VLForConditionalGeneration, model_dir, dtype, device, stream_text_encoder)
    return Encoders(text_encoder, processor, load_vae(model_dir, dtype, device, vae_2d_frames))


def random_pipeline_models(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                           transformer_device: torch.device | None = None, on_host: bool = False) -> dict:
    """QWEN_EDIT_RANDOM_INIT=1 for a diffusers pipeline (train.infer): {text_encoder, vae, transformer} built from
    their configs at random init as training builds them (with the same notices), for the pipeline's
    from_pretrained to take in place of the weights it would load. They are made on `device` (the transformer on
    `transformer_device`, default `device`), or with on_host (the pipeline's CPU offload) kept in host memory yet
    drawn on `device` tensor by tensor: a CPU draws 8 B and 20 B parameters for minutes, and the GPU's budget may
    not hold a whole model, which is what offload is for."""
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    host = torch.device("cpu")
    text_encoder = random_text_encoder(Qwen2_5_VLForConditionalGeneration, model_dir, dtype, device, on_host)
    text_encoder.requires_grad_(False).eval()
    vae = load_vae(model_dir, dtype, host if on_host else device)
    num_blocks = QwenImageTransformer2DModel.load_config(Path(model_dir) / "transformer")["num_layers"]
    placement = streaming.Placement(transformer_device or device, dtype,
                                    offload=set(range(num_blocks)) if on_host else set())
    kept = host if on_host else placement.device
    transformer, _ = streamed_transformer(model_dir, placement, frozen=True, kept=kept)
    return {"text_encoder": text_encoder, "vae": vae, "transformer": transformer.to(kept).requires_grad_(False).eval()}


def load_vae(model_dir: str | Path, dtype: torch.dtype, device: torch.device, vae_2d_frames: bool = True):
    """The frozen VAE alone (also what a model-parallel decoder stage loads to render validation images);
    vae_2d_frames (model.vae_2d_frames): images take the 2D path of vae_frames.py, the same function."""
    from diffusers import AutoencoderKLQwenImage

    if random_init():
        with random_init_scope("VAE", dtype):
            vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(Path(model_dir) / "vae"))
    else:
        vae = AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae", torch_dtype=dtype,
                                                     local_files_only=True)
    if vae_2d_frames:
        vae_frames.apply(vae)
    return vae.requires_grad_(False).eval().to(device)


