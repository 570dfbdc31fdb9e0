"""The fused-kernel calls of Qwen-Image-2.1's segmented attention, timed with each attention kernel at the step's
shapes (the command `python -m train.bench --attention_kernel_probe`):

    sdpa   what the segmented op runs now: the fused kernel torch's SDPA picks (cuDNN on Hopper; the flash kernel
           on the CPU)
    fa4    FlashAttention-4 (`flash-attn-4` on PyPI, CuTe DSL kernels; Hopper and newer, train/model/flash4.py)

each chosen by train/model/kept_attention.py's use_kernel and run through its fused_forward / fused_backward, as
the op runs them.

One layer's calls (train/model/qwen_image21/attention.py `kernel_calls`, through the family's bench record) for a
slot layout laid out as the pipeline lays it out (train/benchmarks/attention21.py `layout`), q, k and v with the
strides the op gives the kernels. Each kernel's forward of every call and backward of every call are timed apart
(the host's clock between device synchronisations, the mean of --steps rounds after two warm-up rounds) and counted
in FLOPs over the allowed query-key pairs only (4 per pair and head dimension forward, 2.5x that backward). Its
agreement is checked on the layer's largest call against a float32 computation: the output's and the gradients'
largest error, and the log-sum-exp's (natural log, as the op merges calls by it).
`--dense TOKENS` times one non-causal call over TOKENS tokens instead: the joint attention of the Qwen-Image MMDiT
(2509, 2511, v1; one call per block, no mask), e.g. `--dense 8448 --heads 24` for a 1 MP target, one 1 MP reference
and 256 text tokens. A kernel that cannot run here (fa4 without a Hopper GPU or without the package) is reported as
not available, with why. A module of the probe protocol of train/bench.py (parse_args, run, format_report).
"""

from __future__ import annotations

import argparse
import math

import torch

from train.benchmarks.timing import synced_now

KERNELS = ("sdpa", "fa4")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="attention_kernel_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--references", type=int, default=1, help="references of the target's size (0: text-to-image)")
    p.add_argument("--target", default="64x64", help="latent grid HxW of the target and of each reference (1 MP)")
    p.add_argument("--prompt_tokens", type=int, default=246,
                   help="prompt tokens after the slots (default 246: with the 10 before them, 256 text tokens)")
    p.add_argument("--dense", type=int, default=0,
                   help="instead of 2.1's calls, one non-causal call over this many tokens (the MMDiT's attention)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    p.add_argument("--steps", type=int, default=10, help="timed rounds of every call, after two warm-up rounds")
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def layer_calls(references: int, target_hw: tuple[int, int], prompt_tokens: int) -> tuple[list, int]:
    """(the layer's kernel calls as (query start, query end, key start, key end, causal), sequence length)."""
    from diffusers.models.transformers import transformer_qwenimage21 as T

    from train.benchmarks.attention21 import layout
    from train.model import family

    mask, shapes = layout(references, target_hw, prompt_tokens)
    image_ids, target_mask = T.QwenImage21Transformer2DModel.build_token_metadata(mask, shapes)
    prefix_len = int((~target_mask).sum())
    segments = T._qwenimage21_prefix_segments(image_ids, prefix_len)
    return family.family_named("qwen_image21").bench.kernel_calls(segments, len(mask)), len(mask)


def pairs(call: tuple) -> int:
    """The query-key pairs a call computes (a causal call's are its lower triangle, diagonal included)."""
    q0, q1, k0, k1, causal = call
    n = q1 - q0
    return n * (n + 1) // 2 if causal else n * (k1 - k0)


def _inputs(call: tuple, heads: int, head_dim: int, device, dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of a call: (1, H, T, D) views of contiguous (1, T, H, D) tensors, as the op hands them over."""
    q0, q1, k0, k1, _ = call
    g = torch.Generator(device).manual_seed(seed)

    def make(length: int) -> torch.Tensor:
        return torch.randn(1, length, heads, head_dim, generator=g, device=device, dtype=dtype).transpose(1, 2)

    return make(q1 - q0), make(k1 - k0), make(k1 - k0), make(q1 - q0)


def _errors(call: tuple, heads: int, head_dim: int, device, dtype) -> dict:
    """Largest absolute errors of one call of the chosen kernel against float32 math on the same (rounded) inputs."""
    from train.model.kept_attention import fused_backward, fused_forward

    q, k, v, dout = _inputs(call, heads, head_dim, device, dtype, seed=7)
    causal = call[4]
    out, lse = fused_forward(q, k, v, None, causal)
    dq, dk, dv = fused_backward(dout, q, k, v, out, lse, None, causal)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    scores = ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(head_dim)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref_out = torch.softmax(scores, dim=-1) @ ref[2]
    grads = torch.autograd.grad(ref_out, ref, dout.float())
    return {
        "out": (out.float() - ref_out).abs().max().item(),
        "lse": (lse.float().reshape(ref_lse.shape) - ref_lse).abs().max().item(),
        "grad": max((g.float() - r).abs().max().item() for g, r in zip((dq, dk, dv), grads, strict=True)),
    }


def time_kernel(calls: list, args: argparse.Namespace, device, dtype) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one layer's calls on the chosen kernel: the mean of args.steps rounds."""
    from train.model.kept_attention import fused_backward, fused_forward

    inputs = [_inputs(call, args.heads, args.head_dim, device, dtype, seed=i) for i, call in enumerate(calls)]
    fwd = bwd = 0.0
    for step in range(args.steps + 2):
        t0 = synced_now(device)
        saved = [fused_forward(q, k, v, None, call[4]) for (q, k, v, _), call in zip(inputs, calls, strict=True)]
        t1 = synced_now(device)
        for (q, k, v, dout), call, (out, lse) in zip(inputs, calls, saved, strict=True):
            fused_backward(dout, q, k, v, out, lse, None, call[4])
        t2 = synced_now(device)
        if step >= 2:
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return fwd / max(1, args.steps), bwd / max(1, args.steps)


def run(args: argparse.Namespace) -> dict:
    from train.model import kept_attention

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise SystemExit(f"--kernels: {unknown} are not among {', '.join(KERNELS)}")
    if args.dense > 0:
        calls, length = [(0, args.dense, 0, args.dense, False)], args.dense
    else:
        calls, length = layer_calls(args.references, tuple(int(x) for x in args.target.split("x")), args.prompt_tokens)
    flops = 4 * sum(pairs(c) for c in calls) * args.heads * args.head_dim
    largest = max(calls, key=pairs)
    results, unavailable = {}, {}
    kept_attention.detect_cuda()
    for kernel in kernels:
        try:
            kept_attention.use_kernel(kernel, device)  # what the op then runs, as train.bench --attention_kernel
        except RuntimeError as e:
            unavailable[kernel] = str(e)
            continue
        try:
            fwd, bwd = time_kernel(calls, args, device, dtype)
            errors = _errors(largest, args.heads, args.head_dim, device, dtype)
        finally:
            kept_attention.use_kernel("sdpa", device)
        results[kernel] = {
            "forward_s": fwd,
            "backward_s": bwd,
            "forward_tflops": flops / fwd / 1e12,
            "backward_tflops": 2.5 * flops / bwd / 1e12,
            "max_abs_error": errors,
        }
    return {
        "probe": "attention_kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "references": None if args.dense else args.references,
        "target": None if args.dense else args.target,
        "tokens": length,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "calls": [list(c) for c in calls],
        "forward_flops": flops,
        "kernels": results,
        "not_available": unavailable,
    }


def format_report(record: dict) -> str:
    what = ("one dense call (the MMDiT's attention)" if record["references"] is None else
            f"Qwen-Image-2.1's segmented attention, {record['references']} reference(s) of {record['target']} latents")
    lines = [
        f"attention kernels: {what}, {record['tokens']} tokens, {record['heads']} heads of {record['head_dim']}, "
        f"{record['dtype']} on {record['device']}; one layer's {len(record['calls'])} calls, "
        f"{record['forward_flops'] / 1e12:.3f} TFLOP forward:"
    ]
    results = record["kernels"]
    fastest = min((r["forward_s"] + r["backward_s"] for r in results.values()), default=0.0)
    for kernel, r in results.items():
        total = r["forward_s"] + r["backward_s"]
        e = r["max_abs_error"]
        lines.append(
            f"  {kernel:5s} forward {r['forward_s'] * 1e3:8.3f} ms ({r['forward_tflops']:6.1f} TFLOP/s), backward "
            f"{r['backward_s'] * 1e3:8.3f} ms ({r['backward_tflops']:6.1f} TFLOP/s), {total / fastest:.2f}x the "
            f"fastest; largest call's max error: out {e['out']:.2e}, lse {e['lse']:.2e}, gradients {e['grad']:.2e}"
        )
    for kernel, why in record["not_available"].items():
        lines.append(f"  {kernel:5s} not available: {why}")
    return "\n".join(lines)
