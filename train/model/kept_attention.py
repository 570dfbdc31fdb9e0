"""A checkpointed transformer block that keeps its attention output, so that its recomputation skips attention.

torch's non-reentrant checkpoint (torch.utils.checkpoint, as components.checkpoint_first applies it) frees what a
block saved for its backward and runs the whole block again in the backward. The attention kernel is the costly
part of that second forward (about a third of a Qwen-Image block's forward at 12.5k tokens), yet its backward needs
only q, k and v (projections, norms and the rotary embedding: cheap to recompute) and the attention's output and
log-sum-exp. Those two are small (the output is one activation of the block's width in bf16; the log-sum-exp one
float per head and token), so a block that keeps them trades ~81 MB at 12.5k tokens for the attention forward's
time in every recomputation (docs/levers.md, lever 27; the memory plan decides how many blocks keep it).

How:
- `keep(block, module)` marks the block's attention processor with the backend name BACKEND and `install(module)`s
  a replacement of diffusers' `dispatch_attention_fn` as the family's transformer module sees it (the family record's
  `attention_module`; Qwen-Image's, as its rope.py replaces its rotary function there): a marked processor's
  attention without mask, dropout or causality, while gradients are on, runs as the custom op
  `qwen_edit::kept_attention(q, k, v, scale) -> (out, lse)`. Everything else, and
  every unmarked block, goes to diffusers: on one H200 a block whose attention ran as the op was ~0.8 ms slower
  per forward and backward at 12,984 tokens (`python -m train.bench --block_probe`, docs/levers.md, lever 27),
  so only the blocks that keep their attention pay it. torch.compile specialises each compiled block on the mark.
- The op runs the fused kernel that torch's own SDPA would choose for these inputs (cuDNN or FlashAttention on
  CUDA, the flash kernel on the CPU) through its aten op, which returns the log-sum-exp; its backward is the same
  kernel's backward op, also a custom op. Both are opaque to torch.compile, so the compiled blocks call them.
  `use_kernel("fa4")` puts FlashAttention-4's kernels (train/model/flash4.py) in that place, for a measurement.
- `Stash.run` wraps a block's call inside `checkpoint(...)`: the first call (the forward) records each attention's
  (out, lse), the second (the recomputation in the backward) gets them back from the op instead of running the
  kernel, and drops them. The stash is found through a thread-local: the recomputation runs in the autograd
  engine's thread.
tests/test_kept_attention.py checks losses and gradients against plain checkpointing, and that the recomputation
does not run the kernel.
"""

import importlib
import threading

import torch
from diffusers.models import attention_dispatch

_DIFFUSERS = attention_dispatch.dispatch_attention_fn
_local = threading.local()  # .stash: the Stash of the block call running in this thread, if any
_cuda_ok = False  # detect_cuda() sets it: the CUDA device has the fused kernels (compute capability >= 8.0)
_backends: dict = {}  # (device type, dtype, head dim) -> the SDPBackend chosen at the first forward
_SDP = torch.nn.attention.SDPBackend
_external = None  # a kernel module (forward, backward) in place of SDPA's kernel: use_kernel("fa4") sets flash4.py
_split_text = False  # train.bench's A/B (--ab_lever text_calls): causal calls as if aligned top-left on every kernel
_copy_outputs = False  # train.bench's A/B (--ab_lever fa4_into): outputs copied where they belong, never written there
BACKEND = "qwen_edit_kept"  # the mark on a keeping block's attention processor (its _attention_backend)
# cuDNN's log-sum-exp is (B, H, S, 1) from torch 2.9 on, (B, H, S) before; its backward takes it as its forward gave it
_CUDNN_LSE_4D = torch.torch_version.TorchVersion(torch.__version__) >= "2.9"


class Stash:
    """The attention outputs of one checkpointed block call: recorded by its forward, replayed by its
    recomputation. Use a new Stash for each call: checkpoint(Stash().run, block.__call__, *args)."""

    def __init__(self):
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._calls = 0
        self.replaying = False

    def run(self, fn, *args, **kwargs):
        if not torch.is_grad_enabled():  # no backward will recompute this call
            return fn(*args, **kwargs)
        self.replaying = self._calls > 0
        self._calls += 1
        previous = getattr(_local, "stash", None)
        _local.stash = self
        try:
            return fn(*args, **kwargs)
        finally:
            _local.stash = previous
            if self.replaying:  # the backward has what it needs; checkpoint may also stop the recomputation early
                self._saved.clear()

    def record(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        # Copies: the compiled block owns the op's output buffers and the checkpoint frees what it saved.
        self._saved.append((out.clone(), lse.clone()))

    def replay(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._saved.pop(0) if self._saved else None


def kept_bytes(batch: int, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What one block keeps: its attention output (batch x tokens x heads x head_dim) and the float32 log-sum-exp."""
    return batch * tokens * heads * (head_dim * dtype_bytes + 4)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the op has a kernel for attention in `dtype` on `device`: any float dtype on the CPU; bf16 or fp16 on
    a CUDA GPU of compute capability 8.0 or newer (cuDNN or FlashAttention)."""
    if device.type == "cpu":
        return dtype.is_floating_point
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
            and dtype in (torch.bfloat16, torch.float16))


def keep(block: torch.nn.Module, module: str) -> None:
    """Mark a diffusers transformer block: its attention runs as the op (and install the dispatch in `module`, the
    diffusers module that defines the block, e.g. Qwen-Image's diffusers.models.transformers.transformer_qwenimage)."""
    install(module)
    block.attn.processor._attention_backend = BACKEND


def install(module: str) -> None:
    """Route marked blocks' attention calls in `module` through `dispatch` (idempotent; unmarked blocks go on to
    diffusers')."""
    detect_cuda()
    importlib.import_module(module).dispatch_attention_fn = dispatch


def detect_cuda() -> None:
    """Read once, outside any compiled code, whether the CUDA device has the fused kernels (for eligible())."""
    global _cuda_ok
    _cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def eligible(query: torch.Tensor) -> bool:
    """available() for `query` (B, S, H, D), in a form torch.compile traces (the capability read by detect_cuda(),
    which install() and the users of fused_forward call first)."""
    if query.device.type == "cpu":
        return query.dtype.is_floating_point
    return query.device.type == "cuda" and _cuda_ok and query.dtype in (torch.bfloat16, torch.float16)


def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             attention_kwargs=None, *, backend=None, parallel_config=None):
    """diffusers' dispatch_attention_fn, with the op for the calls of marked blocks it can serve (layout B, S, H, D in
    and out)."""
    if backend == BACKEND:
        if (parallel_config is None and attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa
                and not attention_kwargs and torch.is_grad_enabled() and eligible(query)):
            q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
            out, _ = torch.ops.qwen_edit.kept_attention(q, k, v, scale)
            return out.permute(0, 2, 1, 3)
        backend = None  # diffusers' default
    return _DIFFUSERS(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                      backend=backend, parallel_config=parallel_config)


def backend(q: torch.Tensor) -> _SDP:
    """The fused kernel torch's SDPA picks for q (chosen once per device type, dtype and head dim)."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _backends:
        if q.device.type == "cpu":
            _backends[key] = _SDP.FLASH_ATTENTION
        else:
            choice = _SDP(torch._fused_sdp_choice(q, q, q))
            _backends[key] = choice if choice in (_SDP.CUDNN_ATTENTION, _SDP.FLASH_ATTENTION) else (
                _SDP.FLASH_ATTENTION)
    return _backends[key]


def _like(t: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """t with layout's strides (a copy only when they differ): the ops' outputs are declared with their inputs'."""
    return t if t.stride() == layout.stride() else torch.empty_like(layout).copy_(t)


def use_kernel(name: str, device: torch.device) -> None:
    """The fused kernel of fused_forward / fused_backward from now on: "sdpa" (the default: the one torch's SDPA
    picks) or "fa4" (FlashAttention-4, train/model/flash4.py; a RuntimeError naming the fix when it cannot run on
    `device`)."""
    global _external
    if name not in ("sdpa", "fa4"):
        raise ValueError(f"attention kernel {name!r}: choose 'sdpa' or 'fa4'")
    if name == "fa4":
        from train.model import flash4

        flash4.check(device)
    _external = flash4 if name == "fa4" else None


def causal_bottom_right() -> bool:
    """Whether a causal fused call with fewer queries (S) than keys (K) aligns its triangle bottom-right (query i sees
    keys 0..i + K - S), as FlashAttention-4's does, rather than top-left (keys 0..i), as SDPA's kernels do."""
    return _external is not None and getattr(_external, "CAUSAL_BOTTOM_RIGHT", False) and not _split_text


def split_text_calls(on: bool) -> None:
    """train.bench's A/B: plan causal calls as if the kernel aligned them top-left (on) or as it does (off)."""
    global _split_text
    _split_text = on


def choose_kernel(setting: str, device: torch.device) -> str:
    """train.attention_kernel resolved and put in use (use_kernel) for training on `device`: "auto" is "fa4" where
    FlashAttention-4 can run there (installed, compute capability 9.0 or newer), else "sdpa". Returns the kernel."""
    if setting == "auto":
        from train.model import flash4

        try:
            flash4.check(device)
            setting = "fa4"
        except RuntimeError:
            setting = "sdpa"
    use_kernel(setting, device)
    return setting


def writes_into() -> bool:
    """Whether the kernel in use writes into output tensors it is given (FlashAttention-4's), so that a caller's views
    of a larger output are filled without a copy (unless train.bench's A/B has it copy: copy_outputs)."""
    return _external is not None and getattr(_external, "WRITES_INTO", False) and not _copy_outputs


def copy_outputs(on: bool) -> None:
    """train.bench's A/B: have the kernel return new outputs that are then copied where they belong (on), or write
    into them where it can (off)."""
    global _copy_outputs
    _copy_outputs = on


def fused_forward(q, k, v, scale, is_causal: bool = False, out=None, lse=None):
    """(out, lse) of one fused SDPA kernel call on (B, H, S, D) tensors: out has q's strides, lse is (B, H, S) float32.
    is_causal: aligned as causal_bottom_right() says (the callers make non-square causal calls only where it is).
    Given `out` and `lse` (views of a larger attention's, say), the results land there (written by the kernel where
    writes_into(), else copied) and those are returned."""
    b, h, s = q.shape[:3]
    kind = backend(q)
    if writes_into():
        o, m = _external.forward(q, k, v, scale, is_causal, out=out, lse=lse)
        return (_like(o, q) if out is None else o), m
    if _external is not None:
        o, m = _external.forward(q, k, v, scale, is_causal)
    elif q.device.type == "cpu":
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    elif kind == _SDP.CUDNN_ATTENTION:
        o, m = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                   scale=scale)[:2]
    else:
        o, m = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    m = m.reshape(b, h, s)
    if out is None:
        return _like(o, q), m.contiguous()
    out.copy_(o)
    return out, (m.contiguous() if lse is None else lse.copy_(m))


def fused_backward(grad, q, k, v, out, lse, scale, is_causal: bool = False, into: tuple = (None, None, None)):
    """(dq, dk, dv) of fused_forward's call by the same kernel's backward, each with its input's strides. `out` and
    `lse` may be those of a larger attention that this call is one part of (the same queries over more keys,
    merged by log-sum-exp): the gradients are then this part's share of that attention's. Where `into` gives a tensor
    for one of them, it lands there (written by the kernel where writes_into(), else copied) and that is returned."""
    grad = _like(grad, out)
    if writes_into():
        grads = _external.backward(grad, q, k, v, out, lse, scale, is_causal, into=into)
        return tuple(_like(g, x) if given is None else g for g, x, given in zip(grads, (q, k, v), into, strict=True))
    if _external is not None:
        grads = _external.backward(grad, q, k, v, out, lse, scale, is_causal)
    elif q.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0,
                                                                                     is_causal, scale=scale)
    elif backend(q) == _SDP.CUDNN_ATTENTION:
        zero = torch.zeros((), dtype=torch.long, device=q.device)  # the dropout's seed and offset: no dropout
        lse = lse.unsqueeze(-1) if _CUDNN_LSE_4D else lse
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, zero, zero, None, None, None, q.shape[2], k.shape[2], 0.0, is_causal,
            scale=scale)
    else:
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, is_causal, zero, zero, scale=scale)
    return tuple(_like(g, x) if given is None else given.copy_(g)
                 for g, x, given in zip(grads, (q, k, v), into, strict=True))


@torch.library.custom_op("qwen_edit::kept_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float? scale) -> (Tensor, Tensor)")
def kept_attention(q, k, v, scale):
    """(out, lse) of softmax(q k^T * scale) v for q, k, v (B, H, S, D); out has q's strides, lse is (B, H, S) float32.
    Inside a Stash's recomputation it returns what the forward recorded."""
    stash = getattr(_local, "stash", None)
    if stash is not None and stash.replaying:
        kept = stash.replay()
        if kept is not None:
            return kept
    out, lse = fused_forward(q, k, v, scale)
    if stash is not None:
        stash.record(out, lse)
    return out, lse


@kept_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("qwen_edit::kept_attention_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? scale) "
                                "-> (Tensor, Tensor, Tensor)")
def kept_attention_backward(grad, q, k, v, out, lse, scale):
    """(dq, dk, dv) of kept_attention by the backward of the kernel that ran its forward; each with its input's
    strides."""
    return fused_backward(grad, q, k, v, out, lse, scale)


@kept_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = kept_attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


kept_attention.register_autograd(_backward, setup_context=_setup_context)
