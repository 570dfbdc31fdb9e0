"""The step's distance to the hardware floor: its attention and matmul kernels timed alone, at its own shapes.

    python -m train.bench --floor [the step's options] [--floor_repeats 20]

After the project's step is timed (train/benchmarks/step.py), in the same process:

1. Census. One forward of the benchmarked model, prepared as the step prepares it (LoRA, RoPE as real pairs, the
   fp8 base) but uncompiled and on the meta device (shapes only, no memory), with the step's own transformer inputs
   (train.trainer.loop.noisy_inputs on its batch): a forward hook on every linear records the rows, widths and kind
   of each call and whether its input requires a gradient (the backward computes an input gradient only then:
   none for the embeddings, the modulation, block 0's q/k/v); diffusers' attention dispatch, as the Qwen-Image
   transformer module sees it (kept_attention.install replaces it there), records each attention call's shapes and
   options (the backend mark of a kept-attention block, the mask).
2. Timing. Each distinct call alone, times its count per step. A matmul: the median of `repeats` replays of a CUDA
   graph of 20 calls, per call (train/benchmarks/gemms.py `kernel_ms`): its kernel without the host's launch, which
   the step hides by launching ahead and which a matmul of the text stream's 256 rows would not outlast if timed
   call by call. An attention call (milliseconds each): the median of `repeats` calls between two CUDA events, after
   5 warm-up calls (`median_ms`). On a CPU, both by the host clock.
   - attention: the same dispatch with the recorded options, forward, and forward + backward (the backward is the
     difference), on random q, k, v of the recorded layout (batch, tokens, heads, head_dim);
   - fp8: the token linears' `torch._scaled_mm` calls as train/model/fp8.py makes them (gemms.py `Fp8Operands`):
     the forward, and the input gradient on the transposed weight, with the step's fast accumulation setting; the
     row quantisation and the transpose of a weight without its stored copy are not matmuls: beyond the floor;
   - dense: the frozen linears left in the model dtype (embeddings, output, time embedding) and the modulation's
     matrix-vector product on its dequantised weight: forward (bias included), and the input gradient where one is
     computed;
   - lora: LoRA's A and B: forward, weight gradient, and the input gradient where one is computed. Listed apart.
3. The floor = attention + fp8 + dense; the ratio = the step's time / the floor, from the step's mean and from its
   median. Nothing here counts the optimizer step, the elementwise kernels (norms, modulation, RoPE, GELU, the fp8
   quantisation), the launches or the gaps: `--profile` names them (train/benchmarks/kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from diffusers.models.transformers import transformer_qwenimage

from train.benchmarks import gemms
from train.model import fp8

PARTS = ("attention", "fp8", "dense", "lora")  # the floor is the first three
NUMERIC_FIELDS = (
    "floor_s",
    "floor_attention_s",
    "floor_fp8_s",
    "floor_dense_s",
    "floor_lora_s",
    "floor_ratio",
    "floor_ratio_median",
    "floor_step_median_s",
    "floor_ratio_with_lora",
)


@dataclass(frozen=True)
class LinearCall:
    """One linear's call in the forward: its kind (fp8 / fp8_vector / frozen / lora), rows m, k -> n, and whether
    its backward computes an input gradient."""

    kind: str
    m: int
    k: int
    n: int
    bias: bool
    input_grad: bool


@dataclass(frozen=True)
class AttentionCall:
    """One attention call: q's shape (batch, tokens, heads, head_dim), the dispatch's other options, the mask's
    shape (None: no mask) and whether q, k or v requires a gradient."""

    shape: tuple[int, ...]
    options: tuple[tuple[str, object], ...]
    mask: tuple[int, ...] | None
    grad: bool


def _linear_kind(module: torch.nn.Module) -> str:
    if isinstance(module, fp8.Float8FrozenLinear):
        return "fp8" if module.kind == "token" else "fp8_vector"
    return "lora" if module.weight.requires_grad else "frozen"


def census(model: torch.nn.Module, kwargs: dict) -> tuple[list[LinearCall], list[AttentionCall]]:
    """The linear and attention calls of one forward of `model` on `kwargs` (see the module docstring)."""
    linears: list[LinearCall] = []
    attention: list[AttentionCall] = []

    def on_linear(module, args, _output):
        x = args[0]
        linears.append(
            LinearCall(
                _linear_kind(module),
                x.numel() // x.shape[-1],
                module.in_features,
                module.out_features,
                module.bias is not None,
                x.requires_grad,
            )
        )

    dispatch = transformer_qwenimage.dispatch_attention_fn

    def recording(query, key, value, **options):
        mask = options.pop("attn_mask", None)
        attention.append(
            AttentionCall(
                tuple(query.shape),
                tuple(sorted(options.items())),
                None if mask is None else tuple(mask.shape),
                any(t.requires_grad for t in (query, key, value)),
            )
        )
        return dispatch(query, key, value, attn_mask=mask, **options)

    handles = [
        m.register_forward_hook(on_linear)
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, fp8.Float8FrozenLinear))
    ]
    transformer_qwenimage.dispatch_attention_fn = recording
    try:
        with torch.enable_grad():
            model(**kwargs)
    finally:
        transformer_qwenimage.dispatch_attention_fn = dispatch
        for h in handles:
            h.remove()
    return linears, attention


def _row(part: str, call: str, shape: str, calls: int, ms: float, flops: float) -> dict:
    return {
        "part": part,
        "call": call,
        "shape": shape,
        "calls": calls,
        "ms": ms,
        "s_per_step": ms * calls / 1e3,
        "tflops": flops / (ms / 1e3) / 1e12 if ms > 0 else 0.0,
    }


def time_attention(c: AttentionCall, calls: int, device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Forward and backward rows of one attention call, through the dispatch the transformer calls."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(c.shape, device=device, dtype=dtype, generator=g).requires_grad_(c.grad) for _ in range(3))
    mask = None if c.mask is None else torch.ones(c.mask, dtype=torch.bool, device=device)
    options = dict(c.options)

    def forward():
        return transformer_qwenimage.dispatch_attention_fn(q, k, v, attn_mask=mask, **options)

    grad_out = torch.randn_like(forward())
    batch, tokens, heads, head_dim = c.shape
    flops = 4.0 * batch * heads * tokens**2 * head_dim  # QK^T and AV; the backward counts twice that (as MFU)
    shape = "x".join(map(str, c.shape))
    fwd = gemms.median_ms(forward, repeats, device)
    rows = [_row("attention", "forward", shape, calls, fwd, flops)]
    if c.grad:
        both = gemms.median_ms(lambda: torch.autograd.grad(forward(), (q, k, v), grad_out), repeats, device)
        rows.append(_row("attention", "backward", shape, calls, max(both - fwd, 0.0), 2 * flops))
    return rows


def matmuls(c: LinearCall) -> list[tuple[str, str]]:
    """(part, call) of each matmul one linear call makes in the forward and the backward."""
    part = {"fp8": "fp8", "lora": "lora"}.get(c.kind, "dense")
    return (
        [(part, "forward")]
        + ([(part, "weight_grad")] if c.kind == "lora" else [])
        + ([(part, "input_grad")] if c.input_grad else [])
    )


def time_matmul(
    part: str,
    call: str,
    c: LinearCall,
    calls: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    fast_accum: bool,
) -> dict:
    """One matmul of a linear call, timed (see the module docstring for what each part runs)."""
    shape, flops = f"{c.m}x{c.k}x{c.n}" + ("+bias" if c.bias else ""), 2.0 * c.m * c.k * c.n
    if part == "fp8":
        ops = gemms.fp8_operands(c.m, c.k, c.n, device, dtype)
        fn = ops.input_grad if call == "input_grad" else ops.forward
        return _row(part, call, shape, calls, gemms.kernel_ms(lambda: fn(fast_accum), repeats, device), flops)
    g = torch.Generator(device=device).manual_seed(c.m * 7 + c.k * 3 + c.n)
    x, w, dy = (torch.randn(*s, device=device, dtype=dtype, generator=g) for s in ((c.m, c.k), (c.n, c.k), (c.m, c.n)))
    bias = torch.randn(c.n, device=device, dtype=dtype, generator=g) if c.bias else None
    fn = {
        "forward": lambda: torch.nn.functional.linear(x, w, bias),
        "weight_grad": lambda: dy.t() @ x,
        "input_grad": lambda: dy @ w,
    }[call]
    return _row(part, call, shape, calls, gemms.kernel_ms(fn, repeats, device), flops)


def time_calls(
    linears: list[LinearCall],
    attention: list[AttentionCall],
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    fast_accum: bool,
) -> list[dict]:
    """Every distinct call timed once, each row with its count per step."""
    rows = []
    for c, n in _counts(attention).items():
        rows += time_attention(c, n, device, dtype, repeats)
    # the fp8 linears add their bias after the matmul: only a frozen nn.Linear's forward matmul carries one
    ops = _counts(
        [
            (part, call, replace(c, input_grad=False, bias=c.bias and call == "forward" and c.kind == "frozen"))
            for c in linears
            for part, call in matmuls(c)
        ]
    )
    for (part, call, c), n in ops.items():
        rows.append(time_matmul(part, call, c, n, device, dtype, repeats, fast_accum))
    return rows


def _counts(calls: list) -> dict:
    counts: dict = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return counts


def summarise(rows: list[dict], step_mean_s: float, step_median_s: float) -> dict:
    """The floor's fields of the benchmark's record: the parts' seconds per step summed from `rows`, the floor
    (attention + fp8 + dense) and the step's time over it, from its mean and from its median."""
    parts = {part: sum(r["s_per_step"] for r in rows if r["part"] == part) for part in PARTS}
    floor = parts["attention"] + parts["fp8"] + parts["dense"]
    return {
        **{f"floor_{part}_s": s for part, s in parts.items()},
        "floor_s": floor,
        "floor_attention_forward_s": sum(
            r["s_per_step"] for r in rows if r["part"] == "attention" and r["call"] == "forward"
        ),
        "floor_step_median_s": step_median_s,
        "floor_ratio": step_mean_s / floor,
        "floor_ratio_median": step_median_s / floor,
        "floor_ratio_with_lora": step_mean_s / (floor + parts["lora"]),
        "floor_rows": rows,
    }


def measure(
    model_meta: torch.nn.Module,
    kwargs_meta: dict,
    step_mean_s: float,
    step_median_s: float,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    fast_accum: bool,
) -> dict:
    """Census of `model_meta` (the step's model on the meta device) on `kwargs_meta` (its inputs there), every call
    timed on `device`, and the floor's fields against the step's times."""
    linears, attention = census(model_meta, kwargs_meta)
    rows = time_calls(linears, attention, device, dtype, repeats, fast_accum)
    timing = "cuda_graph" if device.type == "cuda" else "host_clock"  # of the matmuls (the module docstring)
    return {**summarise(rows, step_mean_s, step_median_s), "floor_repeats": repeats, "floor_matmul_timing": timing}


def report_lines(r: dict) -> list[str]:
    """The floor's lines of the benchmark's report."""
    lines = [
        f"floor       attention {r['floor_attention_s']:.4f} s (forward {r['floor_attention_forward_s']:.4f}) + "
        f"fp8 matmuls {r['floor_fp8_s']:.4f} s + {r['precision']} matmuls {r['floor_dense_s']:.4f} s = "
        f"{r['floor_s']:.4f} s per step; LoRA's matmuls {r['floor_lora_s']:.4f} s apart (matmuls timed by "
        f"{'CUDA graph' if r['floor_matmul_timing'] == 'cuda_graph' else 'the host clock'})",
        f"floor ratio step / floor = {r['floor_ratio']:.3f} from the mean ({r['s_per_step']:.4f} s), "
        f"{r['floor_ratio_median']:.3f} from the median ({r['floor_step_median_s']:.4f} s); "
        f"{r['floor_ratio_with_lora']:.3f} with LoRA's matmuls in the floor",
        f"  {'part':10s} {'call':12s} {'shape':>22s} {'calls':>6s} {'ms each':>9s} {'s/step':>8s} {'TFLOP/s':>8s}",
    ]
    for row in sorted(r["floor_rows"], key=lambda row: -row["s_per_step"]):
        lines.append(
            f"  {row['part']:10s} {row['call']:12s} {row['shape']:>22s} {row['calls']:6d} {row['ms']:9.4f} "
            f"{row['s_per_step']:8.4f} {row['tflops']:8.1f}"
        )
    return lines
