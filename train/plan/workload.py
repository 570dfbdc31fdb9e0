"""The micro-batch the plan sizes the run for, in tokens (built by the model family's hooks, train/plan/arch.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """The largest micro-batch of the run, in tokens."""

    batch: int
    image_tokens: int  # target + references, packed latent patches
    target_hw: tuple[int, int]  # latent h, w of the target (the rest of image_tokens are references)
    text_tokens: int
