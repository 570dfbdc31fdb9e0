"""The attention kernels alone, at the training step's shapes: torch SDPA on cuDNN in bf16 against cuDNN's fp8 flash
attention (train/model/fp8_attention.py), speed and numerical error. The command is

    python -m train.bench --attention_probe [--seq_lens 8448,12544] [--iters 20] [--json FILE]

Workload: batch 1, 24 heads of 128, no mask, bf16 inputs; S = 8448 tokens is the 1024^2 target + one 1024^2
reference + 256 text tokens, 12544 the two-reference case. Rows, each timed with CUDA events over `iters` calls
after `warmup` (forward alone, then forward + backward; the backward is their difference):
- `bf16`: F.scaled_dot_product_attention with the cuDNN backend forced (the step's kernel).
- `fp8`: fp8_sdpa with an Fp8SdpaState (delayed scaling: one backward kernel), quantisation included.
- `fp8_calibrated`: fp8_sdpa without a state (each backward calibrates: three kernels).
- `fp8_fwd`: fp8 forward, cuDNN's bf16 backward (fp8_forward_sdpa).
- `fp8_kernels`: the fp8 forward and backward kernels alone on tensors quantised beforehand (the ceiling of the
  lever: no quantise / dequantise passes).
- `fp8_casts`: those quantise / dequantise passes alone (what fusing them into the neighbouring kernels would save).
FLOPs: forward 4 B H S^2 D, backward 2.5x the forward. Errors: relative Frobenius norm of O, dQ, dK, dV against an
fp64 reference on the same bf16 inputs and output gradient (the fp8 rows after warm-up, so the delayed scales come
from an earlier call on the same data: the steady state). A row that fails (no frontend, a graph cuDNN refuses) is
reported with its message and the others still run. The JSON record also has each timing's host time (`*_host_s`:
the time to issue the calls; close to the GPU time, the GPU waited for the host) and how the casts ran (`casts`).
Its last measured results are in train/model/fp8_attention.py's docstring. It takes about 50 s on an H200 (the
casts' compilation included).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from train.model import fp8_attention as fa

DEFAULT_SEQ_LENS = (8448, 12544)
ROWS = ("bf16", "fp8", "fp8_calibrated", "fp8_fwd", "fp8_kernels", "fp8_casts")
SEED = 0


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of `train.bench --attention_probe` (the flag itself is train.bench's)."""
    p = argparse.ArgumentParser(
        prog="python -m train.bench --attention_probe",
        description="Time and check bf16 against fp8 cuDNN attention at the step's shapes",
    )
    p.add_argument(
        "--seq_lens",
        type=_positive_ints,
        default=DEFAULT_SEQ_LENS,
        help="comma-separated sequence lengths (default 8448,12544: one and two 1024^2 references)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128, help="(cuDNN's fp8 backward takes 128 on Hopper)")
    p.add_argument(
        "--rows",
        type=lambda s: tuple(s.split(",")),
        default=ROWS,
        help=f"comma-separated rows to run (default all: {','.join(ROWS)})",
    )
    p.add_argument(
        "--qk_std",
        type=float,
        default=1.0,
        help="standard deviation of q and k (scores' std = qk_std^2): sharper attention above 1",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--json", help="append the result as one JSON line to this file")
    args = p.parse_args(argv)
    unknown = set(args.rows) - set(ROWS)
    if unknown:
        p.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(ROWS)}")
    if min(args.batch, args.heads, args.head_dim, args.iters) < 1 or args.warmup < 0 or args.qk_std <= 0:
        p.error("--batch, --heads, --head_dim, --iters must be >= 1, --warmup >= 0, --qk_std > 0")
    return args


# ---------------------------------------------------------------- arithmetic


def forward_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """QK^T and PV: 2 matmuls of 2 S^2 D FLOPs per head."""
    return 4.0 * batch * heads * seq_len * seq_len * head_dim


BACKWARD_FACTOR = 2.5  # dV, dP, dQ, dK (4 matmuls) and the recomputed QK^T: 5 against the forward's 2


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F, in fp64."""
    x, ref = x.detach().double(), ref.detach().double()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


def reference_attention(q, k, v, do, scale: float, heads_per_chunk: int = 4) -> tuple[torch.Tensor, ...]:
    """O, dQ, dK, dV in fp64 from plain matmuls, a few heads at a time (one [S, S] matrix of all 24 heads at
    S = 12544 would take 30 GB in fp64); fp64 also keeps TF32 out."""
    results = []
    for h0 in range(0, q.shape[1], heads_per_chunk):
        qf, kf, vf, dof = (t[:, h0 : h0 + heads_per_chunk].double() for t in (q, k, v, do))
        p = torch.softmax(qf @ kf.transpose(-1, -2) * scale, dim=-1)
        o = p @ vf
        ds = p * (dof @ vf.transpose(-1, -2) - (dof * o).sum(-1, keepdim=True))
        results.append((o, ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, p.transpose(-1, -2) @ dof))
        del p, ds
    return tuple(torch.cat(parts, dim=1) for parts in zip(*results, strict=True))


# ---------------------------------------------------------------- timing


def time_cuda(fn: Callable[[], object], warmup: int, iters: int) -> tuple[float, float]:
    """Mean seconds per call of `fn` on the GPU (CUDA events around `iters` calls after `warmup` untimed ones) and
    on the host (issuing the calls): a host time close to the GPU time means the GPU waited for the host."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - host
    end.record()
    end.synchronize()  # sync point: the measurement
    return start.elapsed_time(end) / 1e3 / iters, host / iters


@dataclass
class Inputs:
    """One shape's bf16 q, k, v, output gradient and attention scale, with the fp64 reference."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    scale: float
    reference: tuple[torch.Tensor, ...]


def make_inputs(args: argparse.Namespace, seq_len: int, device: torch.device) -> Inputs:
    g = torch.Generator(device).manual_seed(SEED + seq_len)
    shape = (args.batch, args.heads, seq_len, args.head_dim)
    q, k = (torch.randn(shape, generator=g, device=device).mul_(args.qk_std).bfloat16() for _ in range(2))
    v, do = (torch.randn(shape, generator=g, device=device).bfloat16() for _ in range(2))
    scale = args.head_dim**-0.5
    return Inputs(q, k, v, do, scale, reference_attention(q, k, v, do, scale))


def bf16_cudnn_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA with cuDNN's kernel forced: the step's attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # the step's kernel; raises where cuDNN attention cannot run
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _autograd_row(attention: Callable, x: Inputs, args: argparse.Namespace) -> dict:
    """Time the forward (training mode: inputs that need gradients) and forward + backward of `attention`, and the
    errors of one more call."""
    q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))

    def fwd_bwd():
        out = attention(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), x.do))

    fwd_s, fwd_host_s = time_cuda(lambda: attention(q, k, v), args.warmup, args.iters)
    fwd_bwd_s, fwd_bwd_host_s = time_cuda(fwd_bwd, args.warmup, args.iters)
    errors = {
        f"err_{n}": rel_error(t, r) for n, t, r in zip(("o", "dq", "dk", "dv"), fwd_bwd(), x.reference, strict=True)
    }
    return {
        "fwd_s": fwd_s,
        "fwd_bwd_s": fwd_bwd_s,
        "fwd_host_s": fwd_host_s,
        "fwd_bwd_host_s": fwd_bwd_host_s,
        **errors,
    }


def _kernels_row(x: Inputs, args: argparse.Namespace) -> dict:
    """The fp8 forward kernel and the one-kernel backward (delayed scales from a calibration) alone."""
    with torch.no_grad():
        q, k, v, do = fa.quantize(x.q, x.k, x.v, x.do)
        fwd = fa.fp8_forward(q, k, v, x.scale, x.q.dtype)
        amax = fa.calibrated_backward(fwd, do, x.q.dtype).amax
        fwd_s = time_cuda(lambda: fa.fp8_forward(q, k, v, x.scale, x.q.dtype), args.warmup, args.iters)[0]
        bwd = time_cuda(lambda: fa.fp8_backward_pass(fwd, do, amax, fa.MARGIN, x.q.dtype), args.warmup, args.iters)
    return {"fwd_s": fwd_s, "fwd_bwd_s": fwd_s + bwd[0]}


def _casts_row(x: Inputs, args: argparse.Namespace) -> dict:
    """The fp8 rows' quantise / dequantise work alone: forward q, k, v to e4m3 and O back, backward dO to e4m3 and
    dQ, dK, dV back; and per tensor, the quantisation and the dequantisation (the fp8 row should take the
    fp8_kernels row's time plus this one's, unless the GPU waits for the host)."""
    with torch.no_grad():
        e4m3 = fa.quantize(x.q, x.k, x.v)  # stand-ins for O, dQ, dK, dV (e4m3, their shapes)
        datas, descales, dtype = [t.data for t in e4m3], [t.descale for t in e4m3], x.q.dtype

        def forward():
            fa.quantize(x.q, x.k, x.v)
            fa.dequantize(datas[:1], descales[:1], dtype)

        def backward():
            fa.quantize(x.do)
            fa.dequantize(datas, descales, dtype)

        timings = {
            name: time_cuda(fn, args.warmup, args.iters)
            for name, fn in (
                ("fwd_s", forward),
                ("bwd_s", backward),
                ("quantize_one_s", lambda: fa.quantize(x.q)),
                ("dequantize_one_s", lambda: fa.dequantize(datas[:1], descales[:1], dtype)),
            )
        }
    result = {name: gpu for name, (gpu, _) in timings.items()}
    result.update({name.replace("_s", "_host_s"): host for name, (_, host) in timings.items()})
    return {**result, "fwd_bwd_s": result["fwd_s"] + result["bwd_s"]}


def run_row(name: str, x: Inputs, args: argparse.Namespace) -> dict:
    """One row's timings and errors; a failure is returned as the row's `error` (with its type), not raised."""
    state = fa.Fp8SdpaState()  # the row's own attention layer
    attention = {
        "bf16": bf16_cudnn_sdpa,
        "fp8": lambda q, k, v: fa.fp8_sdpa(q, k, v, state=state),
        "fp8_calibrated": fa.fp8_sdpa,
        "fp8_fwd": fa.fp8_forward_sdpa,
    }
    row = {"fp8_kernels": _kernels_row, "fp8_casts": _casts_row}.get(name)
    try:
        result = row(x, args) if row else _autograd_row(attention[name], x, args)
    except Exception as e:  # reported per row: one run shows as much as it can (e.g. bf16 when fp8 cannot run)
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.empty_cache()
    result["bwd_s"] = result["fwd_bwd_s"] - result["fwd_s"]
    if name == "fp8_casts":  # no attention FLOPs in it
        return result
    flops = forward_flops(args.batch, args.heads, x.q.shape[2], args.head_dim)
    result["fwd_tflops"] = flops / result["fwd_s"] / 1e12
    result["bwd_tflops"] = BACKWARD_FACTOR * flops / result["bwd_s"] / 1e12 if result["bwd_s"] > 0 else None
    result["fwd_bwd_tflops"] = (1 + BACKWARD_FACTOR) * flops / result["fwd_bwd_s"] / 1e12
    return result


# ---------------------------------------------------------------- the run and its report


def _environment() -> dict:
    """What the numbers depend on: GPU, torch, cuDNN library and frontend versions."""
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch_version": torch.__version__,
        "cudnn_version": torch.backends.cudnn.version(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        env["cudnn_frontend_version"] = fa.cudnn_frontend(torch.device("cuda", 0)).__version__
    except fa.Fp8AttentionUnavailable as e:
        env["cudnn_frontend_version"] = None
        env["fp8_unavailable"] = str(e)
    return env


def _casts_used() -> str:
    """How the fp8 rows quantised and dequantised: compiled, or eagerly and why."""
    return "compiled" if fa.KERNELS.failure is None else f"eager ({fa.KERNELS.failure})"


def run(args: argparse.Namespace) -> dict:
    """Every row at every sequence length; the JSON record (its `error` says why nothing could run)."""
    record = {
        "benchmark": "attention_probe",
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "seq_lens": list(args.seq_lens),
        "qk_std": args.qk_std,
        "iters": args.iters,
        "warmup": args.warmup,
        **_environment(),
        "rows": [],
    }
    if not torch.cuda.is_available():
        record["error"] = "the attention probe needs a CUDA GPU (torch.cuda.is_available() is False)"
        return record
    device = torch.device("cuda", 0)
    for seq_len in args.seq_lens:
        x = make_inputs(args, seq_len, device)
        for name in args.rows:
            record["rows"].append({"row": name, "seq_len": seq_len, **run_row(name, x, args)})
        del x
        torch.cuda.empty_cache()
    record["casts"] = _casts_used()
    return record


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:8.3f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_report(record: dict) -> str:
    """The table of rows (milliseconds per call, TFLOP/s, relative errors), then each failed row's message."""
    head = (
        f"attention probe: {record.get('gpu_name')}, torch {record['torch_version']}, cuDNN "
        f"{record['cudnn_version']}, frontend {record.get('cudnn_frontend_version')}; B={record['batch']} "
        f"H={record['heads']} D={record['head_dim']}, qk_std {record['qk_std']}"
    )
    lines = [head]
    if record.get("error"):
        return "\n".join([*lines, f"not run: {record['error']}"]) + "\n"
    lines.append(
        f"{'row':15s} {'S':>6s} {'fwd ms':>8s} {'TF/s':>5s} {'bwd ms':>8s} {'TF/s':>5s} {'f+b ms':>8s} "
        f"{'TF/s':>5s}  {'err O':>8s} {'err dQ':>8s} {'err dK':>8s} {'err dV':>8s}"
    )
    failures = [f"quantise / dequantise: {record.get('casts')}"]
    for r in record["rows"]:
        if "error" in r:
            failures.append(f"{r['row']} S={r['seq_len']}: FAILED: {r['error']}")
            continue
        errors = " ".join(_num(r.get(f"err_{n}"), "8.2e") for n in ("o", "dq", "dk", "dv"))
        lines.append(
            f"{r['row']:15s} {r['seq_len']:6d} {_ms(r['fwd_s'])} {_num(r.get('fwd_tflops'), '5.0f')} "
            f"{_ms(r['bwd_s'])} {_num(r.get('bwd_tflops'), '5.0f')} {_ms(r['fwd_bwd_s'])} "
            f"{_num(r.get('fwd_bwd_tflops'), '5.0f')}  {errors}"
        )
    return "\n".join(lines + failures) + "\n"


def exit_code(record: dict) -> int:
    """0 when at least one row ran, else 1."""
    return 0 if any("error" not in r for r in record["rows"]) else 1
