"""A Qwen-Image-2.1 micro-batch behind the family interface (train/model/interface.py): the conditioning of a batch
of rows encoded as the pipeline encodes it (conditioning.py), its per-sample parts, and the transformer's inputs and
the target's prediction (sequence.py).

Shape legend: B batch, T prompt tokens (image slots included), D text width, L target tokens, Lr reference tokens,
C latent channels.
"""

from __future__ import annotations

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
