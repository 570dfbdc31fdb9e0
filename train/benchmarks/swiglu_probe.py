"""The SwiGLU backward with the fp8 copies of its gradients, alone at one block's shapes (the command
`python -m train.bench --swiglu_probe`): what the fused MLP's kernel (train/model/swiglu.py) takes against what
inductor makes of the same math.

    inductor   torch.compile of swiglu.reference_backward: the fusion the compiled step runs without --fused_swiglu
    eager      reference_backward uncompiled (a kernel per operation)
    BxW        the Triton kernel with B columns per loop iteration and W warps, e.g. 2048x8 (the default launch)

Each is timed over --steps calls after three warm-up calls (the host's clock between device synchronisations) on
(--rows, --cols) bf16 inputs, default one Qwen-Image-2.1 block at one reference: 8,448 tokens by 12,288. The
bandwidth is counted on the bytes each call must move once: three bf16 inputs read, two bf16 gradients and two
e4m3 copies written (12 bytes per element). Each is checked against reference_backward: the gradients' and the row
scales' largest relative error and the share of e4m3 values that differ. A module of the probe protocol of
train/bench.py (parse_args, run, format_report).
"""

from __future__ import annotations

import argparse

import torch

from train.benchmarks.timing import synced_now

BYTES_PER_ELEMENT = 3 * 2 + 2 * 2 + 2 * 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="swiglu_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8448, help="tokens (default: a 1 MP target, one reference, 256 text)")
    p.add_argument("--cols", type=int, default=12288, help="the SwiGLU's width (Qwen-Image-2.1: 12,288)")
    p.add_argument("--variants", default="inductor,2048x8,1024x4,4096x16",
                   help="comma-separated: inductor, eager, or a kernel launch BxW (columns per iteration x warps)")
    p.add_argument("--steps", type=int, default=20, help="timed calls of each variant, after three warm-up calls")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    for v in args.variants.split(","):
        if v not in ("inductor", "eager") and not _launch_of(v):
            p.error(f"--variants: {v!r} is none of inductor, eager or BxW (e.g. 2048x8, powers of two)")
    if min(args.rows, args.cols, args.steps) < 1:
        p.error("--rows, --cols and --steps must be >= 1")
    return args


def _launch_of(variant: str) -> tuple[int, int] | None:
    parts = variant.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _function(variant: str, device: torch.device):
    from train.model import swiglu

    if variant == "inductor":
        return torch.compile(swiglu.reference_backward)
    if variant == "eager":
        return swiglu.reference_backward
    if not swiglu.kernel_runs(device):
        return None
    block, warps = _launch_of(variant)
    return lambda *inputs: swiglu.launch(*inputs, block=block, num_warps=warps)


def _errors(got: tuple, want: tuple) -> dict:
    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()

    return {
        "gradients": max(rel(got[0], want[0]), rel(got[1], want[1])),
        "row_scales": max(rel(got[3], want[3]), rel(got[5], want[5])),
        "fp8_differing": max((got[i].float() != want[i].float()).float().mean().item() for i in (2, 4)),
    }


def run(args: argparse.Namespace) -> dict:
    from train.model import swiglu

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device).manual_seed(0)
    inputs = [torch.randn(args.rows, args.cols, generator=gen, device=device, dtype=torch.bfloat16)
              for _ in range(3)]
    inputs += [torch.rand(args.cols, generator=gen, device=device) + 0.5 for _ in range(2)]
    want = swiglu.reference_backward(*inputs)
    results, unavailable = {}, {}
    for variant in args.variants.split(","):
        fn = _function(variant, device)
        if fn is None:
            unavailable[variant] = "the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1)"
            continue
        for _ in range(3):
            got = fn(*inputs)
        t0 = synced_now(device)
        for _ in range(args.steps):
            fn(*inputs)
        seconds = (synced_now(device) - t0) / args.steps
        results[variant] = {"s": seconds, "tb_per_s": BYTES_PER_ELEMENT * args.rows * args.cols / seconds / 1e12,
                            **_errors(got, want)}
    return {
        "probe": "swiglu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rows": args.rows,
        "cols": args.cols,
        "steps": args.steps,
        "variants": results,
        "not_available": unavailable,
    }


def format_report(record: dict) -> str:
    lines = [f"SwiGLU backward with fp8 copies: {record['rows']} x {record['cols']} bf16 on {record['device']}, "
             f"{BYTES_PER_ELEMENT * record['rows'] * record['cols'] / 1e9:.2f} GB moved once per call, "
             f"{record['steps']} calls:"]
    base = record["variants"].get("inductor", {}).get("s")
    for variant, r in record["variants"].items():
        against = f", {base / r['s']:.2f}x inductor" if base else ""
        lines.append(f"  {variant:9s} {r['s'] * 1e3:8.3f} ms ({r['tb_per_s']:5.2f} TB/s{against}); largest relative "
                     f"error: gradients {r['gradients']:.1e}, row scales {r['row_scales']:.1e}; e4m3 values "
                     f"differing {100 * r['fp8_differing']:.2f}%")
    for variant, why in record["not_available"].items():
        lines.append(f"  {variant:9s} not available: {why}")
    return "\n".join(lines)
