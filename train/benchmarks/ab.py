"""`--ab_rounds N`: one lever timed without and with it in alternating rounds on the same model, engine and batch, in
one process. Identical benchmark processes differ by more than a lever of about a per cent of the step (the
machine's clocks, where the allocator put things; docs/levers.md, 40-42); rounds a few seconds apart in one process
share the model, the engine and the allocator's state. The levers switched on a built model (`--ab_lever`, LEVERS):
fused_swiglu, train/model/swiglu.py's fuse and unfuse between rounds (with `--fused_swiglu`), each compiled form
compiled once, in its first round's warm-up; text_calls, a later text run of 2.1's segmented op as one
FlashAttention-4 call or as two merged calls (kept_attention.split_text_calls, with `--attention_kernel fa4`), which
the compiled blocks do not see (the op is opaque to them); fa4_into, the same op's FlashAttention-4 calls writing
their rows of its outputs in place or returning new tensors copied there (kept_attention.copy_outputs); lean_step,
the ZeRO step's lighter host work (train/runtime/ds_patches.py's lean_step) or DeepSpeed's own methods, outside
every compiled graph.

Each round is `--warmup` + `--steps` steps (train/benchmarks/timing.py's time_steps, the same seeds every round).
The record's main figures are the rounds with the lever, pooled; its `ab_` fields hold the rounds without it, each
round's mean, the difference, and the count of graphs dynamo had compiled after each round: a count that still grows
after the first pair of rounds means a form was recompiled (or, past dynamo's limit, run eagerly) and the
difference does not measure the lever alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from train.benchmarks.timing import Phase, time_steps

LEVERS = {  # --ab_lever: what switch(True) turns on
    "fused_swiglu": "fused SwiGLU",
    "text_calls": "one FlashAttention-4 call per later text run",
    "lean_step": "the ZeRO step's lighter host work",
    "fa4_into": "FlashAttention-4 writing the segmented op's outputs in place",
}


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def pooled(phases: list[Phase]) -> Phase:
    """The timed steps of several rounds as one phase (each round's warm-up left out)."""
    return Phase(
        [s for p in phases for s in p.seconds[p.warmup :]],
        0,
        max(p.peak_memory_gb for p in phases),
        [loss for p in phases for loss in p.losses[p.warmup :]],
    )


def alternate(
    step: Callable[[int], torch.Tensor],
    switch: Callable[[bool], object],
    rounds: int,
    warmup: int,
    steps: int,
    device: torch.device,
    gc_every_steps: int = 0,
    lever: str = "fused_swiglu",
) -> tuple[Phase, dict]:
    """`rounds` pairs of rounds, without the lever (switch(False)) then with it (switch(True)); the lever is left on.
    Returns the rounds with it, pooled, and the record's ab_ fields."""
    sides: dict[bool, list[Phase]] = {False: [], True: []}
    graphs = []
    for _ in range(rounds):
        for on in (False, True):
            switch(on)
            sides[on].append(time_steps(step, warmup, steps, device, gc_every_steps))
            graphs.append(compiled_graphs())
    off, on = pooled(sides[False]), pooled(sides[True])
    off_stats = off.stats(1.0)
    fields = {
        "ab_lever": LEVERS[lever],
        "ab_rounds": rounds,
        "ab_off_s_per_step": off_stats["mean_s_per_step"],
        "ab_off_median_s_per_step": off_stats["median_s_per_step"],
        "ab_off_peak_memory_gb": off.peak_memory_gb,
        "ab_round_means_s": [[a.s_per_step, b.s_per_step] for a, b in zip(sides[False], sides[True], strict=True)],
        "ab_on_minus_off_ms": 1000 * (on.s_per_step - off.s_per_step),
        "ab_graphs_after_round": graphs,
        "ab_recompiled": len(graphs) > 2 and graphs[-1] != graphs[1],
    }
    return on, fields


def report_lines(r: dict) -> list[str]:
    """The A/B's lines of train.bench's report."""
    rounds = ", ".join(f"{1000 * (b - a):+.1f}" for a, b in r["ab_round_means_s"])
    lines = [
        f"A/B         {r['ab_lever']} off {r['ab_off_s_per_step']:.4f} s/step "
        f"(median {r['ab_off_median_s_per_step']:.4f}, peak {r['ab_off_peak_memory_gb']:.2f} GB), "
        f"on {r['s_per_step']:.4f} (the figures above), alternating {r['ab_rounds']} rounds each of "
        f"{r['steps']} timed steps",
        f"            on - off {r['ab_on_minus_off_ms']:+.1f} ms per step; per round {rounds} ms",
    ]
    if r["ab_recompiled"]:
        lines.append(f"            WARNING: dynamo compiled again after the first pair of rounds (graphs after each "
                     f"round: {r['ab_graphs_after_round']}); the difference is not the lever's alone")
    return lines
