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


@dataclass(frozen=True)
class ModelFamily:
    """One architecture behind the seam; every callable is a plain function of the family's folder."""

    name: str
    title: str  # the family's name in messages
    variants: tuple[Variant, ...]
    transformer_class: str  # the diffusers transformer, as transformer/config.json names it (`_class_name`)
    pixels_per_latent: int  # the VAE's spatial factor
    lora: LoraKeys
    # the model directory
    detect_variant: Callable[[Any, str], str]  # (model_dir, configured variant or "auto") -> variant; ModelError
    load_encoders: Callable[..., Encoders]  # (model_dir, dtype, device, stream_text_encoder, vae_2d_frames)
    load_vae: Callable[..., torch.nn.Module]  # (model_dir, dtype, device, vae_2d_frames)
    random_pipeline_models: Callable[..., dict]  # QWEN_EDIT_RANDOM_INIT: (model_dir, dtype, device, ...) -> modules
    prompt_tokenizer: Callable[[Any], object]  # model_dir -> what prompt_overflow counts with (None: no limit)
    # rows -> the transformer's inputs
    image_size: Callable[[int, int, int, int], tuple[int, int]]  # (area, width, height, aspect_steps) -> (w, h)
    condition_size: Callable[..., tuple[int, int] | None]  # a reference's VL copy (see the family), None: none
    prompt_overflow: Callable[..., tuple[int, int] | None]  # (length, room) of a prompt too long for its images
    sample_images: Callable[..., dict]  # a row's opened images -> the tensors and images encode_batch reads
    encode_batch: Callable[[dict, Encoders, str], Batch]  # (collated samples, encoders, variant), no gradients
    join_conditioning: Callable[[list[tuple[dict, dict]]], Conditioning]  # inverse of Conditioning.samples
    cached_bucket_key: Callable[[tuple[int, int], dict], tuple]  # a cached sample's shape bucket (latent sizes)
    conditioning_fingerprint: Callable[[], str]  # what a cache must be rebuilt for when it changes (templates...)
    # the transformer
    transformer_inputs: Callable[..., dict]  # (batch, noisy target B L C, sigmas B, dtype) -> forward kwargs
    target_prediction: Callable[[Any, Batch], torch.Tensor]  # the forward's output -> B L C, the target's tokens
    real_rope: Callable[[torch.nn.Module], None] | None  # rotary embedding that compiled blocks fuse, if any
    cut: Any  # model-parallel stages (prune, embed, run_blocks, head, later_inputs), None: not supported
    # sampling with the diffusers pipelines
    load_pipeline: Callable[..., Any]  # (model_dir, dtype, variant, models, vae_2d_frames)
    pipeline_from_components: Callable[..., Any]  # (model_dir, variant, transformer, encoders)
    sample: Callable[..., Any]  # (pipe, variant, images, prompt, seed, inference) -> PIL image
    sampling_pipeline: Callable[[Any, bool], Any]  # (pipe, has references) -> the pipeline that samples it
    encoder_calls: tuple[str, ...]  # the pipelines' methods that run the frozen encoders (recorded, replayed)
    # tiny checkpoints and sizes
    make_tiny: Callable[..., Any]  # (out, variant, num_samples, size, seed, ...) -> out with model/ and data/
    make_dataset: Callable[..., list]  # (out, variant, num_samples, size, seed) -> the images of a tiny dataset
    synthetic_batch: Callable[..., Batch]  # random tensors shaped as encode_batch returns them
    text_tokens_bound: Callable[[str, int, int, int], int]  # (variant, references, area, condition_area)
    bench: Any  # what the benchmarks build (released sizes, random-init encoders, timed encoding parts)
    block_list: str = "transformer_blocks"  # the transformer's attribute holding its blocks

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def blocks(self, transformer: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer's blocks, in order: what checkpointing, offload, fp8 and model-parallel cuts act on."""
        return getattr(transformer, self.block_list)
