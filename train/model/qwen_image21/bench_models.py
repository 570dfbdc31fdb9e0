"""What the benchmarks (train/benchmarks/) build of Qwen-Image-2.1: the released transformer's config at any depth,
the tests' tiny transformer, the pipeline's scheduler settings, a synthetic micro-batch of a benchmark workload, and
the attention processor train/benchmarks/attention21.py times."""

from __future__ import annotations

import torch

from train.model.interface import Batch
from train.model.qwen_image21 import attention, batches, tiny
from train.model.qwen_image21.archs import TRANSFORMER
from train.model.qwen_image21.conditioning import TOKENS_PER_SLOT

SCHEDULER = tiny.SCHEDULER_CONFIG  # the pipeline's dynamic shift
attention_processor = attention.SegmentedSDPAProcessor


def released_config(variant: str, num_layers: int | None = None) -> dict:
    """The released transformer's config (archs.py), `num_layers` deep (None: the released 32); one variant."""
    return {**TRANSFORMER, "num_layers": num_layers or TRANSFORMER["num_layers"]}


def tiny_transformer(variant: str) -> torch.nn.Module:
    """The tests' tiny transformer (train.make_tiny --variant qwen_image_21's)."""
    return tiny.build_transformer()


def synthetic_batch(
    model: torch.nn.Module,
    batch_size: int,
    latent_hw: tuple[int, int],
    reference_hws: list[tuple[int, int]],
    text_tokens: int,
    device: torch.device,
    cond_dtype: torch.dtype,
    text_mask: bool = False,
    seed: int = 0,
) -> Batch:
    """The family's synthetic batch (batches.synthetic_batch) for a benchmark workload: `text_tokens` counts the
    joint sequence's text positions, so the prompt embeddings hold those plus one image slot per 2x2 group of each
    reference's latents (the slots become the references' tokens). Latent sides must be even."""
    slots = sum(h * w for h, w in reference_hws) // TOKENS_PER_SLOT
    return batches.synthetic_batch(
        model, batch_size, latent_hw, reference_hws, text_tokens + slots, device, cond_dtype, text_mask, seed
    )


def min_text_tokens(refs: int) -> int:
    """Fewest text positions a workload with `refs` references can have: batches.synthetic_batch puts two text
    tokens before each reference's slots and keeps two more (the template's, around the prompt)."""
    return 2 * refs + 2
