"""What the benchmarks (train/benchmarks/) build of Qwen-Image-2.1: the released transformer's config at any depth,
the tests' tiny transformer, the pipeline's scheduler settings, a synthetic micro-batch of a benchmark workload, the
attention processor train/benchmarks/attention21.py times and the kernel calls attention_kernels.py times."""

from __future__ import annotations

import functools

import torch

from train.model.qwen_image21 import attention, batches, tiny
from train.model.qwen_image21.archs import TRANSFORMER

SCHEDULER = tiny.SCHEDULER_CONFIG  # the pipeline's dynamic shift
attention_processor = attention.SegmentedSDPAProcessor


def kernel_calls(segments, length: int) -> list[tuple[int, int, int, int, bool]]:
    """The segmented op's fused-kernel calls over `length` tokens whose prefix runs are diffusers' `segments`."""
    return attention.kernel_calls(attention.flat_bounds(segments), length)


# A benchmark workload's micro-batch: its text tokens are the joint sequence's text positions, the image slots of
# the references come on top of them in the prompt embeddings.
synthetic_batch = functools.partial(batches.synthetic_batch, text_positions=True)


def released_config(variant: str, num_layers: int | None = None) -> dict:
    """The released transformer's config (archs.py), `num_layers` deep (None: the released 32); one variant."""
    return {**TRANSFORMER, "num_layers": num_layers or TRANSFORMER["num_layers"]}


def tiny_transformer(variant: str) -> torch.nn.Module:
    """The tests' tiny transformer (train.make_tiny --variant qwen_image_21's)."""
    return tiny.build_transformer()


def min_text_tokens(refs: int) -> int:
    """Fewest text positions a workload with `refs` references can have: batches.synthetic_batch puts two text
    tokens before each reference's slots and keeps two more (the template's, around the prompt)."""
    return 2 * refs + 2
