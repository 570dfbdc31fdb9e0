"""train.bench --profile: torch.profiler over 3 steps of a timed loop, the op table, the device-busy share and, on a
GPU, where the device waits for the host (the idle report) and the kernels by category (train/benchmarks/kernels.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from train.benchmarks import kernels
from train.benchmarks.timing import sync

PHASES = ("bench/forward", "bench/backward", "bench/step")  # record_function labels of step.project_step
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass(frozen=True)
class Span:
    """One profiler event reduced to what the idle report needs (times in microseconds)."""

    name: str
    start: float
    end: float
    on_device: bool
    stack: tuple[str, ...] = ()  # a host op's own Python frames, innermost first, where the profiler gives them


def phase_finder(spans: list[Span]) -> Callable[[float], str]:
    """A function of a host time: the innermost step phase (PHASES) open at it, or "between phases"."""
    phases = sorted((s for s in spans if not s.on_device and s.name in PHASES), key=lambda s: s.start)

    def phase_at(t: float) -> str:
        inside = [p.name for p in phases if p.start <= t <= p.end]
        return inside[-1] if inside else "between phases"

    return phase_at


def idle_report(spans: list[Span], steps: int, top: int = 12) -> str:
    """Where the device waits for the host: gaps between kernels, attributed to the step phase (PHASES) the host
    was in when the next kernel was issued, and the host synchronisations in each phase."""
    device_spans = sorted((s for s in spans if s.on_device), key=lambda s: s.start)
    phase_at = phase_finder(spans)
    gaps, busy_until, previous = [], None, None  # (length, phase, kernel before, kernel after)
    for k in device_spans:
        if busy_until is not None and k.start > busy_until:
            # charged to the phase in which the host issued the kernel that ended the gap
            gaps.append((k.start - busy_until, phase_at(k.start - 1.0), previous, k.name))
        if busy_until is None or k.end > busy_until:
            busy_until, previous = k.end, k.name
    by_phase: dict[str, float] = {}
    for length, phase, _, _ in gaps:
        by_phase[phase] = by_phase.get(phase, 0.0) + length
    syncs: dict[str, int] = {}
    for s in spans:
        if not s.on_device and s.name in SYNC_CALLS:
            key = f"{s.name} in {phase_at(s.start)}"
            syncs[key] = syncs.get(key, 0) + 1
    total = sum(g[0] for g in gaps)
    lines = [
        f"device idle between kernels: {total / steps / 1e3:.2f} ms/step in {len(gaps) / steps:.0f} gaps/step; "
        "by the phase that issued the next kernel:"
    ]
    lines += [f"  {name}: {us / steps / 1e3:.2f} ms/step" for name, us in sorted(by_phase.items(), key=lambda x: -x[1])]
    lines.append(
        "host synchronisations per step: "
        + (", ".join(f"{name} x{count / steps:g}" for name, count in sorted(syncs.items())) or "none")
    )
    lines.append(f"largest {top} gaps (ms, phase, kernel before -> kernel after):")
    for length, phase, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {length / 1e3:7.3f}  {phase:15s} {str(before)[:60]} -> {after[:60]}")
    return "\n".join(lines) + "\n"


def sync_origins_report(spans: list[Span], steps: int) -> str:
    """Each host synchronisation by phase and origin (sync_origin), from a profile taken with Python stacks."""
    phase_at = phase_finder(spans)
    origins: dict[str, int] = {}
    for s in spans:
        if not s.on_device and s.name in SYNC_CALLS:
            key = f"{s.name} in {phase_at(s.start)} from {sync_origin(s, spans)}"
            origins[key] = origins.get(key, 0) + 1
    lines = ["host synchronisations per step by origin (the innermost host op around each and the innermost Python "
             "frame outside torch):"]
    lines += [f"  x{count / steps:g} {key}" for key, count in sorted(origins.items(), key=lambda x: -x[1])]
    return "\n".join(lines if origins else lines[:1] + ["  none"]) + "\n"


def sync_origin(sync_span: Span, spans: list[Span]) -> str:
    """What issued a host synchronisation: the innermost host op around it (not a phase) and the innermost Python
    frame around it outside torch (the profiler's with_stack frames, spans named "file(line): function", or an op's
    own stack), its path cut to the package; "python" when nothing encloses it."""
    around = sorted((s for s in spans if not s.on_device and s is not sync_span and s.name not in PHASES
                     and s.name not in SYNC_CALLS and s.start <= sync_span.start and sync_span.end <= s.end),
                    key=lambda s: s.end - s.start)
    ops = [s for s in around if not _is_frame(s.name)]
    op = ops[0] if ops else None
    frames = list(op.stack) if op is not None and op.stack else [s.name for s in around if _is_frame(s.name)]
    outside = [f for f in frames if not f.startswith("<built-in") and not _in_torch(f) and "profiling.py" not in f]
    parts = [op.name if op is not None else "", _short(outside[0]) if outside else ""]
    return " at ".join(p for p in parts if p) or "python"


def _is_frame(name: str) -> bool:
    """A with_stack Python frame ("file(line): function" or a built-in) rather than an op."""
    return name.startswith("<built-in") or re.match(r".+\(\d+\): ", name) is not None


def _in_torch(frame: str) -> bool:
    path = frame.split("(", 1)[0]
    return path.startswith("torch/") or "/torch/" in path


def _short(frame: str) -> str:
    """A frame's path from its package on (deepspeed/..., train/...)."""
    for package in ("deepspeed/", "train/", "diffusers/", "peft/", "model_parallel/"):
        if "/" + package in frame:
            return package + frame.split("/" + package, 1)[1]
    return frame


def profiler_spans(prof) -> list[Span]:
    """Kernels, copies and host events of a finished torch.profiler run."""
    return [Span(e.name, e.time_range.start, e.time_range.end, is_kernel(e), tuple(getattr(e, "stack", None) or ()))
            for e in prof.events()]


def is_kernel(event) -> bool:
    """A kernel or copy on the device (not a host op, nor a record_function range mirrored on the device)."""
    name = getattr(event, "name", None) or getattr(event, "key", "")  # FunctionEvent / key_averages' rows
    return (
        event.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(event, "is_user_annotation", False)
        and name not in PHASES
    )


def profile_steps(step: Callable[[int], torch.Tensor], first: int, device: torch.device, path: str) -> None:
    """torch.profiler over 3 more steps; writes the op table (by device time), the device-busy share and, on a
    GPU, the idle report (where the device waits for the host), the host synchronisations by origin (from a fourth
    step profiled with Python stacks, which slow the host, so that the figures above stay comparable) and the
    kernels by category (train/benchmarks/kernels.py: which part of the floor each belongs to, or what it is beyond
    it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(first, first + 3):
            step(i)
        sync(device)
    wall = time.perf_counter() - start
    if device.type == "cuda":  # one more step with Python stacks (slower host, so apart from the figures above)
        with profile(activities=activities, with_stack=True) as stacked:
            step(first + 3)
            sync(device)
    events = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # Kernels (and copies) only: an op's row repeats the device time of the kernels it launched.
    busy_us = sum(e.self_device_time_total for e in events if is_kernel(e))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(
            f"wall {wall / 3:.4f} s/step under the profiler; device kernels {busy_us / 3e6:.4f} s/step "
            f"({100 * busy_us / 1e6 / wall:.1f}% busy)\n\n"
        )
        if device.type == "cuda":
            f.write(idle_report(profiler_spans(prof), steps=3) + "\n")
            f.write(sync_origins_report(profiler_spans(stacked), steps=1) + "\n")
            f.write(kernels.report(kernels.profiled_kernels(prof), steps=3) + "\n")
        f.write(events.table(sort_by=sort, row_limit=60, max_name_column_width=90))
