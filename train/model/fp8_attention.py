"""cuDNN's FP8 flash attention, forward and backward, behind torch SDPA's layout: a speed lever for the step's
attention, measured by `python -m train.bench --attention_probe` (train/benchmarks/attention.py).

Why: in the profile of the fp8 step (docs/perf_notes.md) cuDNN's bf16 attention is the largest single cost, 0.32 s
of a 0.74 s step at 570-650 TFLOP/s, so another bf16 kernel has little left to win, while Hopper's fp8 tensor cores
have twice the bf16 peak. This module runs cuDNN's fp8 SDPA graphs (the ones TransformerEngine's fp8 attention
builds) through cuDNN's Python frontend, `nvidia-cudnn-frontend` (FRONTEND: its graph API `cudnn.pygraph` with the
nodes `sdpa_fp8` and `sdpa_fp8_backward`; a 2 MB wheel that needs no other package).

What is quantised, and how (e4m3 everywhere; every scale is one fp32 number, a [1, 1, 1, 1] tensor on the GPU, so
nothing waits for the host):
- q, k, v and the output gradient dO: current scaling, scale = 448 / amax of the tensor (1 where the amax is 0).
- the softmax probabilities P, inside the kernels: P <= 1, so scale 448.
- the output O: a bf16 O from fp8 inputs needs Blackwell and cuDNN >= 9.13 (the frontend refuses it on sm90), so
  the bf16 graph is tried first and the fp8 one used when refused. Each row of O is a convex combination of rows of
  V, so |O| <= amax(V) and scale_O = 448 / amax(V) cannot overflow. An fp8 O is dequantised for the caller and kept
  in fp8 for the backward.
- the backward's dP (the gradient of the softmax input, after the attention scale) and its outputs dQ, dK, dV (fp8
  on Hopper, for the same reason as O): their scales are inputs of the kernel, and only the kernel knows their amax
  (it returns them). `Fp8SdpaState` is delayed scaling, TransformerEngine's default recipe with a history of one
  step: the amax that the last backward of the same attention layer returned, times a margin of 2, gives the
  scales, and the backward is one kernel. Without a state, and on a state's first backward, the backward
  calibrates itself in three kernels (`calibrated_backward`): exact current scaling, for tests and references.

e4m3 keeps 3 mantissa bits: each quantised value is off by up to 1/16 of itself. The benchmark reports what that
does to O, dQ, dK and dV against an fp64 reference, next to bf16's own error.

Measured by the probe (one H200, torch 2.11.0+cu130, cuDNN 9.19.0, frontend 1.17.0, 2026-12-02; B=1, H=24, D=128,
normal random inputs): at S = 8448 forward + backward 4.31 ms against bf16 cuDNN's 5.22 (1.21x; forward 1.01 against
1.26 ms, backward 3.30 against 3.97), the fp8 kernels alone 4.08 ms (1.28x; forward 1024 TFLOP/s, backward 680); at
S = 12544 9.40 against 12.04 ms (1.28x). Relative errors: O 6.0%, dQ 7.2%, dK 7.1%, dV 6.0%, against bf16's
0.23-0.24%; the forward-only variant's gradients 0.5-0.7% (its O is the fp8 forward's, 6.0%).

The frontend is imported lazily (the CPU machines have none), after `torch.backends.cudnn.version()`, so that the
libcudnn it binds to is the one PyTorch has loaded (it looks the library up by name). What keeps it from running
here raises `Fp8AttentionUnavailable`, with the reason.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from train.model.fp8 import E4M3, E4M3_MAX

FRONTEND = "nvidia-cudnn-frontend==1.17.0"  # the pinned frontend: its Python API is the one written against here
MARGIN = 2.0  # delayed scaling: headroom for an amax that grows from one step to the next
_IO_DTYPES = (torch.bfloat16, torch.float16)
_HANDLES: dict[int, object] = {}  # device index -> cuDNN handle
_GRAPHS: dict[tuple, _Graph] = {}  # (kind, device, layouts, scale, dtype) -> built graph
_CONSTANTS: dict[tuple, torch.Tensor] = {}  # (device, value) -> [1, 1, 1, 1] fp32


class Fp8AttentionUnavailable(RuntimeError):
    """fp8 attention cannot run here: no CUDA GPU, a GPU older than Hopper, no cuDNN frontend, or a graph that cuDNN
    refuses (the message says which)."""


# ---------------------------------------------------------------- scales (plain tensor arithmetic)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax elementwise, in fp32; 1 where the amax is 0 (an all-zero tensor is zeros at any scale)."""
    amax = amax.float()
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def dp_bound(amax_do: torch.Tensor, amax_v: torch.Tensor, head_dim: int, attn_scale: float) -> torch.Tensor:
    """An upper bound of |dP| = attn_scale * P * |dO_i . v_j - dO_i . o_i| with P <= 1: each dot product is at most
    head_dim * amax(dO) * amax(V), since |O| <= amax(V). The first calibration kernel scales dP by it."""
    return 2.0 * head_dim * attn_scale * amax_do.float() * amax_v.float()


@dataclass
class Quantized:
    """A tensor in e4m3 with its per-tensor dequantisation factor: x ~= data * descale."""

    data: torch.Tensor
    descale: torch.Tensor  # fp32 [1, 1, 1, 1]
    amax: torch.Tensor  # fp32 [1, 1, 1, 1], of the tensor before quantisation


def _quantize_math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tensor: the e4m3 data, the descale and the amax (flat list)."""
    out = []
    for x in xs:
        amax = torch.linalg.vector_norm(x.float(), math.inf).reshape(1, 1, 1, 1)
        scale = fp8_scale(amax)
        out += [(x.float() * scale).to(E4M3), scale.reciprocal(), amax]  # |x * scale| <= 448 by construction
    return out


def _dequantize_math(datas: list[torch.Tensor], descales: list[torch.Tensor], dtype: torch.dtype) -> list:
    return [(data.float() * descale).to(dtype) for data, descale in zip(datas, descales, strict=True)]


class _Kernels:
    """The quantise / dequantise arithmetic, compiled on CUDA (inductor's Triton kernels, which convert with the
    hardware's instructions). Eager PyTorch converts to and from e4m3 in software, element by element: 120 us for
    the scaled cast and 180 us for the dequantisation of one 26 M-element tensor on an H200 (the probe's fp8_casts
    row, 2026-12-02), several times what the bytes need, and with them the fp8 row was slower than bf16 (5.34 against
    5.24 ms at S = 8448). A compiled call costs about 0.1 ms of host time (guards, launches), so the fp8 forward is
    close to host-bound at S = 8448; inside a compiled training block the casts would fuse into the neighbouring
    kernels instead. Eager on a CPU, and after a failed compilation (whose reason `failure` keeps, and the probe
    reports)."""

    def __init__(self):
        self.compiled: dict[Callable, Callable] = {}
        self.failure: str | None = None

    def __call__(self, fn: Callable, tensors: list[torch.Tensor], *args):
        if tensors[0].is_cuda and self.failure is None:
            try:
                if fn not in self.compiled:
                    # Static shapes: with dynamic=True the probe's fp8 row took 4.61 ms against 4.31 at S = 8448
                    # (2026-12-02). A new shape compiles again; past torch._dynamo's recompile limit (8 graphs per
                    # function) a shape runs eagerly.
                    self.compiled[fn] = torch.compile(fn, dynamic=False)
                return self.compiled[fn](tensors, *args)
            except Exception as e:  # e.g. no Triton, or no C compiler for its launcher: eager from now on
                self.failure = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"fp8 attention: compiling the casts failed, they run eagerly: {self.failure}", stacklevel=3
                )
        return fn(tensors, *args)


KERNELS = _Kernels()


def quantize(*xs: torch.Tensor) -> list[Quantized]:
    """Current per-tensor scaling of each x to e4m3: a reduction for the amax, a pass for the scaled cast, all in one
    compiled call (each call costs host time: the fp8 forward was host-bound with one per tensor). The layout of x is
    kept (SDPA's [B, H, S, D] view of a [B, S, H, D] tensor stays a view's layout, which cuDNN reads as it is)."""
    flat = KERNELS(_quantize_math, list(xs))
    return [Quantized(_dense(flat[i]), flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


def dequantize(datas: list[torch.Tensor], descales: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """data * descale in `dtype` for each pair, in one compiled call; a `data` that cuDNN already wrote in `dtype`
    (its descale is then 1) is returned as it is."""
    todo = [i for i, data in enumerate(datas) if data.dtype != dtype]
    out = list(datas)
    if todo:
        done = KERNELS(_dequantize_math, [datas[i] for i in todo], [descales[i].reshape(()) for i in todo], dtype)
        for i, x in zip(todo, done, strict=True):
            out[i] = x
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """cuDNN needs the head dimension contiguous and real (non-broadcast) strides."""
    return t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous()


@dataclass
class Fp8SdpaState:
    """Delayed scaling of one attention layer's backward: the amax of dQ, dK, dV and dP that its last backward
    returned (kept on the GPU: no synchronisation), times `margin`, gives this backward's scales. Keep one per
    attention layer and pass it on every call; a fresh state calibrates on its first backward. A gradient whose amax
    grows past the margin in one step saturates in that step (TransformerEngine's recipe has the same limit)."""

    margin: float = MARGIN
    amax: torch.Tensor | None = None  # fp32 [4]: dQ, dK, dV, dP (the order of cuDNN's outputs)


# ---------------------------------------------------------------- cuDNN access


def cudnn_frontend(device: torch.device):
    """The frontend module, once the device can run it; raises Fp8AttentionUnavailable with the reason."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Fp8AttentionUnavailable(
            f"fp8 attention needs CUDA tensors on a CUDA GPU (got {device.type} tensors; "
            f"torch.cuda.is_available() is {torch.cuda.is_available()})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise Fp8AttentionUnavailable(
            f"cuDNN's fp8 attention needs compute capability 9.0 (Hopper) or newer; "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
    if not torch.backends.cudnn.version():  # also loads PyTorch's libcudnn before the frontend looks for one
        raise Fp8AttentionUnavailable("this PyTorch build has no cuDNN")
    try:
        import cudnn
    except ImportError as e:
        raise Fp8AttentionUnavailable(
            f"cuDNN's Python frontend is not installed ({e}): pip install {FRONTEND} "
            "(one wheel, no dependencies; carry it where there is no package index)"
        ) from e
    return cudnn


def _handle(cudnn, device: torch.device):
    """One cuDNN handle per GPU, bound to PyTorch's current stream at each call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    cudnn.set_stream(handle=_HANDLES[index], stream=torch.cuda.current_stream(index).cuda_stream)
    return _HANDLES[index]


def _constant(value: float, device: torch.device) -> torch.Tensor:
    key = (str(device), value)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


@dataclass
class _Graph:
    """A built cuDNN graph, its tensors by name, and the dtype it writes O (forward) or dQ/dK/dV (backward) in."""

    graph: object
    tensors: dict[str, object]
    out_dtype: torch.dtype

    def execute(self, cudnn, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
        handle = _handle(cudnn, device)
        workspace = torch.empty(self.graph.get_workspace_size(), dtype=torch.uint8, device=device)
        self.graph.execute({self.tensors[name]: x for name, x in buffers.items()}, workspace, handle=handle)


def _data_type(cudnn, dtype: torch.dtype):
    return {
        E4M3: cudnn.data_type.FP8_E4M3,
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float16: cudnn.data_type.HALF,
        torch.float32: cudnn.data_type.FLOAT,
    }[dtype]


def _new_graph(cudnn, device: torch.device, io_dtype: torch.dtype):
    return cudnn.pygraph(
        io_data_type=_data_type(cudnn, io_dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(cudnn, device),
    )


def _like(cudnn, graph, name: str, t: torch.Tensor):
    return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=_data_type(cudnn, t.dtype))


def _scalars(cudnn, graph, names) -> dict[str, object]:
    return {
        n: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT) for n in names
    }


def _stats_tensor(cudnn, graph, q: torch.Tensor):
    b, h, s, _ = q.shape
    return graph.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=cudnn.data_type.FLOAT)


def _set_output(cudnn, tensor, shape, stride, dtype: torch.dtype) -> None:
    tensor.set_output(True).set_dim(list(shape)).set_stride(list(stride))
    tensor.set_data_type(_data_type(cudnn, dtype))


def _set_scalar_outputs(cudnn, tensors) -> None:
    for t in tensors:
        _set_output(cudnn, t, (1, 1, 1, 1), (1, 1, 1, 1), torch.float32)


def _build(cudnn, graph, what: str) -> None:
    """Validate, lower, pick plans by heuristics (A, then the fallback list) and compile them."""
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except (cudnn.cudnnGraphNotSupportedError, RuntimeError) as e:
        raise Fp8AttentionUnavailable(
            f"cuDNN {cudnn.backend_version()} (frontend {cudnn.__version__}) refused the {what} graph: {e}"
        ) from e


def _cached(key: tuple, builders: list[Callable[[], _Graph]]) -> _Graph:
    """The graph for `key`, built once by the first builder that cuDNN accepts (the preferred output dtype first)."""
    if key not in _GRAPHS:
        refusals = []
        for build in builders:
            try:
                _GRAPHS[key] = build()
                break
            except Fp8AttentionUnavailable as e:
                refusals.append(str(e))
        else:
            raise Fp8AttentionUnavailable("; ".join(refusals))
    return _GRAPHS[key]


def _layout(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)


# ---------------------------------------------------------------- forward


@dataclass
class Fp8Forward:
    """What the fp8 forward leaves for its backward."""

    q: Quantized
    k: Quantized
    v: Quantized
    o: torch.Tensor  # e4m3 on Hopper, else the output dtype
    descale_o: torch.Tensor  # fp32 [1, 1, 1, 1] (1 when O is not fp8)
    stats: torch.Tensor  # fp32 [B, H, S, 1]: the log-sum-exp of each row of scaled scores
    attn_scale: float


def _build_forward(cudnn, device, q8, k8, v8, attn_scale: float, o_dtype: torch.dtype) -> _Graph:
    g = _new_graph(cudnn, device, E4M3)
    t = {n: _like(cudnn, g, n, x) for n, x in (("q", q8), ("k", k8), ("v", v8))}
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    t.update(_scalars(cudnn, g, names))
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        t["q"], t["k"], t["v"], *(t[n] for n in names), attn_scale=attn_scale, generate_stats=True, name="sdpa_fp8"
    )
    _set_output(cudnn, o, q8.shape, q8.stride(), o_dtype)
    b, h, s, _ = q8.shape
    _set_output(cudnn, stats, (b, h, s, 1), (h * s, s, 1, 1), torch.float32)
    _set_scalar_outputs(cudnn, (amax_s, amax_o))
    _build(cudnn, g, f"fp8 SDPA forward ({_dtype_name(o_dtype)} O)")
    return _Graph(g, {**t, "o": o, "stats": stats, "amax_s": amax_s, "amax_o": amax_o}, o_dtype)


def fp8_forward(q: Quantized, k: Quantized, v: Quantized, attn_scale: float, out_dtype: torch.dtype) -> Fp8Forward:
    """cuDNN's fp8 attention forward on quantised q, k, v ([B, H, S, D]); O in `out_dtype` where cuDNN writes it,
    else e4m3 with scale 448 / amax(V)."""
    device = q.data.device
    cudnn = cudnn_frontend(device)
    with torch.cuda.device(device):
        key = ("forward", str(device), _layout(q.data, k.data, v.data), attn_scale, out_dtype)
        graph = _cached(
            key,
            [
                lambda dt=dt: _build_forward(cudnn, device, q.data, k.data, v.data, attn_scale, dt)
                for dt in dict.fromkeys((out_dtype, E4M3))
            ],
        )
        scale_o = fp8_scale(v.amax) if graph.out_dtype == E4M3 else _constant(1.0, device)
        o = torch.empty_like(q.data, dtype=graph.out_dtype)
        b, h, s, _ = q.data.shape
        stats = torch.empty(b, h, s, 1, dtype=torch.float32, device=device)
        amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device)  # of S and O: not used here
        graph.execute(
            cudnn,
            device,
            {
                "q": q.data,
                "k": k.data,
                "v": v.data,
                "descale_q": q.descale,
                "descale_k": k.descale,
                "descale_v": v.descale,
                "descale_s": _constant(1.0 / E4M3_MAX, device),
                "scale_s": _constant(E4M3_MAX, device),
                "scale_o": scale_o,
                "o": o,
                "stats": stats,
                "amax_s": amax[0],
                "amax_o": amax[1],
            },
        )
    return Fp8Forward(q, k, v, o, scale_o.reciprocal(), stats, attn_scale)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- backward

_BACKWARD_SCALARS = (
    "descale_q",
    "descale_k",
    "descale_v",
    "descale_o",
    "descale_do",
    "descale_s",
    "descale_dp",
    "scale_s",
    "scale_dq",
    "scale_dk",
    "scale_dv",
    "scale_dp",
)


@dataclass
class Fp8Grads:
    """One backward kernel's results: dQ, dK, dV as cuDNN wrote them, their dequantisation factors, and the amax of
    dQ, dK, dV and dP (fp32 [4]) for the next scales."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    descale: torch.Tensor  # fp32 [4]: dQ, dK, dV, dP
    amax: torch.Tensor  # fp32 [4]: dQ, dK, dV, dP

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(dequantize([self.dq, self.dk, self.dv], list(self.descale[:3]), dtype))


def _build_backward(cudnn, device, fwd: Fp8Forward, do8: torch.Tensor, grad_dtype: torch.dtype) -> _Graph:
    g = _new_graph(cudnn, device, E4M3)
    inputs = (("q", fwd.q.data), ("k", fwd.k.data), ("v", fwd.v.data), ("o", fwd.o), ("do", do8))
    t = {n: _like(cudnn, g, n, x) for n, x in inputs}
    t["stats"] = _stats_tensor(cudnn, g, fwd.q.data)
    t.update(_scalars(cudnn, g, _BACKWARD_SCALARS))
    outs = g.sdpa_fp8_backward(
        t["q"],
        t["k"],
        t["v"],
        t["o"],
        t["do"],
        t["stats"],
        *(t[n] for n in _BACKWARD_SCALARS),
        attn_scale=fwd.attn_scale,
        name="sdpa_fp8_backward",
    )
    names = ("dq", "dk", "dv", "amax_dq", "amax_dk", "amax_dv", "amax_dp")
    t.update(zip(names, outs, strict=True))
    for name, like in (("dq", fwd.q.data), ("dk", fwd.k.data), ("dv", fwd.v.data)):
        _set_output(cudnn, t[name], like.shape, like.stride(), grad_dtype)
    _set_scalar_outputs(cudnn, outs[3:])
    _build(cudnn, g, f"fp8 SDPA backward ({_dtype_name(grad_dtype)} dQ/dK/dV, {_dtype_name(fwd.o.dtype)} O)")
    return _Graph(g, t, grad_dtype)


def fp8_backward_pass(
    fwd: Fp8Forward, do: Quantized, amax: torch.Tensor, margin: float, grad_dtype: torch.dtype
) -> Fp8Grads:
    """One fp8 backward kernel, with dQ, dK, dV and dP scaled by 448 / (margin * amax) (`amax` fp32 [4]: dQ, dK,
    dV, dP); dQ, dK, dV in `grad_dtype` where cuDNN writes it, else e4m3."""
    device = do.data.device
    cudnn = cudnn_frontend(device)
    with torch.cuda.device(device):
        key = (
            "backward",
            str(device),
            _layout(fwd.q.data, fwd.k.data, fwd.v.data, fwd.o, do.data),
            fwd.attn_scale,
            grad_dtype,
        )
        graph = _cached(
            key,
            [
                lambda dt=dt: _build_backward(cudnn, device, fwd, do.data, dt)
                for dt in dict.fromkeys((grad_dtype, E4M3))
            ],
        )
        scale = fp8_scale(amax * margin)
        if graph.out_dtype != E4M3:
            scale = torch.cat([torch.ones_like(scale[:3]), scale[3:]])  # cuDNN writes them unscaled
        descale = scale.reciprocal()
        grads = {
            n: torch.empty_like(x, dtype=graph.out_dtype)
            for n, x in (("dq", fwd.q.data), ("dk", fwd.k.data), ("dv", fwd.v.data))
        }
        amax_out = torch.empty(4, dtype=torch.float32, device=device)
        graph.execute(cudnn, device, {**_backward_inputs(fwd, do), **grads, **_per_output(scale, amax_out)})
    return Fp8Grads(grads["dq"], grads["dk"], grads["dv"], descale, amax_out)


def _backward_inputs(fwd: Fp8Forward, do: Quantized) -> dict[str, torch.Tensor]:
    device = do.data.device
    return {
        "q": fwd.q.data,
        "k": fwd.k.data,
        "v": fwd.v.data,
        "o": fwd.o,
        "do": do.data,
        "stats": fwd.stats,
        "descale_q": fwd.q.descale,
        "descale_k": fwd.k.descale,
        "descale_v": fwd.v.descale,
        "descale_o": fwd.descale_o,
        "descale_do": do.descale,
        "descale_s": _constant(1.0 / E4M3_MAX, device),
        "scale_s": _constant(E4M3_MAX, device),
    }


def _per_output(scale: torch.Tensor, amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scale and amax tensors of dQ, dK, dV and dP (elements of [4] tensors), and dP's descale."""
    buffers = {"descale_dp": _element(scale.reciprocal(), 3)}
    for i, name in enumerate(("dq", "dk", "dv", "dp")):
        buffers[f"scale_{name}"] = _element(scale, i)
        buffers[f"amax_{name}"] = _element(amax, i)
    return buffers


def _element(x: torch.Tensor, i: int) -> torch.Tensor:
    """Element i of a [4] tensor as the [1, 1, 1, 1] scalar tensor cuDNN takes (a view: same memory)."""
    return x[i : i + 1].view(1, 1, 1, 1)


def calibrated_backward(fwd: Fp8Forward, do: Quantized, grad_dtype: torch.dtype) -> Fp8Grads:
    """Exact current scaling in three kernels. The amax cuDNN returns is taken before its output is scaled, and dP
    does not depend on any output scale: the first kernel (dP scaled by `dp_bound`) gives the amax of dP and dV; the
    second, with dP at its own scale, the amax of dQ and dK, which depend on how dP was rounded; the third repeats the
    second's arithmetic with every scale exact, so nothing overflows."""
    d = fwd.q.data.shape[-1]
    bound = dp_bound(do.amax, fwd.v.amax, d, fwd.attn_scale).reshape(1)
    amax = torch.cat([torch.ones_like(bound).expand(3), bound])  # dQ, dK, dV outputs of this kernel are discarded
    for _ in range(2):
        amax = fp8_backward_pass(fwd, do, amax, 1.0, grad_dtype).amax
    return fp8_backward_pass(fwd, do, amax, 1.0, grad_dtype)


def fp8_backward(fwd: Fp8Forward, grad_out: torch.Tensor, state: Fp8SdpaState | None) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV in grad_out's dtype: dO quantised per tensor, then one kernel with the state's delayed scales, or
    the three of `calibrated_backward` without a state or on its first call."""
    (do,) = quantize(grad_out)
    if state is None or state.amax is None:
        grads = calibrated_backward(fwd, do, grad_out.dtype)
    else:
        grads = fp8_backward_pass(fwd, do, state.amax, state.margin, grad_out.dtype)
    if state is not None:
        state.amax = grads.amax
    return grads.dequantized(grad_out.dtype)


# ---------------------------------------------------------------- the forward-only variant's bf16 backward


def _build_high_backward(cudnn, device, tensors: dict[str, torch.Tensor], attn_scale: float) -> _Graph:
    q = tensors["q"]
    g = _new_graph(cudnn, device, q.dtype)
    t = {n: _like(cudnn, g, n, x) for n, x in tensors.items()}
    t["stats"] = _stats_tensor(cudnn, g, q)
    outs = g.sdpa_backward(
        t["q"], t["k"], t["v"], t["o"], t["do"], t["stats"], attn_scale=attn_scale, name="sdpa_backward"
    )
    for name, out, like in zip(("dq", "dk", "dv"), outs, ("q", "k", "v"), strict=True):
        _set_output(cudnn, out, tensors[like].shape, tensors[like].stride(), q.dtype)
        t[name] = out
    _build(cudnn, g, f"{_dtype_name(q.dtype)} SDPA backward")
    return _Graph(g, t, q.dtype)


def high_precision_backward(q, k, v, out, grad_out, stats, attn_scale: float) -> tuple[torch.Tensor, ...]:
    """cuDNN's bf16 (fp16) attention backward on the unquantised q, k, v, the fp8 forward's dequantised output and
    its softmax statistics (both forwards write the log-sum-exp of the scaled scores)."""
    device = q.device
    cudnn = cudnn_frontend(device)
    tensors = {"q": q, "k": k, "v": v, "o": out, "do": _dense(grad_out)}
    with torch.cuda.device(device):
        key = ("high_backward", str(device), _layout(*tensors.values()), attn_scale)
        graph = _cached(key, [lambda: _build_high_backward(cudnn, device, tensors, attn_scale)])
        grads = {n: torch.empty_like(tensors[like]) for n, like in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
        graph.execute(cudnn, device, {**tensors, "stats": stats, **grads})
    return grads["dq"], grads["dk"], grads["dv"]


# ---------------------------------------------------------------- autograd and the public functions


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: float) -> tuple[Fp8Forward, torch.Tensor]:
    fwd = fp8_forward(*quantize(q, k, v), attn_scale, q.dtype)
    return fwd, dequantize([fwd.o], [fwd.descale_o], q.dtype)[0]


class _Fp8Sdpa(torch.autograd.Function):
    """fp8 forward, fp8 backward. The quantised tensors are intermediates, kept on ctx; an output that cuDNN wrote
    in the output dtype is saved with save_for_backward (on ctx it would make a reference cycle)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_scale: float, state: Fp8SdpaState | None):
        fwd, out = _forward(q, k, v, attn_scale)
        if fwd.o is out:
            fwd.o = None
            ctx.save_for_backward(out)
        ctx.fwd, ctx.state = fwd, state
        return out

    @staticmethod
    def backward(ctx, grad_out):
        fwd, ctx.fwd = ctx.fwd, None
        if fwd.o is None:
            (fwd.o,) = ctx.saved_tensors
        return (*fp8_backward(fwd, grad_out, ctx.state), None, None)


class _Fp8ForwardSdpa(torch.autograd.Function):
    """fp8 forward, bf16 backward (cuDNN's, on the unquantised inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_scale: float):
        fwd, out = _forward(q, k, v, attn_scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.stats, ctx.attn_scale = fwd.stats, attn_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = high_precision_backward(*ctx.saved_tensors, grad_out, ctx.stats, ctx.attn_scale)
        ctx.stats = None
        return (*grads, None)


def _prepare(q, k, v, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Check the call as torch SDPA's ([B, H, S, D], one dtype, D shared; no mask, no dropout, not causal)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"fp8 attention takes [B, H, S, D] tensors; got {q.dim()}, {k.dim()}, {v.dim()} dimensions")
    if q.dtype not in _IO_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"fp8 attention takes bf16 or fp16 q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"fp8 attention needs one head dim and matching k, v; got {q.shape}, {k.shape}, {v.shape}")
    cudnn_frontend(q.device)  # the reason it cannot run, before any work
    attn_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _dense(q), _dense(k), _dense(v), attn_scale


def fp8_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, state: Fp8SdpaState | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v as F.scaled_dot_product_attention computes it (q, k, v [B, H, S, D] bf16 or fp16,
    no mask; scale defaults to 1/sqrt(D)), with cuDNN's fp8 kernels forward and backward (module docstring). Pass
    the attention layer's `Fp8SdpaState` for a one-kernel backward; without one each backward calibrates (three)."""
    q, k, v, attn_scale = _prepare(q, k, v, scale)
    return _Fp8Sdpa.apply(q, k, v, attn_scale, state)


def fp8_forward_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """As `fp8_sdpa`, but only the forward in fp8: the backward is cuDNN's bf16 (fp16) one on the unquantised inputs,
    so the gradients carry only the forward's error through O and the softmax statistics."""
    q, k, v, attn_scale = _prepare(q, k, v, scale)
    return _Fp8ForwardSdpa.apply(q, k, v, attn_scale)
