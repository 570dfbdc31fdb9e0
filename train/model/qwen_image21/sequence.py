"""The joint sequence of Qwen-Image-2.1 for training: the transformer's inputs for a noisy target with clean
references, the target's prediction, and a row's slot layout.

The transformer takes the references' latents and the target's as one `hidden_states` sequence, references first
and the target last, plus `img_mask`: the prompt's image-pad positions followed by one slot per 2x2 group of target
tokens. It writes the latents into the prompt sequence at those positions (the target after the prompt, padding
included) and returns a prediction for every position of that joint sequence; the target's are the last ones, and
the loss reads only those. With `causal_condition` (the released config) the transformer modulates text and
reference tokens at t = 0 itself; the timestep it takes is the noise level s in [0, 1] (the pipeline passes its
scheduler's t / 1000).

All rows of a micro-batch must share one slot layout (the transformer reads the layout from row 0): the same
number of references with the same latent sizes, and the same target size. Their prompts may differ in length,
since the prompt text follows the last image slot and padding is on the right.

Shape legend: B batch, L tokens, C latent channels, T prompt tokens.
"""

from __future__ import annotations

import torch
from PIL import Image

from train.model.qwen_image21.conditioning import (
    DEFAULT_AREA,
    PIXELS_PER_TOKEN,
    TOKENS_PER_SLOT,
    Conditioning,
    dimensions,
)

Layout = tuple[tuple[int, int], ...]  # latent (h, w) of each reference, then of the target


def layout_key(
    references: list[Image.Image | tuple[int, int]], target: Image.Image | tuple[int, int], area: int = DEFAULT_AREA
) -> Layout:
    """A row's slot layout from its images or their (width, height): rows with equal keys can share a micro-batch
    (the sampler buckets by it). The latent grids the pipeline's sizing gives, references in order, target last."""

    def grid(image) -> tuple[int, int]:
        width, height = dimensions(image.size if isinstance(image, Image.Image) else image, area)
        return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN

    return (*(grid(im) for im in references), grid(target))


def img_shapes(
    reference_shapes: list[tuple[int, int, int]], target_hw: tuple[int, int], batch_size: int
) -> list[list[tuple[int, int, int]]]:
    """The pipeline's img_shapes: per row, each reference's (1, h, w), then the target's."""
    return [[*reference_shapes, (1, *target_hw)]] * batch_size


def img_mask(image_slots_BT: torch.Tensor, target_hw: tuple[int, int]) -> torch.Tensor:
    """The prompt's image slots followed by the target's: one per 2x2 group of target tokens."""
    num_target_slots = target_hw[0] * target_hw[1] // TOKENS_PER_SLOT
    return torch.cat([image_slots_BT, image_slots_BT.new_ones(image_slots_BT.shape[0], num_target_slots)], dim=1)


def transformer_inputs(
    cond: Conditioning,
    noisy_target_BLC: torch.Tensor,
    target_hw: tuple[int, int],
    timestep_B: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> dict:
    """Keyword arguments of one transformer call: clean references then the noisy target (x_t, packed), at noise
    level `timestep_B` (= s, in [0, 1]); `dtype` (default: the target's) for the floating-point inputs."""
    dtype = dtype or noisy_target_BLC.dtype
    hidden = torch.cat([cond.reference_tokens.to(noisy_target_BLC.dtype), noisy_target_BLC], dim=1)
    return dict(
        hidden_states=hidden.to(dtype),
        timestep=timestep_B.to(dtype),
        encoder_hidden_states=cond.prompt_embeds.to(dtype),
        encoder_hidden_states_mask=cond.prompt_mask,
        img_shapes=img_shapes(cond.reference_shapes, target_hw, noisy_target_BLC.shape[0]),
        img_mask=img_mask(cond.image_slots, target_hw),
        return_dict=False,
    )


def target_prediction(output_BLC: torch.Tensor, target_hw: tuple[int, int]) -> torch.Tensor:
    """The target tokens' prediction out of the transformer's output for the whole joint sequence (text and
    reference positions carry no loss)."""
    return output_BLC[:, -target_hw[0] * target_hw[1] :]


def check_layout(cond: Conditioning, target_hw: tuple[int, int]) -> None:
    """Every row's image slots at the same positions (rows of one slot layout): the transformer reads row 0's."""
    slots = cond.image_slots
    assert bool((slots == slots[:1]).all()), "rows of different slot layouts in one micro-batch"
    assert int(slots[0].sum()) * TOKENS_PER_SLOT == cond.reference_tokens.shape[1], "slots and references disagree"
    assert target_hw[0] % 2 == 0 and target_hw[1] % 2 == 0, f"target grid {target_hw} is not made of 2x2 groups"
