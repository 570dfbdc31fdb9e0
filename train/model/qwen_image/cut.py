"""A QwenImageTransformer2DModel cut at block boundaries for the model-parallel mode: each decoder stage
(model_parallel/split.py) runs a range of its blocks with these functions.

The first stage runs the input embeddings (img_in, txt_norm + txt_in, the timestep embedding) and its blocks;
the last runs its blocks and norm_out + proj_out. What crosses a cut is the image stream, the text stream and
the timestep embedding (all three carry gradients back); the rotary embedding, the normalised text mask and
2511's modulate_index are recomputed on each stage from img_shapes and the mask (cheap, parameter-free).
The block calls mirror diffusers' forward exactly: keyword arguments normally, positional ones under gradient
checkpointing (`_gradient_checkpointing_func` takes them positionally).
"""

from __future__ import annotations

from math import prod

import torch
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from train.model.interface import Batch
from train.model.qwen_image import conditioning

Activations = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # image stream B L D, text stream B T D, temb B D


def prune(transformer, blocks: tuple[int, int], is_first: bool, is_last: bool) -> None:
    """Drop what this stage does not run (parameter names keep the full model's, for checkpoints and exports)."""
    first, end = blocks
    for i in range(len(transformer.transformer_blocks)):
        if not first <= i < end:
            transformer.transformer_blocks[i] = torch.nn.Identity()
    if not is_first:
        transformer.img_in = transformer.txt_norm = transformer.txt_in = transformer.time_text_embed = None
    if not is_last:
        transformer.norm_out = transformer.proj_out = None


def embed(t, hidden_states, encoder_hidden_states, timestep, **_) -> Activations:
    """The first stage's input embeddings, as in QwenImageTransformer2DModel.forward (from the keyword arguments of
    batches.transformer_inputs)."""
    hidden_states = t.img_in(hidden_states)
    timestep = timestep.to(hidden_states.dtype)
    if t.zero_cond_t:
        timestep = torch.cat([timestep, timestep * 0], dim=0)
    encoder_hidden_states = t.txt_in(t.txt_norm(encoder_hidden_states))
    temb = t.time_text_embed(timestep, hidden_states, None)
    return hidden_states, encoder_hidden_states, temb


def run_blocks(t, blocks: tuple[int, int], x: Activations, encoder_hidden_states_mask, img_shapes,
               **_) -> Activations:
    """Blocks [first, end) on (image stream, text stream, temb)."""
    hidden_states, encoder_hidden_states, temb = x
    text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder_hidden_states, encoder_hidden_states_mask)
    rotary = t.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden_states.device)
    modulate_index = None
    if t.zero_cond_t:
        modulate_index = torch.tensor(
            [[0] * prod(s[0]) + [1] * sum(prod(r) for r in s[1:]) for s in img_shapes], device=temb.device,
            dtype=torch.int,
        )
    for i in range(*blocks):
        block = t.transformer_blocks[i]
        if torch.is_grad_enabled() and t.gradient_checkpointing:
            encoder_hidden_states, hidden_states = t._gradient_checkpointing_func(
                block, hidden_states, encoder_hidden_states, mask, temb, rotary, None, modulate_index)
        else:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rotary, joint_attention_kwargs=None,
                modulate_index=modulate_index)
    return hidden_states, encoder_hidden_states, temb


def head(t, x: Activations) -> tuple[torch.Tensor]:
    """The last stage's output projection: (prediction,), as the whole transformer returns it."""
    hidden_states, _, temb = x
    if t.zero_cond_t:
        temb = temb.chunk(2, dim=0)[0]
    return (t.proj_out(t.norm_out(hidden_states, temb)),)


def later_inputs(b: Batch) -> dict:
    """What a stage after the first takes from the micro-batch (its activations come from the previous stage)."""
    return {"encoder_hidden_states_mask": b.cond.prompt_mask,
            "img_shapes": conditioning.img_shapes(b.target_hw, b.cond.reference_shapes, b.x0.shape[0])}
