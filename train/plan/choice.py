"""The choice: the fastest setting whose predicted peak GPU memory (train/plan/predict.py) fits `budget - margin`,
or why none does. Pure: it predicts and compares, and says nothing in words (train/plan/explain.py does).

The knobs it chooses, in the order that costs speed least: the fp8 base (faster and smaller; its transposed copy
when it fits), activation checkpointing of the first N blocks (and how many of them keep their attention output),
offloading the frozen weights of the first K <= N blocks to pinned host memory (train/model/offload.py), and for
online encoding, training from the cache instead (the encoders then never share the GPU with training). A key set
in the config is never changed. A setting fits only when its pinned host bytes fit the node too (host_bytes,
train/plan/host.py): the plan then picks the fastest that fits both, which offloads fewer blocks and checkpoints
more, or trains from the cache, where the host is short.

The last resort, tried only when no setting of those knobs fits: DeepSpeed's own optimizer offload
(zero_optimization.offload_optimizer = {device: cpu, pin_memory: true}, ZeRO stage 1 or 2), which costs a host
step per optimizer step. It is offered only when `offload_blocker` is None (keys.optimizer_offload_blocker:
Adam/AdamW, ZeRO stage 1 or 2, the host's room) or the DeepSpeed config sets zero_optimization.offload_optimizer
itself (then the plan counts what it says).

Validation renders (validation.file set) must fit too, the first before step 1: the plan fits max(peak,
peak_render); when only the render does not fit it turns on inference.vae_tiling (when the config does not set it)
before it costs the step anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.measure import Measured
from train.plan.predict import Choice, Prediction, fits_host, host_bytes, predict
from train.plan.sizes import Sizes

ONLINE_SLACK = 1.1  # online encoding is kept while its step is at most this much slower than the cached one's
OFFLOAD_KEY = "zero_optimization.offload_optimizer"  # DeepSpeed's key: in `fixed` when its config sets it
MOST_RANKS = 1024  # the largest data-parallel world a full fine-tune's no-fit looks at


@dataclass(frozen=True)
class FullRanks:
    """A full fine-tune that fits no GPU as the run is: the fewest data-parallel ranks over which ZeRO stage 2 splits
    the optimizer state enough for an allowed setting to fit (every GPU holds the whole bf16 model), and what each
    GPU then needs; `ranks` None when no number up to MOST_RANKS does."""

    ranks: int | None
    per_gpu_bytes: float = 0.0


@dataclass(frozen=True)
class NoFit:
    """Why no setting fits: choose's answer when nothing does. `kind`:
    "no candidate": the config's explicit keys allow no setting at all;
    "host": settings fit the GPU but pin more host memory than the node has; `smallest` pins the least;
    "render": the training step fits, a validation render does not; `smallest` has the smallest render peak;
    "budget": nothing fits the GPU; `smallest` needs the least."""

    kind: Literal["no candidate", "host", "render", "budget"]
    budget: float  # bytes the run may use
    margin: float  # bytes kept free of them
    smallest: Choice | None = None
    needs_bytes: float = 0.0  # what `smallest` needs: pinned host bytes (host), a render's peak, or its GPU peak
    offload: Choice | None = None  # budget: the smallest setting with DeepSpeed's optimizer offload, ruled out
    offload_needs_bytes: float = 0.0
    blocker: str | None = None  # why DeepSpeed cannot offload this run's optimizer (with `offload`)
    full_ranks: FullRanks | None = None  # budget, full fine-tuning: the data-parallel world that would fit it

    @property
    def room(self) -> float:
        return self.budget - self.margin


def _checkpoint_counts(n: int, fixed: dict) -> list[int]:
    """The numbers of checkpointed blocks the config's keys allow."""
    if "train.gradient_checkpointing" in fixed and not fixed["train.gradient_checkpointing"]:
        return [0]
    if "train.checkpoint_blocks" in fixed:
        return [fixed["train.checkpoint_blocks"] or n]
    return list(range(1 if fixed.get("train.gradient_checkpointing") else 0, n + 1))


def candidates(s: Sizes, fixed: dict, fp8_ok: bool, online: bool, render: bool = False):
    """Every Choice the config's explicit keys (`fixed`, dotted key -> value) allow; with `render` (validation on)
    untiled and tiled VAE decodes of the validation renders."""
    fp8s = [fixed["train.fp8_base"]] if "train.fp8_base" in fixed else [True, False]
    fp8_ok = fp8_ok and not s.full
    cached = [fixed["data.cache"] != "off"] if "data.cache" in fixed else [False, True]
    if not online:
        cached = [True]
    offloads = [fixed[OFFLOAD_KEY]] if OFFLOAD_KEY in fixed else [False, True]
    tilings = (
        ([fixed["inference.vae_tiling"]] if "inference.vae_tiling" in fixed else [False, True]) if (render) else [None]
    )
    kept = fixed.get("train.kept_attention_blocks", 0)  # free: 0 here, raised by choose as far as it fits
    for fp8_base in fp8s:
        if fp8_base and not fp8_ok:
            continue
        transposed = [fixed["train.fp8_transposed"]] if "train.fp8_transposed" in fixed else [True, False]
        for fp8_t in transposed if fp8_base else [False]:
            for ck in _checkpoint_counts(s.num_blocks, fixed):
                offs = [fixed["train.offload_blocks"]] if "train.offload_blocks" in fixed else range(0, ck + 1)
                offs = [0] if s.full else offs  # full fine-tuning offloads with ZeRO, not this
                for off in offs:
                    if off <= ck:
                        for cache in cached:
                            for opt in offloads:
                                for tiled in tilings:
                                    yield Choice(
                                        fp8_base, fp8_t, ck, off, cache, opt, tiled, ck if kept < 0 else min(kept, ck)
                                    )


Scored = tuple[Choice, Prediction]


def choose(
    s: Sizes,
    m: Measured,
    budget: float,
    margin: float,
    fixed: dict,
    fp8_ok: bool,
    online: bool,
    offload_blocker: str | None = None,
    host: Host = UNCOUNTED_HOST,
) -> Scored | NoFit:
    """The fastest setting whose predicted peak fits `budget - margin` bytes (ties: the smaller peak), or NoFit.
    Online encoding, when that is the config's, is kept while its best step is within ONLINE_SLACK of the best
    cached one (the cache costs a pass over the data and disk space). DeepSpeed's optimizer offload comes last: only
    when no setting without it fits, and only when `offload_blocker` is None (else it says why DeepSpeed cannot
    offload this run's optimizer; a config that sets the key itself pins it in `fixed` instead). With validation
    renders (m.render_forward_bytes set) a setting fits when its step and its render both do; among equally fast
    ones an untiled VAE decode wins. A setting fits only when its pinned host bytes fit `host` too (host_bytes)."""
    allowed = list(candidates(s, fixed, fp8_ok, online, m.render_forward_bytes is not None))
    if not allowed:
        return NoFit("no candidate", budget, margin)
    room = budget - margin
    scored = [(c, predict(s, m, c)) for c in allowed]
    if "train.kept_attention_blocks" not in fixed and m.kept_bytes > 0:
        scored = [most_kept(s, m, c, pred, room) for c, pred in scored]
    on_gpu = [x for x in scored if not x[0].offload_optimizer]
    offloaded = [x for x in scored if x[0].offload_optimizer]
    usable = on_gpu + (offloaded if offload_blocker is None or OFFLOAD_KEY in fixed else [])
    for group in (on_gpu, usable):
        best = _fastest([x for x in group if x[1].fit_bytes <= room and fits_host(s, x[0], host)])
        if best:
            return best
    unused = [] if offload_blocker is None or OFFLOAD_KEY in fixed else offloaded
    return _no_fit(
        s,
        m,
        NoFit("budget", budget, margin, blocker=offload_blocker if unused else None),
        allowed,
        usable or scored,
        unused,
        host,
    )


def _no_fit(
    s: Sizes, m: Measured, base: NoFit, allowed: list[Choice], tried: list[Scored], unused: list[Scored], host: Host
) -> NoFit:
    """Why none of `tried` (the settings the plan may use, predicted) fits: the host alone, the renders alone, or
    the GPU; for the GPU also the smallest of the optimizer offload's settings the plan could not use (`unused`)
    and, for a full fine-tune, the data-parallel world that would fit it."""
    gpu_fits = [c for c, pred in tried if pred.fit_bytes <= base.room]
    if gpu_fits:  # only the host's memory stops them
        c = min(gpu_fits, key=lambda c: host_bytes(s, c, host))
        return dataclasses.replace(base, kind="host", smallest=c, needs_bytes=host_bytes(s, c, host), blocker=None)
    steps_fit = [x for x in tried if x[1].peak_bytes <= base.room]
    if steps_fit:  # only the validation renders do not fit
        c, pred = min(steps_fit, key=lambda x: x[1].render_peak_bytes)
        return dataclasses.replace(base, kind="render", smallest=c, needs_bytes=pred.render_peak_bytes, blocker=None)
    c, pred = min(tried, key=lambda x: x[1].fit_bytes)
    offload, offload_pred = min(unused, key=lambda x: x[1].fit_bytes) if unused else (None, None)
    return dataclasses.replace(
        base,
        smallest=c,
        needs_bytes=pred.fit_bytes,
        offload=offload,
        offload_needs_bytes=offload_pred.fit_bytes if offload_pred else 0.0,
        full_ranks=_full_ranks(s, m, allowed, base.room) if s.full else None,
    )


def most_kept(s: Sizes, m: Measured, c: Choice, pred: Prediction, room: float) -> Scored:
    """`c` (predicted `pred`, keeping no attention) with as many of its checkpointed blocks keeping their attention
    output as fit `room`: each adds m.kept_bytes to the activation peak and nothing else, and only makes the step
    faster, so the largest count that fits is the best."""
    if not c.checkpointed or pred.fit_bytes > room:
        return c, pred
    best, lo, hi = (c, pred), 0, c.checkpointed  # best fits with `lo` kept; find the largest count that still fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = dataclasses.replace(c, kept_attention=mid)
        trial_pred = predict(s, m, trial)
        if trial_pred.fit_bytes <= room:
            best, lo = (trial, trial_pred), mid
        else:
            hi = mid - 1
    return best


def _fastest(fits: list[Scored]) -> Scored | None:
    """choose's pick among settings that fit: online while within ONLINE_SLACK of the cached step, else cached."""
    best = {
        cached: min(
            (x for x in fits if x[0].cached == cached),
            key=lambda x: (x[1].step_s, bool(x[0].vae_tiling), x[1].peak_bytes),
            default=None,
        )
        for cached in (False, True)
    }
    if best[False] and (not best[True] or best[False][1].step_s <= ONLINE_SLACK * best[True][1].step_s):
        return best[False]
    return best[True]


def _full_ranks(s: Sizes, m: Measured, allowed: list[Choice], room: float) -> FullRanks:
    """The fewest data-parallel ranks over which ZeRO stage 2 splits a full fine-tune's optimizer state enough for
    one of the `allowed` settings to fit `room` (every GPU holds the whole bf16 model), or that no number does."""
    on_gpu = {dataclasses.replace(c, offload_optimizer=False) for c in allowed}  # the state split, not moved

    def at(world: int) -> float:
        return min(predict(dataclasses.replace(s, zero_stage=2, dp_world=world), m, c).fit_bytes for c in on_gpu)

    if at(MOST_RANKS) > room:
        return FullRanks(None)
    start = max(s.dp_world, 1) + (1 if s.zero_stage == 2 else 0)  # stage 0 or 1 may fit at this world with 2
    world = next(w for w in range(start, MOST_RANKS + 1) if at(w) <= room)
    return FullRanks(world, at(world))
