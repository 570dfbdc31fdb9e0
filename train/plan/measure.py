"""Blocks measured: what a block keeps for its backward, plain and checkpointed, the pass's transient and a block's
forward and backward times, from a one- and a two-block transformer of the real width prepared exactly as training
prepares it (LoRA, fp8, compiled), run forward and backward at the largest shape bucket of the dataset; the
difference between the two is one block, the rest is the head. Also the encoders' transient while encoding online
and a validation render's transients. Needs the GPU it measures (the byte counts are CUDA's)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from train.plan import arch
from train.plan.sizes import GB
from train.plan.workload import Workload

VL_ACTIVATION_BYTES = 1 * GB  # the VL model's activations for an encode (no gradients): an allowance


@dataclass(frozen=True)
class Measured:
    """One short measurement at the largest bucket, bytes and seconds (the letters of predict.py's docstring)."""

    act_bytes: float  # A
    ckpt_bytes: float  # S
    transient_bytes: float  # T
    fwd_s: float  # one block's forward
    fwd_bwd_s: float  # one block's forward and backward
    h2d_bytes_per_s: float = 25e9  # pinned host -> device copies
    encode_bytes: float = 0.0  # the encoders' activations while encoding (online)
    ckpt_transient_bytes: float | None = None  # T when blocks are checkpointed (a recomputation is in it); None = T + A
    render_forward_bytes: float | None = None  # R: a validation render's transformer pass; None = validation off
    render_vae_bytes: float = 0.0  # V untiled (math.inf: it did not fit the budget even alone)
    render_vae_tiled_bytes: float = 0.0  # V with inference.vae_tiling
    kept_bytes: float = 0.0  # X: what a checkpointed block that keeps its attention output holds (0 = no kernel)
    kept_recompute_s: float | None = None  # that block's recomputation (attention skipped); None = fwd_s


def _run(
    models: list, inputs: dict, device: torch.device, warmup: int = 2, repeats: int = 5
) -> list[tuple[float, float, list[float], list[float]]]:
    """For each model: (kept after forward, peak above that in the backward, forward s and forward+backward s of
    each timed pass), the memory of its last pass. The passes alternate between the models, `warmup` untimed
    rounds (the first compiles) then `repeats` timed ones, so that a drift of the GPU's clocks or of the host's
    load during the measurement reaches every model alike and cancels in the differences measure takes: run one
    model after the other, one H200 measured a v1 block's forward at 6.3 ms and, in the next run, 3.3 ms."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = [[0.0, 0.0, [], []] for _ in models]
    for i in range(warmup + repeats):
        for model, result in zip(models, results, strict=True):
            sync()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss = model(**inputs)[0].float().square().mean()
            sync()
            t1 = time.perf_counter()
            after_fwd = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss.backward()
            sync()
            t2 = time.perf_counter()
            result[0], result[1] = after_fwd - base, torch.cuda.max_memory_allocated(device) - after_fwd
            if i >= warmup:
                result[2].append(t1 - t0)
                result[3].append(t2 - t0)
            del loss
            model.zero_grad(set_to_none=True)
    return [tuple(r) for r in results]


def _median_difference(more: list[float], fewer: list[float]) -> float:
    """The median of the paired differences of two models' timed passes of one round (_run): a block's time."""
    return statistics.median(a - b for a, b in zip(more, fewer, strict=True))


def _block_runs(
    model_dir: str | Path, w: Workload, dtype: torch.dtype, device: torch.device, checkpointed: bool, prepare: dict
) -> list[tuple[float, float, list[float], list[float]]]:
    """_run of a one- and a two-block transformer at workload `w`, prepared for training as `prepare` says
    (arch.prepare_for_training's keywords), checkpointed or not; both freed before it returns."""
    models = [arch.mini_transformer(model_dir, layers, dtype, device) for layers in (1, 2)]
    for model in models:
        arch.prepare_for_training(model, checkpointed=checkpointed, **prepare)
        model.train()
    runs = _run(models, arch.block_inputs(models[0], w, dtype, device), device)
    del models, model
    torch.cuda.empty_cache()
    return runs


def measure(
    model_dir: str | Path,
    w: Workload,
    dtype: torch.dtype,
    device: torch.device,
    mode: str,
    lora,
    fp8_base: bool,
    compile_blocks: bool,
    kept: bool = True,
    fp8_fast_accum: bool = False,
) -> Measured:
    """A, S, T and block times at workload `w` from a one- and a two-block transformer, each run plain and
    checkpointed (the module docstring). With `kept` (and a kernel for it) the checkpointed blocks keep their
    attention output: X (kept_bytes) is counted, S is what the block holds besides it, and the difference of the
    checkpointed and plain block times is a kept block's recomputation. fp8_fast_accum: the fp8 matmuls as
    train.fp8_fast_accum runs them. Seconds, plus compilation."""
    from train.model import kept_attention

    keep = kept and kept_attention.available(device, dtype) and arch.keeps_attention(model_dir)
    prepare = dict(
        mode=mode,
        lora=lora,
        compile_blocks=compile_blocks,
        fp8_base=fp8_base,
        kept_attention_blocks=-1 if keep else 0,
        fp8_fast_accum=fp8_fast_accum,
    )
    (k1, t1, f1, b1), (k2, t2, f2, b2) = _block_runs(model_dir, w, dtype, device, False, prepare)
    (k1c, t1c, _, b1c), (k2c, t2c, _, b2c) = _block_runs(model_dir, w, dtype, device, True, prepare)
    heads, head_dim = arch.attention_dims(model_dir)
    tokens = w.image_tokens + w.text_tokens
    x = kept_attention.kept_bytes(w.batch, tokens, heads, head_dim, dtype.itemsize) if keep else 0
    act, ckpt = max(k2 - k1, 0.0), max(k2c - k1c - x, 0.0)
    head, head_c = max(k1 - act, 0.0), max(k1c - x - ckpt, 0.0)
    fwd, both = max(_median_difference(f2, f1), 1e-6), max(_median_difference(b2, b1), 1e-6)
    kept_recompute_s = min(max(_median_difference(b2c, b1c) - both, 0.0), fwd) if keep else None
    return Measured(
        act,
        ckpt,
        head + max(t1, t2),
        fwd,
        both,
        _h2d_rate(device),
        ckpt_transient_bytes=head_c + max(t1c, t2c),
        kept_bytes=x,
        kept_recompute_s=kept_recompute_s,
    )


def _h2d_rate(device: torch.device, nbytes: int = 1 << 28) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes / max(time.perf_counter() - t0, 1e-9)


def peak_above(device: torch.device, call, repeats: int = 2) -> float:
    """Bytes `call` allocates above what is allocated before it (without gradients; the last of `repeats`, the
    first warms the kernels' workspaces); math.inf when it runs out of memory (it cannot fit the budget)."""
    peak = 0.0
    try:
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                out = call()
            del out
            torch.cuda.synchronize(device)
            peak = float(torch.cuda.max_memory_allocated(device) - base)
    except torch.cuda.OutOfMemoryError:
        peak = float("inf")
    torch.cuda.empty_cache()
    return peak


def measure_render(
    m: Measured,
    model_dir: str | Path,
    w: Workload,
    dtype: torch.dtype,
    vae_dtype: torch.dtype,
    device: torch.device,
    mode: str,
    lora,
    fp8_base: bool,
    online: bool,
    vae_2d_frames: bool = True,
) -> Measured:
    """`m` with R and V (predict.py's docstring) at the render workload `w`: a one-block transformer prepared as
    training prepares it, eager (expected to bound the compiled pass the renders run; not checked on a GPU yet), run
    forward without gradients, and the VAE decoding a latent of the render's target size, untiled and tiled (online
    also encoding an image of that size, as the render encodes its references; the larger counts), on the path
    model.vae_2d_frames chooses. A second or two."""
    forward = _render_forward_bytes(model_dir, w, dtype, device, mode, lora, fp8_base)  # its model freed here
    vae = arch.load_vae(model_dir, vae_dtype, device, vae_2d_frames)
    untiled, tiled = (_vae_transient(vae, w, tiling, online) for tiling in (False, True))
    return dataclasses.replace(m, render_forward_bytes=forward, render_vae_bytes=untiled, render_vae_tiled_bytes=tiled)


def _render_forward_bytes(model_dir, w: Workload, dtype, device, mode: str, lora, fp8_base: bool) -> float:
    model = arch.mini_transformer(model_dir, 1, dtype, device)
    arch.prepare_for_training(model, mode, lora, False, False, fp8_base)
    model.eval()
    inputs = arch.block_inputs(model, w, dtype, device)
    return peak_above(device, lambda: model(**inputs)[0])


def _vae_transient(vae, w: Workload, tiled: bool, online: bool) -> float:
    vae.use_tiling = tiled  # as replay.preserved_training_state sets it for a render
    decode = peak_above(vae.device, arch.vae_decode(vae, w.target_hw))
    if not online:
        return decode
    return max(decode, peak_above(vae.device, arch.vae_encode(vae, 1, w.target_hw)))


def encode_transient(model_dir: str | Path, device: torch.device, work: Workload, vae_2d_frames: bool = True) -> float:
    """Bytes an encode allocates above the encoders' weights: the VAE encoding the largest target of `work` at its
    size, measured (the peak of the two), plus VL_ACTIVATION_BYTES for the VL model's activations (a few thousand
    tokens without gradients: far smaller). vae_2d_frames: the VAE's path (model.vae_2d_frames); diffusers' own
    keeps a copy of every layer's input for a next chunk, ~1.5 GB more at 1 MP."""
    vae = arch.load_vae(model_dir, torch.bfloat16, device, vae_2d_frames)
    peak = peak_above(device, arch.vae_encode(vae, work.batch, work.target_hw), repeats=1)
    del vae
    torch.cuda.empty_cache()
    return peak + VL_ACTIVATION_BYTES
