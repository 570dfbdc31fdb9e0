"""Load the components of a local diffusers-format Qwen-Image-Edit directory; LoRA or full training.

Everything loads with `local_files_only=True` from the directory given; nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from train.config import LoraConfig, ModelConfig
from train.config.files import RANDOM_INIT_ENV, random_init  # QWEN_EDIT_RANDOM_INIT=1 (what it means: there)
from train.model import fp8, kept_attention
from train.model.qwen_image import conditioning, rope, vae_frames


class ModelError(ValueError):
    """The model directory does not fit the configuration or the installed diffusers; the message says why."""


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
    family = conditioning.PIPELINE_CLASS_NAMES.get(name)
    if family is None and override == "auto":
        raise ModelError(
            f"{model_dir}/model_index.json names pipeline {name!r}, not one of "
            f"{', '.join(conditioning.PIPELINE_CLASS_NAMES)}; set qwen_edit.model.variant to one of "
            f"{', '.join(conditioning.VARIANTS)}"
        )
    if family is None:  # an unknown pipeline class: trained as the variant asked for, if the transformer agrees
        family = "edit_plus" if override == "edit_plus_2511" else override
    if zero_cond_t and family != "edit_plus":
        raise ModelError(f"{model_dir}: transformer/config.json sets zero_cond_t, which only Qwen-Image-Edit-2511 "
                         f"(QwenImageEditPlusPipeline) uses, but the pipeline is {name!r}; fix the config")
    detected = "edit_plus_2511" if zero_cond_t else family
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


def scheduler_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "scheduler" / "scheduler_config.json").read_text())


@dataclass
class Encoders:
    """The frozen conditioning models; they stay outside the DeepSpeed engine."""

    text_encoder: torch.nn.Module
    processor: object  # Qwen2VLProcessor; the tokenizer alone for a text-to-image model (which ships no processor)
    vae: torch.nn.Module


def encoder_dtype(name: str, device: torch.device) -> torch.dtype:
    """qwen_edit.model.encoder_dtype resolved for `device`: auto = bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, name)


def _init_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def _random_init_scope(what: str, dtype: torch.dtype, device: torch.device | None = None):
    """Create modules on `device` (default: the current device) in `dtype` (no fp32 copy first), and say so loudly.
    The weights are drawn from a seed fixed per model (`what`), so every process and every run builds the same ones
    (two runs to compare, or a model-parallel decoder's VAE and its encoder's); the caller's RNG state is left as it
    was."""
    device = device or _init_device()
    _random_init_notice(what, device)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    devices = [device.index] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(zlib.crc32(what.encode()))
            yield
    finally:
        torch.set_default_dtype(saved)


def _random_init_notice(what: str, device: torch.device) -> None:
    print(f"{RANDOM_INIT_ENV}=1: {what} at RANDOM INIT on {device} (for measurements only)", flush=True)


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

    with _random_init_scope("text encoder", dtype, torch.device("cpu") if on_host else device):
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

    from train.model import streaming

    host = torch.device("cpu")
    text_encoder = _random_text_encoder(model_dir, dtype, device, on_host).requires_grad_(False).eval()
    vae = load_vae(model_dir, dtype, host if on_host else device)
    num_blocks = QwenImageTransformer2DModel.load_config(Path(model_dir) / "transformer")["num_layers"]
    placement = streaming.Placement(transformer_device or device, dtype,
                                    offload=set(range(num_blocks)) if on_host else set())
    kept = host if on_host else placement.device
    transformer, _ = streamed_transformer(model_dir, placement, frozen=True, kept=kept)
    return {"text_encoder": text_encoder, "vae": vae, "transformer": transformer.to(kept).requires_grad_(False).eval()}


def streamed_transformer(model_dir: str | Path, placement, frozen: bool, kept: torch.device | None = None):
    """streaming.load from the checkpoint, or at random init under QWEN_EDIT_RANDOM_INIT=1, said so with where the
    model is `kept` (default: the placement's device)."""
    from train.model import streaming

    if random_init():
        _random_init_notice("transformer", kept or placement.device)
    return streaming.load(model_dir, placement, frozen=frozen, random=random_init())


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
        with _random_init_scope("VAE", dtype):
            vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(Path(model_dir) / "vae"))
    else:
        vae = AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae", torch_dtype=dtype,
                                                     local_files_only=True)
    if vae_2d_frames:
        vae_frames.apply(vae)
    return vae.requires_grad_(False).eval().to(device)


def load_transformer(model_cfg: ModelConfig, dtype: torch.dtype):
    from diffusers import QwenImageTransformer2DModel

    if random_init():
        with _random_init_scope("transformer", dtype):
            config = QwenImageTransformer2DModel.load_config(Path(model_cfg.path) / "transformer")
            return QwenImageTransformer2DModel.from_config(config)
    return QwenImageTransformer2DModel.from_pretrained(
        model_cfg.path, subfolder="transformer", torch_dtype=dtype, local_files_only=True
    )


def add_lora(transformer, lora: LoraConfig, adapter_name: str = "default") -> None:
    """Freeze the transformer and add a peft LoRA adapter on `lora.target_modules` of every block."""
    from peft import LoraConfig as PeftLoraConfig

    names = [n for n, _ in transformer.named_modules()]
    unmatched = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(
            f"qwen_edit.lora.target_modules: {unmatched} match no module of the transformer; names look like "
            "'attn.to_q', 'img_mlp.net.0.proj' (suffixes of transformer_blocks.N.*)"
        )
    transformer.requires_grad_(False)
    transformer.add_adapter(
        PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=list(lora.target_modules)),
        adapter_name=adapter_name,
    )


def prepare_for_training(transformer, mode: str, lora: LoraConfig, gradient_checkpointing: bool,
                         compile_blocks: bool, fp8_base: bool = False, checkpoint_blocks: int = 0,
                         fp8_transposed: bool = False, real_rope: bool = True,
                         quantized: dict | None = None, offload: set[int] | None = None,
                         compile_mode: str | None = None, share=None, kept_attention_blocks: int = 0,
                         fp8_fast_accum: bool = False):
    """LoRA on a frozen base (optionally stored in fp8) or every weight trainable; then block offloading,
    activation checkpointing and compiled blocks. real_rope: rotary embedding as real pairs (rope.py; the
    same rotation, which compiled blocks fuse). quantized: fp8 weights already made by the streaming loader.
    offload: indices of blocks whose frozen weights live in pinned host memory (train/model/offload.py); they must be
    among the checkpointed ones. compile_mode: torch.compile's mode for the blocks (None: its default).
    share: the node's shared host copy of the offloaded blocks (offload.NodeShare), or None for this process's own.
    kept_attention_blocks: how many of the checkpointed blocks (the first ones) keep their attention output for the
    recomputation (train/model/kept_attention.py); -1 = all of them. fp8_fast_accum: the fp8 matmuls accumulate
    fast (train.fp8_fast_accum).
    Returns the BlockOffloader, or None."""
    offload = offload or set()
    if mode == "lora":
        add_lora(transformer, lora)
        if fp8_base:
            check_fp8_device()
            # Offloaded blocks keep no transposed copy: it would double what crosses the bus every use.
            fp8.convert_frozen_linears(transformer, lambda name: fp8_transposed and _block_of(name) not in offload,
                                       quantized, fp8_fast_accum)
    else:
        transformer.requires_grad_(True)
    offloader = None
    if offload:
        from train.model.offload import BlockOffloader

        blocks = transformer.transformer_blocks
        offloader = BlockOffloader({i: blocks[i] for i in sorted(offload)}, _device_of(transformer), share=share)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing(checkpoint_first(transformer.transformer_blocks, checkpoint_blocks,
                                                                   kept_attention_blocks))
    if real_rope:
        rope.use_real_pairs(transformer)
    if compile_blocks:
        for block in transformer.transformer_blocks:
            # in place, so the DeepSpeed engine wraps the same modules; the blocks share one graph
            block.compile(**({"mode": compile_mode} if compile_mode else {}))
    return offloader


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "transformer_blocks" else None


def _device_of(module: torch.nn.Module) -> torch.device:
    """The training device: where the non-block weights are (they are never offloaded)."""
    return module.proj_out.weight.device


def load_for_training(model_dir: str | Path, dtype: torch.dtype, device: torch.device, mode: str,
                      lora: LoraConfig, gradient_checkpointing: bool, compile_blocks: bool, fp8_base: bool = False,
                      checkpoint_blocks: int = 0, fp8_transposed: bool = False, offload_blocks: int = 0,
                      share=None, kept_attention_blocks: int = 0, fp8_fast_accum: bool = False):
    """(transformer, offloader or None) streamed from `model_dir` straight into its training form
    (train/model/streaming.py: fp8 weights quantised one by one on the device, offloaded blocks' weights kept on the
    host), then prepared as prepare_for_training does. The first `offload_blocks` blocks are offloaded. share: the
    node's shared host copy of them (memory.offload_share), or None; a process that is not its writer does not read
    the offloaded weights."""
    from train.model import streaming

    placement = streaming.Placement(device, dtype, fp8=fp8_base and mode == "lora", offload=set(range(offload_blocks)),
                                    skip_offloaded=share is not None and not share.writer)
    if fp8_base:
        check_fp8_device()
    transformer, quantized = streamed_transformer(model_dir, placement, frozen=mode == "lora")
    offloader = prepare_for_training(transformer, mode, lora, gradient_checkpointing, compile_blocks, fp8_base,
                                     checkpoint_blocks, fp8_transposed, quantized=quantized,
                                     offload=placement.offload, share=share,
                                     kept_attention_blocks=kept_attention_blocks, fp8_fast_accum=fp8_fast_accum)
    return transformer, offloader


def checkpoint_first(blocks, count: int, kept: int = 0):
    """diffusers' gradient_checkpointing_func that recomputes the first `count` blocks (0 = all) and runs the
    others plainly (diffusers hands every block to this function while checkpointing is on). The first `kept` of
    the recomputed blocks (-1 = all) keep their attention output, so their recomputation skips the attention kernel
    (train/model/kept_attention.py: their attention processors are marked for it)."""
    from torch.utils.checkpoint import checkpoint

    selected = list(blocks) if count == 0 else list(blocks)[:count]
    keeping = selected if kept < 0 else selected[:kept]
    for block in keeping:
        kept_attention.keep(block)
    keeping, selected = {id(b) for b in keeping}, {id(b) for b in selected}

    def call(block, *args):
        if id(block) in keeping:
            return checkpoint(kept_attention.Stash().run, block.__call__, *args, use_reentrant=False)
        if id(block) in selected:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    return call


def check_fp8_device() -> None:
    """fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer on CUDA; CPUs run them (slowly)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ValueError(f"qwen_edit.train.fp8_base: {name} has no fp8 matmuls (needs compute capability >= 8.9); "
                         "set fp8_base to false")


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
