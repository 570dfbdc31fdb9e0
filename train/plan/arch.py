"""The model family's hooks of the memory plan: every call of train/plan/ that builds or runs a specific
architecture goes through this module (the transformer on the meta device and its blocks, the linears an fp8 base
converts and LoRA wraps, the small transformer the plan measures and its inputs for a workload, the prompt's token
bound, the validation render's workload, the VAE's encode and decode, the encoders' byte counts). The rest of the
plan works from the block list and the sizes these give. The architecture is reached through the family record
(train/model/interface.py) of the run's model directory, variant or transformer, and the diffusers and transformers
classes its config files name: this module names no family."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from train.config.files import transformer_class
from train.model import family
from train.plan.workload import Workload


def empty_transformer(model_dir: str | Path) -> torch.nn.Module:
    """The transformer of `model_dir` with its parameters on the meta device."""
    from train.model import streaming

    return streaming.empty_transformer(Path(model_dir) / "transformer")


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer's repeated blocks, first to last (what checkpointing and offloading count in)."""
    return family.transformer_family(model).blocks(model)


def fp8_kind_in_block(model: torch.nn.Module, name: str) -> str | None:
    """The kind, "token" or "vector", of a linear of one of `model`'s blocks (its name within the block) that
    train.fp8_base converts; None for the others."""
    fam = family.transformer_family(model)
    return fam.fp8_kind(f"{fam.block_list}.0.{name}")


def lora_linears(model: torch.nn.Module, target_modules: list[str]) -> Iterator[torch.nn.Linear]:
    """The linears LoRA wraps: those whose name is a target or ends with "." + one, as peft matches them."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in target_modules):
            yield module


def _transformer_config(model_dir: Path) -> dict:
    return dict(transformer_class(model_dir / "transformer").load_config(model_dir / "transformer"))


def keeps_attention(model_dir: str | Path) -> bool:
    """Whether the family's checkpointed blocks can keep their attention output (train.kept_attention_blocks)."""
    return family.family_of(model_dir).attention_module is not None


def attention_dims(model_dir: str | Path) -> tuple[int, int]:
    """(heads, head dimension) of the transformer's attention."""
    config = _transformer_config(Path(model_dir))
    return config["num_attention_heads"], config["attention_head_dim"]


def mini_transformer(model_dir: str | Path, num_layers: int, dtype: torch.dtype, device: torch.device):
    """The transformer of `model_dir` at its real width with only `num_layers` blocks, random weights (seed 0) in
    `dtype` on `device`: what the plan measures."""
    cls = transformer_class(Path(model_dir) / "transformer")
    config = _transformer_config(Path(model_dir))
    config["num_layers"] = num_layers
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(saved)


def block_inputs(model, w: Workload, dtype: torch.dtype, device: torch.device) -> dict:
    """Keyword arguments of one forward of `model` (a mini_transformer) at workload `w`, as the family's transformer
    takes a batch (synthetic_batch, transformer_inputs): random latents of the target and its references (laid out
    as one near-square grid of tokens), random prompt embeddings, noise level 0.5."""
    fam = family.transformer_family(model)
    patch = fam.patch_size
    h, wd = w.target_hw
    refs = w.image_tokens - (h // patch) * (wd // patch)
    ref_h = max(1, int(round(math.sqrt(refs)))) if refs else 0
    reference_hws = [(ref_h * patch, refs // ref_h * patch)] if refs else []
    b = fam.synthetic_batch(model, w.batch, w.target_hw, reference_hws, w.text_tokens, device, dtype)
    return fam.transformer_inputs(b, b.x0, torch.full((w.batch,), 0.5, device=device), dtype)


def prepare_for_training(
    model,
    mode: str,
    lora,
    checkpointed: bool,
    compile_blocks: bool,
    fp8_base: bool,
    kept_attention_blocks: int = 0,
    fp8_fast_accum: bool = False,
) -> None:
    """`model` prepared as training prepares the transformer (LoRA or full, checkpointing, fp8, compiled)."""
    from train.model import prepare

    prepare.prepare_for_training(
        model,
        mode,
        lora,
        checkpointed,
        compile_blocks,
        fp8_base,
        kept_attention_blocks=kept_attention_blocks,
        fp8_fast_accum=fp8_fast_accum,
    )


def load_vae(model_dir: str | Path, dtype: torch.dtype, device: torch.device, vae_2d_frames: bool = True):
    """The VAE as training loads it (model.vae_2d_frames: the path its encode and decode take)."""
    return family.family_of(model_dir).load_vae(model_dir, dtype, device, vae_2d_frames)


def encoder_dtype(name: str, device: torch.device) -> torch.dtype:
    """qwen_edit.model.encoder_dtype resolved for `device`."""
    from train.model import loading

    return loading.encoder_dtype(name, device)


def _image_channels(vae) -> int:
    """The VAE's image channels (RGB 3, RGBA 4), as its diffusers config names them."""
    return vae.config.get("input_channels", vae.config.get("in_channels", 3))


def _pixels_per_latent(vae) -> int:
    """The VAE's spatial factor, as the pipelines compute it: 2 per downsampling stage."""
    return 2 ** len(vae.config.temperal_downsample)


def vae_decode(vae, latent_hw: tuple[int, int]) -> Callable[[], torch.Tensor]:
    """A call that decodes one zero latent of `latent_hw` (a render's result)."""
    h, w = latent_hw
    latents = torch.zeros(1, vae.config.z_dim, 1, h, w, device=vae.device, dtype=vae.dtype)
    return lambda: vae.decode(latents, return_dict=False)[0]


def vae_encode(vae, batch: int, latent_hw: tuple[int, int]) -> Callable[[], torch.Tensor]:
    """A call that encodes `batch` zero images whose latents are `latent_hw`."""
    h, w = latent_hw
    size = (h * _pixels_per_latent(vae), w * _pixels_per_latent(vae))
    pixels = torch.zeros(batch, _image_channels(vae), 1, *size, device=vae.device, dtype=vae.dtype)
    return lambda: vae.encode(pixels).latent_dist.mode()


def largest_bucket(
    bucket_keys: list[tuple[tuple[int, int], ...]], micro_batch: int, text_tokens: int, variant: str
) -> Workload:
    """The bucket with the most image tokens (latent (h, w) per image, as the datasets' bucket_keys give them,
    packed as the variant's family packs them)."""
    patch = family.variant_family(variant).patch_size
    key = max(bucket_keys, key=lambda k: sum(h * w for h, w in k))
    tokens = sum((h // patch) * (w // patch) for h, w in key)
    return Workload(micro_batch, tokens, key[0], text_tokens)


def text_tokens_bound(variant: str, num_references: int, area: int, condition_area: int) -> int:
    """Prompt embeddings per sample, bounded (the family's bound for `num_references` at these areas)."""
    return family.variant_family(variant).text_tokens_bound(variant, num_references, area, condition_area)


def render_workload(
    reference_sizes: list[list[tuple[int, int]]], variant: str, area: int, condition_area: int
) -> Workload:
    """The largest validation render in tokens, batch 1 (the pipelines run the guided and the unguided pass one after
    the other): the target, sized from the edit's last reference as the pipelines size it, and every reference at
    `area` (qwen_edit.inference.area), plus the prompt's bound for the most references. `reference_sizes`: per edit
    the (width, height) of its reference images; [] is a text-to-image sample (square)."""
    fam = family.variant_family(variant)
    latent = fam.pixels_per_latent
    pixels_per_token = latent * fam.patch_size
    best = None
    for sizes in reference_sizes or [[]]:
        refs = [fam.image_size(area, w, h, 0) for w, h in sizes]
        target = refs[-1] if refs else fam.image_size(area, 1, 1, 0)
        tokens = sum((w // pixels_per_token) * (h // pixels_per_token) for w, h in [target, *refs])
        if best is None or tokens > best[0]:
            best = (tokens, target)
    most = max((len(sizes) for sizes in reference_sizes), default=0)
    tokens, (width, height) = best
    bound = text_tokens_bound(variant, most, area, condition_area)
    return Workload(1, tokens, (height // latent, width // latent), bound)


def validation_reference_sizes(file: str | Path, seed: int) -> list[list[tuple[int, int]]]:
    """Per edit of a validation file, the (width, height) of its reference images (their headers read)."""
    from train.model import images, renders

    requests, _ = renders.read_requests(file, seed)
    return [[images.shown_size(path) for path in q.references] for q in requests]


def component_bytes(model_dir: str | Path, sub: str, dtype_bytes: int = 2) -> int:
    """Bytes of the component in `model_dir`/`sub` (text_encoder, vae) in a 2-byte dtype, from its safetensors
    headers, or from its config when it has no weights (QWEN_EDIT_RANDOM_INIT directories)."""
    files = sorted((Path(model_dir) / sub).glob("*.safetensors"))
    numel = sum(_numel_in_header(path) for path in files) if files else _numel_from_config(Path(model_dir) / sub)
    return numel * dtype_bytes


def encoder_weight_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Bytes of the text encoder and the VAE in a 2-byte dtype, from their safetensors headers (no weights read)."""
    return sum(component_bytes(model_dir, sub, dtype_bytes) for sub in ("text_encoder", "vae"))


def _numel_in_header(path: Path) -> int:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _numel_from_config(sub: Path) -> int:
    """Parameter count of a component that has only its config (QWEN_EDIT_RANDOM_INIT directories): the VAE's
    diffusers class, the text encoder's transformers VL model, as their configs name them."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if sub.name == "vae":
            model = transformer_class(sub).from_config(transformer_class(sub).load_config(sub))
        else:
            model = _vl_model(sub)
    return sum(t.numel() for t in model.parameters())


def _vl_model(sub: Path) -> torch.nn.Module:
    """The VL text encoder of a config directory (its image-text-to-text class), built where the caller says."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(sub))


def streamed_vl_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """The VL text encoder's bytes on the GPU while its blocks stream from host memory (the families' load_encoders
    with stream_text_encoder): all but the blocks' matrices (embeddings, lm_head, the ViT's patch embedding and
    merger, every vector) plus two device slots per block list, each the size of its largest block's matrices;
    counted from its config on the meta device."""
    with torch.device("meta"):
        model = _vl_model(Path(model_dir) / "text_encoder")
    moved, slots = 0, 0
    for blocks in (model.model.visual.blocks, model.model.language_model.layers):
        sizes = [sum(t.numel() for t in b.parameters() if t.dim() >= 2) for b in blocks]  # offload.moves
        moved, slots = moved + sum(sizes), slots + 2 * max(sizes)
    return (sum(t.numel() for t in model.parameters()) - moved + slots) * dtype_bytes
