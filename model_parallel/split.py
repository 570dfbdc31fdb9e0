"""A transformer cut at block boundaries: each decoder stage runs a range of its blocks.

What a stage computes is the model family's (its `cut`: pruning the parts a stage does not run, the first stage's
input embeddings, a range of blocks, the last stage's output projection); what crosses a cut is the family's tuple
of activations, which all carry gradients back.
"""

from __future__ import annotations

import torch

from train.model import family


class DecoderStage(torch.nn.Module):
    """One decoder stage: called like the transformer (the keyword arguments of the family's transformer_inputs).

    The first stage computes from those and returns its activations. Later stages take their input from `inbox`
    (set by their source just before the call: the previous stage's activations, leaves that require grad) and
    need only what the family's `later_inputs` gives; the last returns the transformer's output, (prediction,).
    """

    def __init__(self, transformer, blocks: tuple[int, int], is_first: bool, is_last: bool, cut=None):
        super().__init__()
        cut = cut or family.transformer_family(transformer).cut
        if cut is None:
            raise ValueError(
                f"{type(transformer).__name__} cannot be cut over decoder stages yet; set "
                "qwen_edit.parallel.decoder_cuts to []"
            )
        cut.prune(transformer, blocks, is_first, is_last)
        # parameters named transformer.X, the whole model's names under a prefix that the export strips
        # (train.runtime.exports.STAGE_PREFIX)
        self.transformer, self.blocks, self.is_first, self.is_last = transformer, blocks, is_first, is_last
        self.cut = cut
        self.inbox: tuple[torch.Tensor, ...] | None = None

    def forward(self, **inputs):
        t = self.transformer
        if self.is_first:
            x = self.cut.embed(t, **inputs)
        else:
            x, self.inbox = self.inbox, None
        x = self.cut.run_blocks(t, self.blocks, x, **inputs)
        return self.cut.head(t, x) if self.is_last else x
