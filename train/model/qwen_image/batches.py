"""A Qwen-Image micro-batch as its transformer takes it: the conditioning of a batch of rows, the transformer's
inputs for a noisy target with the clean references after it, the prediction of the target's tokens, and the
per-sample parts that the latent cache stores and the model-parallel links carry.

Shape legend: B batch, T text tokens, D text width, L packed target tokens, Lr packed reference tokens, C = 4 x the
latent channels (2x2 patches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.model.interface import Batch, Encoders
from train.model.qwen_image import conditioning


@dataclass
class Conditioning:
    """Everything but the noisy target that the transformer takes for one micro-batch."""

    prompt_embeds: torch.Tensor  # B T D
    prompt_mask: torch.Tensor | None  # B T, None when nothing is padded
    reference_tokens: torch.Tensor  # B Lr C: packed references, one after the other
    reference_shapes: list[tuple[int, int, int]]  # (1, h/2, w/2) per reference

    @property
    def num_text_tokens(self) -> int:
        return self.prompt_embeds.shape[1]

    @property
    def num_reference_tokens(self) -> int:
        return self.reference_tokens.shape[1]

    def samples(self) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """Per sample ({prompt_tokens, reference_shapes}, {"embeds": T D unpadded, "ref": Lr C})."""
        lengths = (
            [self.prompt_embeds.shape[1]] * self.prompt_embeds.shape[0]
            if self.prompt_mask is None
            else self.prompt_mask.sum(dim=1).tolist()
        )
        shapes = [list(s) for s in self.reference_shapes]
        return [
            (
                {"prompt_tokens": int(n), "reference_shapes": shapes},
                {"embeds": self.prompt_embeds[i, :n], "ref": self.reference_tokens[i]},
            )
            for i, n in enumerate(lengths)
        ]

    def select(self, index: torch.Tensor) -> Conditioning:
        mask = None if self.prompt_mask is None else self.prompt_mask[index]
        return Conditioning(self.prompt_embeds[index], mask, self.reference_tokens[index], self.reference_shapes)

    def _map(self, fn) -> Conditioning:
        return Conditioning(
            fn(self.prompt_embeds),
            None if self.prompt_mask is None else fn(self.prompt_mask),
            fn(self.reference_tokens),
            list(self.reference_shapes),
        )

    def to(self, device: torch.device) -> Conditioning:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Conditioning:
        return self._map(torch.Tensor.pin_memory)


def join_conditioning(samples: list[tuple[dict, dict[str, torch.Tensor]]]) -> Conditioning:
    """`Conditioning.samples` of one shape bucket back into a batch: prompts right-padded with a mask as
    encode_prompts pads them (None when all have one length), references stacked."""
    embeds = [tensors["embeds"] for _, tensors in samples]
    lengths = [e.shape[0] for e in embeds]
    longest = max(lengths)
    padded = torch.stack(
        [torch.cat([e, e.new_zeros(longest - n, e.shape[1])]) for e, n in zip(embeds, lengths, strict=True)]
    )
    mask = None if len(set(lengths)) == 1 else torch.stack([torch.arange(longest) < n for n in lengths]).long()
    # tuples again: JSON and pinned memory turn them into lists
    shapes = [tuple(s) for s in samples[0][0]["reference_shapes"]]
    return Conditioning(padded, mask, torch.stack([tensors["ref"] for _, tensors in samples]), shapes)


def cached_bucket_key(target_hw: tuple[int, int], meta: dict) -> tuple[tuple[int, int], ...]:
    """Latent (h, w) of the target, then of each reference, from a cached sample's metadata."""
    return (tuple(target_hw), *((2 * s[1], 2 * s[2]) for s in meta["reference_shapes"]))


def encode_batch(batch: dict, encoders: Encoders, variant: str) -> Batch:
    """Frozen encoders: prompt embeddings, target and reference latents (no gradients)."""
    embeds, mask = conditioning.encode_prompts(
        encoders.text_encoder, encoders.processor, batch["prompts"], batch["vl_images"], variant
    )
    target = conditioning.encode_latents(encoders.vae, batch["target"])
    ref_tokens, ref_shapes = conditioning.encode_references(
        encoders.vae, batch["reference_pixels"], len(batch["prompts"])
    )
    cond = Conditioning(embeds, mask, ref_tokens, ref_shapes)
    return Batch(conditioning.pack(target).float(), tuple(target.shape[-2:]), cond)


def transformer_inputs(b: Batch, noisy_BLC: torch.Tensor, sigmas_B: torch.Tensor, dtype: torch.dtype) -> dict:
    """QwenImageTransformer2DModel's keyword arguments, as the edit pipelines pass them: the noisy target, then
    the clean reference tokens along the sequence; the timestep is sigma itself (scheduler t / 1000)."""
    return dict(
        hidden_states=torch.cat([noisy_BLC, b.cond.reference_tokens.float()], dim=1).to(dtype),
        timestep=sigmas_B.to(dtype),
        encoder_hidden_states=b.cond.prompt_embeds.to(dtype),
        encoder_hidden_states_mask=b.cond.prompt_mask,
        img_shapes=conditioning.img_shapes(b.target_hw, b.cond.reference_shapes, noisy_BLC.shape[0]),
        return_dict=False,
    )


def target_prediction(output, b: Batch) -> torch.Tensor:
    """The prediction of the target's tokens: the first L of the sequence (the references follow them)."""
    return output[0][:, : b.x0.shape[1]]


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
    """A Batch of random tensors shaped as encode_batch returns them (conditioning in `cond_dtype`): a target of
    latent size `latent_hw`, references of the latent sizes `reference_hws`, `text_tokens` prompt embeddings (with
    an all-ones mask when `text_mask`)."""
    g = torch.Generator(device).manual_seed(seed)
    channels, width = model.config.in_channels, model.config.joint_attention_dim
    h, w = latent_hw
    shapes = [(1, rh // 2, rw // 2) for rh, rw in reference_hws]
    x0 = torch.randn(batch_size, (h // 2) * (w // 2), channels, generator=g, device=device)
    num_refs = sum(rh * rw for _, rh, rw in shapes)
    refs = torch.randn(batch_size, num_refs, channels, generator=g, device=device).to(cond_dtype)
    embeds = torch.randn(batch_size, text_tokens, width, generator=g, device=device).to(cond_dtype)
    mask = torch.ones(batch_size, text_tokens, dtype=torch.long, device=device) if text_mask else None
    return Batch(x0, (h, w), Conditioning(embeds, mask, refs, shapes))


def text_tokens_bound(variant: str, num_references: int, area: int, condition_area: int) -> int:
    """Prompt embeddings per sample, bounded: the template and prompt text (at most ~320 tokens after the dropped
    prefix) plus the VL image tokens of each reference (28 x 28 px each; v1 shows the VL its VAE-size copy)."""
    vl_area = area if variant == "edit" else condition_area
    return 320 + num_references * vl_area // (28 * 28)
