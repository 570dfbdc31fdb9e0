"""What train.bench measures: the model family (`--variant`), the seed and learning rate of both loops, and the shapes
of one micro-batch (a square target, references of the same size, text tokens), counted in the family's tokens: the
latent grid at its pixels per latent, patch x patch latents per token (Qwen-Image: 16x16 px a token; Qwen-Image-2.1:
16x16 px a latent, unpatched, so the same count)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from train.model import family
from train.model.interface import ModelFamily

SEED = 42
LR = 1e-4
VARIANTS = ("edit", "qwen_image_21")  # --variant: the Qwen-Image MMDiT (2511 with --zero_cond_t), or Qwen-Image-2.1
FAMILY = family.family_named("qwen_image")  # the default architecture, and the probes' (blocks, inputs, floor)


def bench_family(variant: str) -> ModelFamily:
    """The family whose transformer `--variant` measures."""
    return family.variant_family(variant)


@dataclass(frozen=True)
class Workload:
    """Shapes of one micro-batch: square target and references of the same size, plus text tokens (the transformer's
    text positions; Qwen-Image-2.1's prompt embeddings hold the references' image slots besides)."""

    width: int
    height: int
    refs: int
    text_tokens: int
    micro_batch: int
    family: ModelFamily = FAMILY

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // self.family.pixels_per_latent, self.width // self.family.pixels_per_latent

    @property
    def target_tokens(self) -> int:
        h, w = self.latent_hw
        p = self.family.patch_size
        return (h // p) * (w // p)

    @property
    def reference_tokens(self) -> int:
        return self.refs * self.target_tokens

    @property
    def image_tokens(self) -> int:
        return self.target_tokens + self.reference_tokens

    @property
    def tokens_per_sample(self) -> int:
        return self.image_tokens + self.text_tokens


def make_workload(area: int, refs: int, text_tokens: int, micro_batch: int, family: ModelFamily = FAMILY) -> Workload:
    """Square images of about `area` pixels, sized (multiples of 32) as the edit pipelines size them (Qwen-Image-2.1's
    pipeline rounds to the same multiples of 32)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    width, height = calculate_dimensions(area, 1.0)
    return Workload(int(width), int(height), refs, text_tokens, micro_batch, family)


@contextlib.contextmanager
def explained_oom(w: Workload) -> Iterator[None]:
    """A timed loop that runs out of GPU memory at workload `w` ends with what to lower, not a bare CUDA error."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(
            f"CUDA out of memory at {w.width}x{w.height} px + {w.refs} reference(s), micro-batch {w.micro_batch}; "
            "try --checkpointing full, a smaller --area or --micro_batch, or --num_layers N"
        ) from e
