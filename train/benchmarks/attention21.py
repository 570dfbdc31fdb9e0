"""Qwen-Image-2.1's attention processors timed on one attention layer of the released width (4096, 32 heads of 128):

    diffusers   diffusers' QwenImage21AttnProcessor: one SDPA call per prefix run, text runs with a dense mask
    segmented   train/model/qwen_image21/attention.py: mask-free fused-kernel calls in one custom op
    flex        diffusers' QwenImage21FlexAttnProcessor: one flex_attention call with a BlockMask (CUDA only)

Forward and backward of the layer (projections included, as in training) on a micro-batch of one layout: the text
runs around the references' image slots as the pipeline lays them out, references of `--reference` latent grids,
the target last. On CUDA every layer is compiled, as the trainer compiles its blocks; the record names the fused
kernel torch's SDPA picks for the layer's queries. A module of the probe protocol of train/bench.py (parse_args, run,
format_report).
"""

from __future__ import annotations

import argparse
import time

import torch

KINDS = ("diffusers", "segmented", "flex")
# Prompt tokens around the slots (after the dropped system turn): "<|im_start|>user\n<image1><|vision_start|>" before
# the first reference, "<|vision_end|> <imageK><|vision_start|>" between two, the prompt and the assistant turn last.
TEXT_BEFORE, TEXT_BETWEEN = 10, 8


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="attention21", description=__doc__.split("\n\n")[0])
    p.add_argument("--references", type=int, default=1, help="references of the target's size (0: text-to-image)")
    p.add_argument(
        "--target", default="64x64", help="latent grid HxW of the target and of each reference (1 MP: 64x64)"
    )
    p.add_argument("--prompt_tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=10, help="timed forward+backward steps, after two warm-up steps")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def layout(num_references: int, target_hw: tuple[int, int], prompt_tokens: int):
    """(image_pad_mask (S,) bool over the joint sequence, img_shapes) of one slot layout."""
    tokens = target_hw[0] * target_hw[1]
    runs = [False] * TEXT_BEFORE
    for k in range(num_references):
        runs += [True] * tokens + [False] * (TEXT_BETWEEN if k < num_references - 1 else 0)
    runs += [False] * prompt_tokens + [True] * tokens
    return torch.tensor(runs), [(1, *target_hw)] * (num_references + 1)


def layer_inputs(kind: str, image_pad_mask, img_shapes, batch: int, width: int, dtype, device) -> dict:
    """Keyword arguments of one QwenImage21Attention call as the transformer's prefill passes them to `kind`."""
    from diffusers.models.transformers import transformer_qwenimage21 as T

    image_pad_mask = image_pad_mask.to(device)
    image_ids, target_mask = T.QwenImage21Transformer2DModel.build_token_metadata(image_pad_mask, img_shapes)
    prefix_len = int((~target_mask).sum())
    kwargs = {"hidden_states": torch.randn(batch, len(image_pad_mask), width, device=device, dtype=dtype)}
    if kind == "flex":
        kwargs["attention_mask"] = T.build_qwenimage21_block_causal_mask(image_ids, None, batch, device)
    else:
        kwargs["segments"] = T._qwenimage21_prefix_segments(image_ids, prefix_len)
    return kwargs


def build_layer(kind: str, width: int, heads: int, dtype, device):
    """One attention layer with `kind`'s processor, compiled on CUDA (an uncompiled flex one is a dense fp32 matrix)."""
    from diffusers.models.transformers import transformer_qwenimage21 as T

    from train.model import family

    processor = {
        "diffusers": T.QwenImage21AttnProcessor,
        "segmented": family.family_named("qwen_image21").bench.attention_processor,
        "flex": T.QwenImage21FlexAttnProcessor,
    }[kind]()
    layer = T.QwenImage21Attention(width, heads, width // heads, processor=processor).to(device, dtype)
    return torch.compile(layer) if device.type == "cuda" else layer


def time_kind(kind: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds per forward+backward of the layer, the mean of `args.steps` after two warm-up steps."""
    target_hw = tuple(int(x) for x in args.target.split("x"))
    mask, shapes = layout(args.references, target_hw, args.prompt_tokens)
    layer = build_layer(kind, args.width, args.heads, dtype, device)
    kwargs = layer_inputs(kind, mask, shapes, args.batch, args.width, dtype, device)
    kwargs["hidden_states"].requires_grad_(True)
    for step in range(args.steps + 2):
        if step == 2:
            _sync(device)
            start = time.perf_counter()
        layer(**kwargs).float().square().mean().backward()
    _sync(device)
    return (time.perf_counter() - start) / max(1, args.steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"--kinds: {unknown} are not among {', '.join(KINDS)}")
    if device.type != "cuda" and "flex" in kinds:  # flex_attention has no backward on the CPU
        print("attention21: flex skipped (flex_attention has no backward on the CPU)", flush=True)
        kinds.remove("flex")
    seconds = {kind: time_kind(kind, args, device, dtype) for kind in kinds}
    head_dim = args.width // args.heads
    query = torch.empty(args.batch, args.heads, 64, head_dim, device=device, dtype=dtype)
    return {
        "kernel": torch.nn.attention.SDPBackend(torch._fused_sdp_choice(query, query, query)).name,
        "probe": "attention21",
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "references": args.references,
        "target": args.target,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "width": args.width,
        "heads": args.heads,
        "seconds": seconds,
    }


def format_report(record: dict) -> str:
    lines = [
        f"attention21: {record['references']} reference(s) and a target of {record['target']} latents, "
        f"{record['prompt_tokens']} prompt tokens, batch {record['batch']}, width {record['width']}, "
        f"{record['dtype']} on {record['device']} (SDPA picks {record['kernel']}); forward+backward of one layer:"
    ]
    fastest = min(record["seconds"].values())
    for kind, seconds in record["seconds"].items():
        lines.append(f"  {kind:10s} {seconds * 1e3:9.2f} ms  ({seconds / fastest:.2f}x the fastest)")
    return "\n".join(lines)
