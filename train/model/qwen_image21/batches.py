"""A Qwen-Image-2.1 micro-batch behind the family interface (train/model/interface.py): the conditioning of a batch
of rows encoded as the pipeline encodes it (conditioning.py), its per-sample parts, and the transformer's inputs and
the target's prediction (sequence.py).

Shape legend: B batch, T prompt tokens (image slots included), D text width, L target tokens, Lr reference tokens,
C latent channels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from train.model.interface import Batch, Encoders
from train.model.qwen_image21 import conditioning, sequence


@dataclass
class BatchConditioning(conditioning.Conditioning):
    """conditioning.Conditioning as the generic code reads it (the interface's Conditioning protocol)."""

    @property
    def num_text_tokens(self) -> int:
        return self.prompt_embeds.shape[1]

    @property
    def num_reference_tokens(self) -> int:
        return self.reference_tokens.shape[1]

    def samples(self) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """Per sample ({prompt_tokens, reference_shapes}, {"embeds": T D, "slots": T, "ref": Lr C}), the prompt
        without its right padding."""
        batch, length = self.prompt_embeds.shape[:2]
        lengths = [length] * batch if self.prompt_mask is None else self.prompt_mask.sum(dim=1).tolist()
        shapes = [list(s) for s in self.reference_shapes]
        return [
            (
                {"prompt_tokens": int(n), "reference_shapes": shapes},
                {
                    "embeds": self.prompt_embeds[i, :n],
                    "slots": self.image_slots[i, :n],
                    "ref": self.reference_tokens[i],
                },
            )
            for i, n in enumerate(lengths)
        ]

    def select(self, index: torch.Tensor) -> BatchConditioning:
        mask = None if self.prompt_mask is None else self.prompt_mask[index]
        return BatchConditioning(
            self.prompt_embeds[index],
            mask,
            self.image_slots[index],
            self.reference_tokens[index],
            self.reference_shapes,
        )

    def _map(self, fn) -> BatchConditioning:
        mask = None if self.prompt_mask is None else fn(self.prompt_mask)
        return BatchConditioning(
            fn(self.prompt_embeds), mask, fn(self.image_slots), fn(self.reference_tokens), self.reference_shapes
        )

    def to(self, device: torch.device) -> BatchConditioning:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> BatchConditioning:
        return self._map(torch.Tensor.pin_memory)


def join_conditioning(parts: list[tuple[dict, dict[str, torch.Tensor]]]) -> BatchConditioning:
    """The inverse of BatchConditioning.samples: prompts right-padded with zeros to the longest (a mask only when
    one is shorter, as encode_prompts gives it), the rows' references stacked (one slot layout)."""
    lengths = [meta["prompt_tokens"] for meta, _ in parts]
    longest = max(lengths)

    def padded(name: str) -> torch.Tensor:
        rows = [t[name] for _, t in parts]
        return torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], *r.shape[1:])]) for r in rows])

    mask = None
    if min(lengths) < longest:
        mask = torch.stack([torch.arange(longest) < n for n in lengths]).long().to(parts[0][1]["embeds"].device)
    shapes = [tuple(s) for s in parts[0][0]["reference_shapes"]]
    refs = torch.stack([t["ref"] for _, t in parts])
    return BatchConditioning(padded("embeds"), mask, padded("slots"), refs, shapes)


def encode_batch(batch: dict, encoders: Encoders, variant: str) -> Batch:
    """The frozen encoders on collated rows of one slot layout: "prompts", per row its references' VL copies
    ("vl_images"), per reference slot its pixels (B, 4, H, W) ("reference_pixels"), the target's pixels ("target");
    conditioning.prepare_image makes each image's pair."""
    embeds, mask, slots = conditioning.encode_prompts(
        encoders.text_encoder, encoders.processor, batch["prompts"], batch["vl_images"]
    )
    target = conditioning.encode_latents(encoders.vae, batch["target"])
    refs, shapes = conditioning.encode_references(encoders.vae, batch["reference_pixels"], len(batch["prompts"]))
    cond = BatchConditioning(embeds, mask, slots, refs, shapes)
    target_hw = tuple(target.shape[-2:])
    sequence.check_layout(cond, target_hw)
    return Batch(conditioning.pack(target).float(), target_hw, cond)


def transformer_inputs(b: Batch, noisy_BLC: torch.Tensor, sigmas_B: torch.Tensor, dtype: torch.dtype) -> dict:
    """QwenImage21Transformer2DModel's keyword arguments: the references, then the noisy target; the timestep is
    the noise level itself."""
    return sequence.transformer_inputs(b.cond, noisy_BLC, b.target_hw, sigmas_B, dtype)


def target_prediction(output, b: Batch) -> torch.Tensor:
    """The prediction of the target's tokens: the last L of the joint sequence."""
    return sequence.target_prediction(output[0], b.target_hw)


def cached_bucket_key(target_hw: tuple[int, int], meta: dict) -> tuple[tuple[int, int], ...]:
    """Latent (h, w) of the target, then of each reference, from a cached sample's metadata: its slot layout, as the
    dataset's bucket keys give it."""
    return (tuple(target_hw), *((s[1], s[2]) for s in meta["reference_shapes"]))


def fingerprint() -> str:
    """What the cached prompt embeddings depend on besides the model files: the templates and image slots."""
    return json.dumps([conditioning.T2I_TEMPLATE, conditioning.prompt_text("{}", 1), conditioning.IMAGE_SLOT])


# Prompt embeddings besides the image slots, bounded: the template after the dropped system turn (8 tokens) and a
# prompt of up to ~300 tokens; each reference adds its "<imageK><|vision_start|>...<|vision_end|>" tokens (< 12).
TEXT_BOUND, REFERENCE_TEXT_BOUND = 320, 12


def text_tokens_bound(variant: str, num_references: int, area: int, condition_area: int) -> int:
    """Prompt embeddings per sample, bounded, image slots included (one per 32 x 32 px of each reference at `area`;
    10% over for the rounding of the sides to multiples of 32)."""
    slots = int(1.1 * area) // (conditioning.SIZE_MULTIPLE**2)
    return TEXT_BOUND + num_references * (slots + REFERENCE_TEXT_BOUND)


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
    text_positions: bool = False,
) -> Batch:
    """A Batch of random tensors shaped as encode_batch returns them (conditioning in `cond_dtype`): a target of
    latent size `latent_hw`, references of the latent sizes `reference_hws` (each side rounded down to the 2x2
    groups an image slot covers), `text_tokens` prompt embeddings holding their slots (more when the slots need
    them; with `text_positions`, `text_tokens` besides the slots), a mask of ones when `text_mask`."""
    g = torch.Generator(device).manual_seed(seed)
    channels, width = model.config.in_channels, model.config.context_in_dim
    h, w = (max(2, side // 2 * 2) for side in latent_hw)
    shapes = [(1, max(2, rh // 2 * 2), max(2, rw // 2 * 2)) for rh, rw in reference_hws]
    slot_runs = [rh * rw // conditioning.TOKENS_PER_SLOT for _, rh, rw in shapes]
    length = max(text_tokens + (sum(slot_runs) if text_positions else 0), sum(slot_runs) + 2 * len(slot_runs) + 2)
    slots = torch.zeros(length, dtype=torch.bool, device=device)
    start = 2
    for run in slot_runs:  # two text tokens before each reference's slots, as its "<imageK>..." tokens
        slots[start : start + run] = True
        start += run + 2
    x0 = torch.randn(batch_size, h * w, channels, generator=g, device=device)
    refs = torch.randn(batch_size, sum(rh * rw for _, rh, rw in shapes), channels, generator=g, device=device)
    embeds = torch.randn(batch_size, length, width, generator=g, device=device).to(cond_dtype)
    mask = torch.ones(batch_size, length, dtype=torch.long, device=device) if text_mask else None
    cond = BatchConditioning(embeds, mask, slots.expand(batch_size, -1).clone(), refs.to(cond_dtype), shapes)
    return Batch(x0, (h, w), cond)
