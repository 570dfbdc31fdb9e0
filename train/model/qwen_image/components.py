"""The components of a local diffusers-format Qwen-Image directory: its variant, Qwen2.5-VL with its processor, the
VAE, and QWEN_EDIT_RANDOM_INIT=1's models built from their configs at random init.

Everything loads with `local_files_only=True` from the directory given; nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from train.config.files import random_init  # QWEN_EDIT_RANDOM_INIT=1 (what it means: there)
from train.model import streaming
from train.model.interface import Encoders, ModelError
from train.model.loading import random_init_scope, streamed_transformer
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
    vl_device = torch.device("cpu") if stream_text_encoder else device
    if (model_dir / "processor").is_dir():
        processor = Qwen2VLProcessor.from_pretrained(model_dir / "processor", local_files_only=True)
    else:  # Qwen-Image / 2512 (text-to-image): its prompts are tokenized without images
        processor = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
    if random_init():
        text_encoder = _random_text_encoder(model_dir, dtype, device, on_host=stream_text_encoder)
    else:
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir / "text_encoder", dtype=dtype, local_files_only=True
        )
    text_encoder.requires_grad_(False).eval().to(vl_device)
    if stream_text_encoder:
        stream_from_host(text_encoder, device)
    return Encoders(text_encoder, processor, load_vae(model_dir, dtype, device, vae_2d_frames))


def _random_text_encoder(model_dir: Path, dtype: torch.dtype, device: torch.device, on_host: bool = False):
    """Qwen2.5-VL from its config at random init on `device`; on_host: kept in host memory, drawn on `device`."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    with random_init_scope("text encoder", dtype, torch.device("cpu") if on_host else device):
        vl_config = AutoConfig.from_pretrained(Path(model_dir) / "text_encoder")
        if on_host:
            return _random_vl_in_host_memory(vl_config, device)
        return Qwen2_5_VLForConditionalGeneration(vl_config)


def random_pipeline_models(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                           transformer_device: torch.device | None = None, on_host: bool = False) -> dict:
    """QWEN_EDIT_RANDOM_INIT=1 for a diffusers pipeline (train.infer): {text_encoder, vae, transformer} built from
    their configs at random init as training builds them (with the same notices), for the pipeline's
    from_pretrained to take in place of the weights it would load. They are made on `device` (the transformer on
    `transformer_device`, default `device`), or with on_host (the pipeline's CPU offload) kept in host memory yet
    drawn on `device` tensor by tensor: a CPU draws 8 B and 20 B parameters for minutes, and the GPU's budget may
    not hold a whole model, which is what offload is for."""
    from diffusers import QwenImageTransformer2DModel

    host = torch.device("cpu")
    text_encoder = _random_text_encoder(model_dir, dtype, device, on_host).requires_grad_(False).eval()
    vae = load_vae(model_dir, dtype, host if on_host else device)
    num_blocks = QwenImageTransformer2DModel.load_config(Path(model_dir) / "transformer")["num_layers"]
    placement = streaming.Placement(transformer_device or device, dtype,
                                    offload=set(range(num_blocks)) if on_host else set())
    kept = host if on_host else placement.device
    transformer, _ = streamed_transformer(model_dir, placement, frozen=True, kept=kept)
    return {"text_encoder": text_encoder, "vae": vae, "transformer": transformer.to(kept).requires_grad_(False).eval()}


def _random_vl_in_host_memory(vl_config, device: torch.device):
    """A random-init Qwen2.5-VL in host memory, its values drawn on `device` (transformers' initialisation on a CPU
    takes minutes for 8 B parameters): normal(0, initializer_range) matrices and embeddings, ones for norm weights,
    zeros for biases, from a fixed seed. Its values differ from the resident random init's (measurements only)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = Qwen2_5_VLForConditionalGeneration(vl_config)
    generator = torch.Generator(device).manual_seed(zlib.crc32(b"streamed text encoder"))
    std = getattr(vl_config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.ndim == 1:
                t.fill_(1.0 if "norm" in name else 0.0)
            else:
                t.copy_(torch.randn(t.shape, generator=generator, device=device, dtype=t.dtype).mul_(std))
    return model


def stream_from_host(text_encoder: torch.nn.Module, device: torch.device) -> None:
    """Qwen2.5-VL's blocks (the ViT's and the decoder's) keep their matrices in pinned host memory and are copied
    to `device` ahead of use, the next one prefetched on a side stream: train/model/offload.py's BlockOffloader,
    one per block list (two device slots each); everything else (embeddings, lm_head, norms, the ViT's patch
    embedding and merger, the blocks' vectors) moves to `device`.

    Not diffusers' group offloading: Qwen2.5-VL's blocks are two levels down, and with its block_modules reaching
    them (diffusers 0.42.1) the embeddings, which the parent module calls, stay in host memory, and its stream
    prefetch registers its layer tracker twice (both seen on an H200)."""
    from train.model.offload import BlockOffloader

    model = text_encoder.model
    text_encoder.stream_offloaders = [BlockOffloader(dict(enumerate(blocks)), device)
                                      for blocks in (model.visual.blocks, model.language_model.layers)]
    text_encoder.to(device)  # what the offloaders left: their placeholders and slots are on `device` already


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


