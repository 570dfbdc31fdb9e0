"""A QwenImageTransformer2DModel cut at block boundaries: each decoder stage runs a range of its blocks.

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


def embed(t, hidden_states, encoder_hidden_states, timestep) -> Activations:
    """The first stage's input embeddings, as in QwenImageTransformer2DModel.forward."""
    hidden_states = t.img_in(hidden_states)
    timestep = timestep.to(hidden_states.dtype)
    if t.zero_cond_t:
        timestep = torch.cat([timestep, timestep * 0], dim=0)
    encoder_hidden_states = t.txt_in(t.txt_norm(encoder_hidden_states))
    temb = t.time_text_embed(timestep, hidden_states, None)
    return hidden_states, encoder_hidden_states, temb


def run_blocks(t, blocks: tuple[int, int], x: Activations, encoder_hidden_states_mask, img_shapes) -> Activations:
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


def head(t, hidden_states, temb) -> torch.Tensor:
    if t.zero_cond_t:
        temb = temb.chunk(2, dim=0)[0]
    return t.proj_out(t.norm_out(hidden_states, temb))


class DecoderStage(torch.nn.Module):
    """One decoder stage: called like the transformer (the kwargs of loop.noisy_inputs).

    The first stage computes from those kwargs and returns its Activations. Later stages take their input from
    `inbox` (set by their source just before the call: the previous stage's Activations, leaves that require
    grad) and ignore hidden_states / timestep / encoder_hidden_states; the last returns (prediction,).
    """

    def __init__(self, transformer, blocks: tuple[int, int], is_first: bool, is_last: bool):
        super().__init__()
        prune(transformer, blocks, is_first, is_last)
        # parameters named transformer.X, the whole model's names under a prefix that the export strips
        # (train.runtime.exports.STAGE_PREFIX)
        self.transformer, self.blocks, self.is_first, self.is_last = transformer, blocks, is_first, is_last
        self.inbox: Activations | None = None

    def forward(self, hidden_states=None, encoder_hidden_states=None, encoder_hidden_states_mask=None, timestep=None,
                img_shapes=None, return_dict=False):
        t = self.transformer
        if self.is_first:
            x = embed(t, hidden_states, encoder_hidden_states, timestep)
        else:
            x, self.inbox = self.inbox, None
        x = run_blocks(t, self.blocks, x, encoder_hidden_states_mask, img_shapes)
        if self.is_last:
            return (head(t, x[0], x[2]),)
        return x
