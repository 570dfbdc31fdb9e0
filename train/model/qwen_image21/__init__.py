"""Qwen-Image-2.1 (diffusers' QwenImage21Pipeline): a single-stream transformer over one joint sequence of Qwen3-VL
text embeddings with the references' latents in the encoder's image slots and the target's latents last.

    family.py        the family's record for the generic trainer (what is wired so far)
    variant.py       is a model directory 2.1, and does the installed diffusers build it as released
    conditioning.py  prompts, images (RGB or RGBA) and latents, exactly as the pipeline encodes them
    sequence.py      the joint sequence: the transformer's inputs, the target's prediction, a row's slot layout
    batches.py       a micro-batch behind the family interface: encoded rows, per-sample parts, transformer inputs
    attention.py     the block-causal attention as mask-free SDPA calls (an attention processor)
    forward.py       the transformer's training forward, its joint-sequence metadata made once per slot layout
    lora_keys.py     LoRA targets and the export keys (diffusers; ComfyUI's fused gate_up)
    tiny.py          a tiny random checkpoint in the released layout, built in code
"""
