"""The tokenizer of every family's tiny checkpoint: a byte-level BPE in the Qwen2 format, trained here on a small
corpus (nothing is downloaded), with the special tokens the Qwen VL chat templates use."""

from __future__ import annotations

import json

# Qwen2 special tokens the pipelines' templates use; they must be single tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def build_tokenizer(corpus: list[str]):
    """A byte-level BPE in the Qwen2 format, trained on `corpus`, with the Qwen2 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bars, drawn by Rust on the terminal, leave blank lines in a log
    )
    bpe.train_from_iterator(corpus, trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def special_token_ids(tokenizer) -> dict[str, int]:
    """{special token: its id}, for the VL configs that name them."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def vl_config_ids(tokenizer) -> dict[str, int]:
    """The token ids a Qwen VL model's config names (image, video, vision start and end), from `tokenizer`."""
    ids = special_token_ids(tokenizer)
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
