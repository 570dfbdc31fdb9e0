"""The fp8 matmuls of one block alone, with and without fast accumulation: time and error per linear.

    python -m train.bench --gemm_probe [--image_tokens 12288 --text_tokens 696 --repeats 30] [--json J]

The token linears that train.fp8_base converts (train/model/fp8.py TOKEN_LINEARS) at the released width, for one
micro-batch: each linear's forward matmul (x @ W8^T) and its input gradient (dy @ W8, with W8's transposed copy as
train.fp8_transposed keeps it), through the call training makes (train/model/fp8.py scaled_mm), timed in CUDA graphs
without the host's launches (`kernel_ms`, the median of `repeats`; the row quantisation of the input is outside the
timing, since fast accumulation does not change it) with torch's `use_fast_accum` off and on
(train.fp8_fast_accum). On Hopper the fp8 tensor cores accumulate in a narrower format; with fast accumulation off
cuBLAS promotes the partial sums to fp32 every so often, which is exact but slower. Error: the bf16 output against a
float32 matmul of the same e4m3 operands and scales, as ||out - ref|| / ||ref||, so it is the accumulation and the
output's rounding, not the quantisation.
The inputs are random normal (the weights scaled as the released init, std 0.02): an order of magnitude, not the
trained model's. The report sums a block's linears and multiplies by the model's 60 blocks, the time per step a step
would save.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from dataclasses import dataclass

import torch

from train.model import family, fp8

# Qwen-Image-Edit's released transformer: its blocks' widths and depth
FULL_ARCH = family.family_named("qwen_image").bench.released_config("edit")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.bench --gemm_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--image_tokens", type=int, default=3 * 4096, help="target + reference tokens of a micro-batch")
    p.add_argument("--text_tokens", type=int, default=696)
    p.add_argument("--repeats", type=int, default=30, help="timed runs of each matmul (after 5 warm-up runs)")
    p.add_argument("--json", default="", help="append the result as one JSON line to this file")
    return p.parse_args(argv)


def linears() -> list[tuple[str, int, int]]:
    """(name, in_features K, out_features N) of one block's token linears for one stream (both streams have the
    same: q, k, v and the output projection of the attention, the MLP's up and down projections, 4x wide)."""
    dim = FULL_ARCH["num_attention_heads"] * FULL_ARCH["attention_head_dim"]
    return [("q", dim, dim), ("k", dim, dim), ("v", dim, dim), ("out", dim, dim), ("mlp_up", dim, 4 * dim),
            ("mlp_down", 4 * dim, dim)]


def median_ms(fn, repeats: int, device: torch.device, warmup: int = 5) -> float:
    """Median milliseconds of `repeats` calls of `fn` after `warmup` calls: each call between two CUDA events on a
    GPU, between two reads of the host clock on a CPU (where a call ends when it returns). The benchmarks' timer of
    single kernels (this probe and the floor of train/benchmarks/floor.py)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(fn, repeats: int, device: torch.device, calls: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of one call of `fn` without the host's launch of it: on a GPU `calls` calls captured in one
    CUDA graph, the graph replayed `repeats` times between two CUDA events, each replay's time divided by `calls`; on
    a CPU median_ms. A call timed alone between two events also counts the host's launch, which a kernel of a few
    microseconds (the text stream's matmuls) does not outlast, while in the step the host launches ahead of the
    device. `fn`'s outputs are dropped, so the graph's memory pool reuses one output's memory for the next."""
    if device.type != "cuda":
        return median_ms(fn, repeats, device, warmup)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's graph capture asks
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA calls are theirs
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@dataclass(frozen=True)
class Fp8Operands:
    """One token linear's fp8 operands as training makes them (train/model/fp8.py): the input x quantised per row,
    the e4m3 weight with its row scales and its transposed copy (train.fp8_transposed's), and the output gradient
    dy with the weight's row scales folded in, quantised per row, as the backward does."""

    x8: torch.Tensor
    x_scale: torch.Tensor
    w8: torch.Tensor
    w_scale: torch.Tensor
    w8_t: torch.Tensor
    g8: torch.Tensor
    g_scale: torch.Tensor
    ones: torch.Tensor
    dtype: torch.dtype = torch.bfloat16  # of the activations: the matmuls' output dtype

    def forward(self, fast: bool) -> torch.Tensor:
        """x @ W^T: the forward matmul."""
        return fp8.scaled_mm(self.x8, self.x_scale, self.w8, self.w_scale, self.dtype, fast)

    def input_grad(self, fast: bool) -> torch.Tensor:
        """dy @ W: the backward's input-gradient matmul (on the transposed copy)."""
        return fp8.scaled_mm(self.g8, self.g_scale, self.w8_t, self.ones, self.dtype, fast)


def fp8_operands(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Fp8Operands:
    """Random operands of an m-row input through a k -> n token linear, activations in `dtype` (weights at the
    released init's std 0.02)."""
    g = torch.Generator(device=device).manual_seed(m * 7 + k * 3 + n)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w8, w_scale = fp8.quantize_weight(0.02 * torch.randn(n, k, device=device, generator=g))
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    g8, g_scale = fp8.quantize_rows(dy * w_scale.view(1, -1))  # W's row scales folded into dy, as the backward
    return Fp8Operands(*fp8.quantize_rows(x), w8, w_scale, w8.t().contiguous(), g8, g_scale,
                       torch.ones(k, dtype=torch.float32, device=device), dtype)


def measure(m: int, k: int, n: int, device: torch.device, repeats: int) -> dict:
    """One linear with m rows of input: the forward and input-gradient matmuls, fast accumulation off and on."""
    ops = fp8_operands(m, k, n, device)
    ref_fwd = (ops.x8.float() * ops.x_scale) @ (ops.w8.float() * ops.w_scale[:, None]).t()
    ref_bwd = (ops.g8.float() * ops.g_scale) @ ops.w8.float()
    row = {"m": m, "k": k, "n": n}
    for fast in (False, True):
        tag = "fast" if fast else "exact"
        row[f"fwd_ms_{tag}"] = kernel_ms(lambda fast=fast: ops.forward(fast), repeats, device)
        row[f"bwd_ms_{tag}"] = kernel_ms(lambda fast=fast: ops.input_grad(fast), repeats, device)
        row[f"fwd_error_{tag}"] = _error(ops.forward(fast), ref_fwd)
        row[f"bwd_error_{tag}"] = _error(ops.input_grad(fast), ref_bwd)
    return row


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--gemm_probe needs a CUDA GPU with fp8 matmuls (compute capability 8.9 or newer)")
    device = torch.device("cuda", torch.cuda.current_device())
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references in full float32
    try:
        rows = {f"{stream}_{name}": {"name": name, "stream": stream, **measure(m, k, n, device, args.repeats)}
                for stream, m in (("image", args.image_tokens), ("text", args.text_tokens))
                for name, k, n in linears()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    blocks = FULL_ARCH["num_layers"]
    record = {"benchmark": "gemm_probe", "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "image_tokens": args.image_tokens,
              "text_tokens": args.text_tokens, "blocks": blocks, "linears": rows}
    for tag in ("exact", "fast"):
        ms = sum(r[f"fwd_ms_{tag}"] + r[f"bwd_ms_{tag}"] for r in rows.values())
        flops = sum(2 * 2 * r["m"] * r["k"] * r["n"] for r in rows.values())  # forward and input gradient
        record[f"step_s_{tag}"] = ms * blocks / 1e3
        record[f"tflops_{tag}"] = flops / (ms / 1e3) / 1e12
        record[f"max_error_{tag}"] = max(max(r[f"fwd_error_{tag}"], r[f"bwd_error_{tag}"]) for r in rows.values())
    return record


def format_report(r: dict) -> str:
    lines = [f"fp8 matmuls of one block, {r['image_tokens']} image + {r['text_tokens']} text tokens, {r['gpu']}, "
             f"torch {r['torch']}",
             f"{'linear':<16}{'M x K x N':>22}{'fwd ms exact/fast':>20}{'bwd ms exact/fast':>20}"
             f"{'fwd err exact/fast':>22}{'bwd err exact/fast':>22}"]
    for key, row in r["linears"].items():
        lines.append(f"{key:<16}{row['m']:>8} x{row['k']:>6} x{row['n']:>6}"
                     f"{row['fwd_ms_exact']:>11.3f}/{row['fwd_ms_fast']:<8.3f}{row['bwd_ms_exact']:>11.3f}/"
                     f"{row['bwd_ms_fast']:<8.3f}{row['fwd_error_exact']:>13.2e}/{row['fwd_error_fast']:<8.2e}"
                     f"{row['bwd_error_exact']:>13.2e}/{row['bwd_error_fast']:<8.2e}")
    lines.append(f"x {r['blocks']} blocks: {r['step_s_exact']:.4f} s per step exact ({r['tflops_exact']:.0f} TFLOP/s), "
                 f"{r['step_s_fast']:.4f} s fast ({r['tflops_fast']:.0f} TFLOP/s), fast - exact "
                 f"{r['step_s_fast'] - r['step_s_exact']:+.4f} s; largest error {r['max_error_exact']:.2e} exact, "
                 f"{r['max_error_fast']:.2e} fast")
    return "\n".join(lines)
