"""What train.bench measures: the model family, the seed and learning rate of both loops, and the shapes of one
micro-batch (a square target, references of the same size, text tokens)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from train.model import family

SEED = 42
LR = 1e-4
FAMILY = family.family_named("qwen_image")  # the architecture measured here, and by the peer (DiffSynth's QwenImageDiT)


@dataclass(frozen=True)
class Workload:
    """Shapes of one micro-batch: square target and references of the same size, plus text tokens."""

    width: int
    height: int
    refs: int
    text_tokens: int
    micro_batch: int

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // FAMILY.pixels_per_latent, self.width // FAMILY.pixels_per_latent

    @property
    def target_tokens(self) -> int:
        h, w = self.latent_hw
        return (h // 2) * (w // 2)

    @property
    def reference_tokens(self) -> int:
        return self.refs * self.target_tokens

    @property
    def image_tokens(self) -> int:
        return self.target_tokens + self.reference_tokens

    @property
    def tokens_per_sample(self) -> int:
        return self.image_tokens + self.text_tokens


def make_workload(area: int, refs: int, text_tokens: int, micro_batch: int) -> Workload:
    """Square images of about `area` pixels, sized (multiples of 32) as the edit pipelines size them."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    width, height = calculate_dimensions(area, 1.0)
    return Workload(int(width), int(height), refs, text_tokens, micro_batch)


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
