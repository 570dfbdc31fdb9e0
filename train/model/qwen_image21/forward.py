"""Qwen-Image-2.1's transformer forward for training, with the joint sequence's metadata made once per slot layout.

diffusers' `QwenImage21Transformer2DModel.forward` derives everything about the joint sequence from `img_mask` on the
device at every call: the slots' four-fold expansion (`repeat_interleave` with tensor repeats), the latents'
scatter (boolean indexing), the rotary positions (`tolist()` and tensors built from Python lists), the image ids,
the target mask, the prefix length and the attention's runs. Each of these synchronises the host with the device,
about 16 times per training step, and the device idles while the host works between them. All of it depends only on
the slot layout (row 0 of `img_mask`, which every row shares, and `img_shapes`) and the device, so `use_layout_cache`
gives the transformer a forward that reads row 0 of `img_mask` once, builds the rest with diffusers' own functions
the first time it meets a layout, and keeps it (a few MB per layout, at most `LAYOUTS` of them).

The forward is diffusers' computation otherwise, call for call (the same modules, in the same order, with the same
arguments): the joint sequence is gathered from the prompt embeddings and the latents by one index instead of
expanded and overwritten, which gives the same values. Calls it does not cover (the prefix KV cache of sampling,
`attention_kwargs`, `return_dict=True`) go to diffusers' forward unchanged.
"""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch
from diffusers.models.transformers import transformer_qwenimage21 as T

from train.model.qwen_image21.conditioning import TOKENS_PER_SLOT

LAYOUTS = 16  # slot layouts kept per transformer (the sampler's buckets; the least recently used goes first)


@dataclass(frozen=True)
class Layout:
    """One slot layout's metadata on one device (diffusers' names)."""

    gather: torch.Tensor  # (L,) long: each joint position's row in cat([prompt embeddings, latents])
    text_positions: torch.Tensor  # (Lt,) long: the joint sequence's text positions
    prompt_text_positions: torch.Tensor  # (Lt,) long: the same tokens' positions in the prompt sequence
    rotary_emb: torch.Tensor | tuple  # what pos_embed returns (with the project's real pairs, if installed)
    image_ids: torch.Tensor  # (L,) long
    target_token_mask: torch.Tensor  # (L,) bool
    prefix_len: int
    segments: list  # the prefix's (start, end, is_text) runs


def layout(transformer, img_mask_row: torch.Tensor, img_shapes: list, device: torch.device) -> Layout:
    """The metadata of the layout `img_mask_row` (a host tensor) and `img_shapes` (one row's), made with diffusers'
    functions on `device`."""
    slots = img_mask_row.bool()
    repeats = torch.where(slots, TOKENS_PER_SLOT, 1)
    image_pad_mask = torch.repeat_interleave(slots, repeats)  # joint positions that hold a latent
    num_prompt = slots.numel() - math.prod(img_shapes[-1]) // TOKENS_PER_SLOT  # img_mask ends with the target's slots
    source = torch.repeat_interleave(torch.arange(slots.numel()), repeats)  # the prompt position of each joint one
    gather = source.clone()
    gather[image_pad_mask] = num_prompt + torch.arange(int(image_pad_mask.sum()))
    text = (~image_pad_mask).nonzero(as_tuple=True)[0]
    mask = image_pad_mask.to(device)
    image_ids, target_token_mask = transformer.build_token_metadata(mask, img_shapes)
    prefix_len = int((~target_token_mask).sum())
    return Layout(
        gather=gather.to(device),
        text_positions=text.to(device),
        prompt_text_positions=source[text].to(device),
        rotary_emb=transformer.pos_embed(img_shapes, mask, device=device),
        image_ids=image_ids,
        target_token_mask=target_token_mask,
        prefix_len=prefix_len,
        segments=T._qwenimage21_prefix_segments(image_ids, prefix_len),
    )


def use_layout_cache(transformer) -> None:
    """Give `transformer` (a QwenImage21Transformer2DModel) the training forward above (idempotent)."""
    if getattr(transformer, "_qwen_edit_layouts", None) is not None:
        return
    transformer._qwen_edit_layouts = OrderedDict()
    transformer.forward = types.MethodType(_forward, transformer)


def _cached(transformer, img_mask: torch.Tensor, img_shapes: list, device: torch.device) -> Layout:
    row = img_mask[0].cpu()  # the one synchronisation: every row shares row 0's layout
    key = (bytes(row.numpy()), tuple(map(tuple, img_shapes)), str(device))
    layouts = transformer._qwen_edit_layouts
    if key in layouts:
        layouts.move_to_end(key)
        return layouts[key]
    made = layouts[key] = layout(transformer, row, img_shapes, device)
    if len(layouts) > LAYOUTS:
        layouts.popitem(last=False)
    return made


def _forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
             encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None, kv_cache_mode=None,
             return_dict=True):
    if kv_cache is not None or kv_cache_mode is not None or attention_kwargs is not None or return_dict:
        return type(self).forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                                  encoder_hidden_states_mask, attention_kwargs, kv_cache, kv_cache_mode, return_dict)
    batch_size = hidden_states.shape[0]
    meta = _cached(self, img_mask, img_shapes[0], hidden_states.device)
    hidden_states = self.img_in(hidden_states)
    encoder_hidden_states = self.txt_in(encoder_hidden_states)
    joint_hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1).index_select(1, meta.gather)

    timestep = timestep.to(hidden_states.dtype)
    if self.config.causal_condition:  # the t = 0 row that text and reference tokens modulate from
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = meta.target_token_mask
    else:
        modulation_mask = None
    temb = self.time_text_embed(timestep, hidden_states)
    modulation = self.modulation(temb)

    key_valid = None
    if encoder_hidden_states_mask is not None:
        key_valid = torch.ones(batch_size, meta.gather.numel(), dtype=torch.bool, device=hidden_states.device)
        key_valid[:, meta.text_positions] = encoder_hidden_states_mask.bool().index_select(1,
                                                                                           meta.prompt_text_positions)
    processors = [block.attn.processor for block in self.transformer_blocks]
    flex = [isinstance(processor, T.QwenImage21FlexAttnProcessor) for processor in processors]
    attention_mask = (T.build_qwenimage21_block_causal_mask(meta.image_ids, key_valid, batch_size,
                                                            hidden_states.device) if any(flex) else None)
    segments = None if all(flex) else meta.segments

    for block in self.transformer_blocks:
        args = (joint_hidden_states, modulation, meta.rotary_emb, attention_mask, modulation_mask, None, None, None,
                segments, key_valid)
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            joint_hidden_states = self._gradient_checkpointing_func(block, *args)
        else:
            joint_hidden_states = block(*args)

    joint_hidden_states = self.norm_out(joint_hidden_states, temb, modulation_mask)
    return (self.proj_out(joint_hidden_states),)
