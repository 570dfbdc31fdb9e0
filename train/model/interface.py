"""What a model family gives the generic trainer, and the types both sides share.

A family (train/model/<family>/) is one architecture with its encoders, VAE, conditioning and pipelines. It
registers one `ModelFamily` in train/model/family.py; the loop, the cache, the data, offload, fp8, the streaming
loader, exports, validation, inference and the model-parallel mode reach it only through that record, so a second
family is one folder and one registration line. The record holds what the generic code calls and nothing more:
how to read a model directory, turn rows into the transformer's inputs, run the transformer on a batch and keep the
target tokens' prediction, name its blocks and LoRA keys, sample with its diffusers pipelines, and build a tiny
checkpoint.

Shape legend: B batch, L target tokens, C token channels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# what a family's make_tiny built, in OUT/model ({"variant", ...}; train/trainer/pretrain.py adds "pretrained"); the
# pipelines ignore it
TINY_INFO = "tiny.json"


class ModelError(ValueError):
    """The model directory does not fit the configuration or the installed diffusers; the message says why."""


@dataclass(frozen=True)
class Variant:
    """One model of a family, as qwen_edit.model.variant names it."""

    name: str  # the config's value, unique over every family
    title: str  # the released model(s), for the logs
    pipeline_class: str  # the diffusers pipeline that samples it
    max_references: int  # reference images per row (0: text-to-image only)
    text_to_image: bool = False  # rows without a reference are this model's own task (data.rows_without_reference)


@dataclass
class Encoders:
    """The frozen conditioning models; they stay outside the DeepSpeed engine."""

    text_encoder: torch.nn.Module | None
    processor: object  # the VL processor, or the tokenizer alone for a model that ships none
    vae: torch.nn.Module


class Conditioning(Protocol):
    """Everything but the noisy target that a family's transformer takes for one micro-batch, as the generic code
    reads it: token counts for the logs, and per-sample parts for the cache and for the model-parallel links."""

    @property
    def num_text_tokens(self) -> int: ...

    @property
    def num_reference_tokens(self) -> int: ...

    def samples(self) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """Per sample (JSON-able metadata, unpadded tensors); the family's `join_conditioning` inverts it."""
        ...

    def to(self, device: torch.device) -> Conditioning: ...

    def select(self, index: torch.Tensor) -> Conditioning:
        """The conditioning of the samples at `index`, padded as in this batch."""
        ...

    def pin_memory(self) -> Conditioning:
        """Its tensors in pinned host memory (a DataLoader with pin_memory calls it on the cache's batches)."""
        ...


@dataclass
class Batch:
    """A micro-batch as the transformer takes it (all on the training device)."""

    x0: torch.Tensor  # B L C packed clean target latents, float32
    target_hw: tuple[int, int]  # latent height, width of the target
    cond: Conditioning


@dataclass(frozen=True)
class LoraKeys:
    """A family's LoRA names: the default targets and the key layouts its exports are written in."""

    targets: tuple[str, ...]  # module-name suffixes inside a block that get LoRA by default
    pipeline_class: str  # the diffusers pipeline whose lora_state_dict reads and save_lora_weights writes its files
    comfyui: Callable[[dict[str, torch.Tensor], float, int], dict[str, torch.Tensor]]  # (layers, alpha, rank)
    # a LoRA file's tensors as the pipeline's load_lora_weights must get them, when its converter misses a layout
    # (Qwen-Image-2.1: ComfyUI's fused gate_up, which it would drop); None: the file as it is
    reads: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None


@dataclass(frozen=True)
class Fp8Linears:
    """The linears inside a block that train.fp8_base stores in float8 e4m3 (train/model/fp8.py), by the name
    suffix within the block."""

    token: tuple[str, ...]  # one row per token: fp8 matmuls in the forward and the input gradient
    vector: tuple[str, ...] = ()  # one row per sample (modulation): weight-only, dequantised per call


@dataclass(frozen=True)
class SwiGLU:
    """A block's SwiGLU MLP, out(silu(gate(x)) * up(x)), by its names (train/model/swiglu.py fuses its input side)."""

    module: str  # the MLP's name within the block
    gate: str  # the MLP's attributes: the gate and up linears, the output linear, the SiLU
    up: str
    out: str
    activation: str


@dataclass(frozen=True)
class ModelFamily:
    """One architecture behind the seam; every callable is a plain function of the family's folder.

    A part that is None is one the family does not provide yet: train/model/support.py names the settings and
    commands that need it and refuses them at start-up with the fix, before anything loads."""

    name: str
    title: str  # the family's name in messages
    variants: tuple[Variant, ...]
    transformer_class: str  # the diffusers transformer, as transformer/config.json names it (`_class_name`)
    pixels_per_latent: int  # the VAE's spatial factor
    patch_size: int  # latent pixels per token side: the transformer packs patch x patch latents into one token
    lora: LoraKeys
    # the model directory
    detect_variant: Callable[[Any, str], str]  # (model_dir, configured variant or "auto") -> variant; ModelError
    # the transformer
    transformer_inputs: Callable[..., dict]  # (batch, noisy target B L C, sigmas B, dtype) -> forward kwargs
    target_prediction: Callable[[Any, Batch], torch.Tensor]  # the forward's output -> B L C, the target's tokens
    rgba: bool = False  # the VAE reads RGBA: images keep their transparency (images.to_rgba; else composited), and
    # renders open references as RGBA
    fp8_linears: Fp8Linears | None = None  # what train.fp8_base converts
    swiglu: SwiGLU | None = None  # its blocks' SwiGLU MLP, which the bench's --fused_swiglu fuses
    attention_module: str | None = None  # the diffusers module whose dispatch_attention_fn kept attention routes
    real_rope: Callable[[torch.nn.Module], None] | None = None  # rotary embedding that compiled blocks fuse, if any
    set_attention: Callable[[torch.nn.Module, str, bool], Any] | None = None  # (transformer, train.attention, compiled
    # on CUDA): the attention processor it trains with; None: its transformer's own
    training_forward: Callable[[torch.nn.Module], None] | None = None  # gives the transformer the forward it trains
    # with (the same computation as its own); None: its own
    cut: Any = None  # model-parallel stages (prune, embed, run_blocks, head, later_inputs)
    block_list: str = "transformer_blocks"  # the transformer's attribute holding its blocks
    unreached: tuple[str, ...] = ()  # modules of the last block whose output the transformer drops: their
    # trainable weights get no gradient (prepare.freeze_unreached)
    # loading the encoders
    load_encoders: Callable[..., Encoders] | None = None  # (model_dir, dtype, device, stream_text_encoder, 2d)
    load_vae: Callable[..., torch.nn.Module] | None = None  # (model_dir, dtype, device, vae_2d_frames)
    random_pipeline_models: Callable[..., dict] | None = None  # QWEN_EDIT_RANDOM_INIT: (model_dir, dtype, device, ...)
    prompt_tokenizer: Callable[[Any], object] | None = None  # model_dir -> what prompt_overflow counts with
    # rows -> the transformer's inputs
    image_size: Callable[[int, int, int, int], tuple[int, int]] | None = None  # (area, w, h, aspect_steps) -> (w, h)
    condition_size: Callable[..., tuple[int, int] | None] | None = None  # a reference's VL copy, None: none
    prompt_overflow: Callable[..., tuple[int, int] | None] | None = None  # (length, room) of a prompt too long
    # (prompt_tokenizer's, [(w, h) of the target, then each reference], area, aspect steps) -> [(image index, why and
    # the fix)]: images of a row the family's pipeline would refuse at these sizes (None: none it would)
    image_problems: Callable[..., list[tuple[int, str]]] | None = None
    sample_images: Callable[..., dict] | None = None  # a row's opened images -> what encode_batch reads
    encode_batch: Callable[[dict, Encoders, str], Batch] | None = None  # (collated samples, encoders, variant)
    join_conditioning: Callable[[list[tuple[dict, dict]]], Conditioning] | None = None  # Conditioning.samples^-1
    cached_bucket_key: Callable[[tuple[int, int], dict], tuple] | None = None  # a cached sample's shape bucket
    conditioning_fingerprint: Callable[[], str] | None = None  # what a cache must be rebuilt for (templates...)
    # sampling with the diffusers pipelines
    load_pipeline: Callable[..., Any] | None = None  # (model_dir, dtype, variant, models, vae_2d_frames)
    pipeline_from_components: Callable[..., Any] | None = None  # (model_dir, variant, transformer, encoders)
    sample: Callable[..., Any] | None = None  # (pipe, variant, images, prompt, seed, inference) -> PIL image
    sampling_pipeline: Callable[[Any, bool], Any] | None = None  # (pipe, has references) -> what samples it
    encoder_calls: tuple[str, ...] = ()  # the pipelines' methods that run the frozen encoders (recorded, replayed)
    # tiny checkpoints and sizes
    make_tiny: Callable[..., Any] | None = None  # (out, variant, num_samples, size, seed, ...) -> out (model/, data/)
    make_dataset: Callable[..., list] | None = None  # (out, variant, num_samples, size, seed) -> its images
    synthetic_batch: Callable[..., Batch] | None = None  # random tensors shaped as encode_batch returns them
    text_tokens_bound: Callable[[str, int, int, int], int] | None = None  # (variant, references, area, cond. area)
    bench: Any = None  # what the benchmarks build (released sizes, random-init encoders, timed encoding parts)

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def blocks(self, transformer: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer's blocks, in order: what checkpointing, offload, fp8 and model-parallel cuts act on."""
        return getattr(transformer, self.block_list)

    def block_index(self, name: str) -> int | None:
        """The block a parameter or module of the transformer (its full name) belongs to, None outside the blocks."""
        parts = name.split(".")
        return int(parts[1]) if len(parts) > 1 and parts[0] == self.block_list else None

    def fp8_kind(self, name: str) -> str | None:
        """The kind, "token" or "vector", of a linear of the transformer (its full name) that train.fp8_base
        converts; None for every other module."""
        if self.fp8_linears is None or self.block_index(name) is None:
            return None
        if name.endswith(self.fp8_linears.token):
            return "token"
        return "vector" if self.fp8_linears.vector and name.endswith(self.fp8_linears.vector) else None
