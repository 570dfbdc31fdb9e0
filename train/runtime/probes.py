"""Probes of the process's resources, read at log cadence: GPU peaks (allocated, reserved) and a meter for a part of the
run, the allocator's cache flushes, torch.compile's graphs, the garbage collector's seconds, host RSS and pinned memory.
"""

from __future__ import annotations

import time

import psutil
import torch

# torch keeps one pair of peak counters per device (allocated, reserved); a PeakMeter resets them to measure a part of
# the run alone and keeps what they held here, so that peak_memory_gb and peak_reserved_gb still report the run's
# peaks: {device index: bytes}.
_peak_floor: dict[int, int] = {}
_reserved_floor: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def reset_peak_memory(device: torch.device) -> None:
    """Start the run's peaks (peak_memory_gb, peak_reserved_gb) afresh: the memory plan calls it after its
    measurement."""
    if device.type == "cuda":
        _peak_floor.pop(_index(device), None)
        _reserved_floor.pop(_index(device), None)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """torch.cuda.max_memory_allocated since reset_peak_memory (what metrics.jsonl logs as peak_memory_gb), PeakMeter
    measurements inside it included; 0 on a CPU."""
    if device.type == "cuda":
        return max(_peak_floor.get(_index(device), 0), torch.cuda.max_memory_allocated(device)) / 1e9
    return 0.0


def peak_reserved_gb(device: torch.device) -> float:
    """torch.cuda.max_memory_reserved since reset_peak_memory (metrics.jsonl's peak_reserved_gb): what the caching
    allocator held from the driver at its peak, allocated memory plus its cached free blocks (one pool per stream),
    so the figure an out-of-memory error is about; 0 on a CPU."""
    if device.type == "cuda":
        return max(_reserved_floor.get(_index(device), 0), torch.cuda.max_memory_reserved(device)) / 1e9
    return 0.0


def alloc_retries(device: torch.device) -> int:
    """How many times this process's caching allocator found no room under the cap (the device, or memory.budget_gb's
    per-process fraction), freed all its cached blocks and tried cudaMalloc again (torch.cuda.memory_stats'
    num_alloc_retries, counted since the process started; metrics.jsonl's alloc_retries). Each flush synchronizes the
    device and gives the cache back, so a step that triggers one is slower; 0 on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    return 0


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (dynamo's unique_graphs counter;
    metrics.jsonl's compiled_graphs): a step during which it grows compiled or recompiled something, which explains
    a slow step."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


_gc = {"s": 0.0, "start": None}  # seconds the collector has spent so far, and when the running collection began


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["start"] = time.perf_counter()
    elif _gc["start"] is not None:
        _gc["s"] += time.perf_counter() - _gc["start"]
        _gc["start"] = None


def gc_seconds() -> float:
    """Seconds Python's cyclic garbage collector has spent collecting in this process since the first call
    (gc.callbacks, which the interpreter calls as each collection starts and stops; metrics.jsonl's gc_s is the
    difference over the log window). A full collection walks every object the collector tracks (the libraries',
    the model's modules and parameters, DeepSpeed's state, torch.compile's graphs) while the GPU may have run out
    of queued work: a step slower than its neighbours with gc_s up by the difference paused in the collector."""
    import gc

    if _time_collections not in gc.callbacks:
        gc.callbacks.append(_time_collections)
    return _gc["s"]


class GcWindow:
    """The collector's seconds per log window: take() returns those since the previous take (or construction)."""

    def __init__(self):
        self.start = gc_seconds()

    def take(self) -> float:
        now = gc_seconds()
        seconds, self.start = now - self.start, now
        return seconds


def host_rss_gb() -> float:
    """This process's resident set size (psutil; metrics.jsonl's host_rss_gb): its host memory in RAM, pinned or not,
    for checking the memory plan's host accounting. Shared pages it has touched count too, so a /dev/shm buffer
    counts once in every process that maps it."""
    return psutil.Process().memory_info().rss / 1e9


def host_pinned_gb(device: torch.device) -> float:
    """The pinned host memory torch's caching host allocator holds, blocks in use and cached, as taken from the driver
    with cudaHostAlloc (torch.cuda.host_memory_stats' allocated_bytes.current; metrics.jsonl's host_pinned_gb). torch
    rounds every pinned allocation up to a power of two (PowerOf2Ceil in aten/src/ATen/core/CachingHostAllocator.h,
    unless PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold), so this is what the pinned buffers really cost,
    up to twice what they hold. Memory pinned in place with cudaHostRegister, outside the allocator (as the block
    offloader pins its host buffer), is not in it, only in host_rss_gb. 0 on a CPU or with a torch that has no
    host_memory_stats."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type == "cuda" and stats is not None:
        return stats().get("allocated_bytes.current", 0) / 1e9
    return 0.0


class PeakMeter:
    """`with PeakMeter(device) as m: ...` -> m.bytes: the GPU memory allocated at the peak inside the block (all of
    it, not only what the block added: comparable with the memory plan's predicted peaks); None on a CPU. It leaves
    peak_memory_gb and peak_reserved_gb as they would have been without it."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            i = _index(self.device)
            _peak_floor[i] = max(_peak_floor.get(i, 0), torch.cuda.max_memory_allocated(self.device))
            _reserved_floor[i] = max(_reserved_floor.get(i, 0), torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device)
