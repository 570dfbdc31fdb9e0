"""The timed phases of train.bench and their statistics: each step timed alone (steptime.StepTimer), the slowest
rank's seconds and the largest rank's peak memory, summarised as the trainer summarises its own step times."""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.runtime import engine, steptime
from train.runtime.collector import Collector


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced_now(device: torch.device) -> float:
    """The host's clock once the device's queued work is done: what the probes time calls with."""
    sync(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """torch.cuda.max_memory_allocated on a GPU; the process's peak RSS on a CPU (Linux: ru_maxrss in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each entry's largest value on any rank (a collective when the world is larger than one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    return values


@dataclass
class Phase:
    """One timed loop: every step's seconds (the slowest rank's), peak memory (largest rank), the losses."""

    seconds: list[float]  # every step's, warm-up included
    warmup: int
    peak_memory_gb: float
    losses: list[float]  # every step's loss, warm-up included (same seeds in both loops: comparable curves)

    @property
    def last_loss(self) -> float:
        return self.losses[-1]

    def stats(self, samples_per_step: float) -> dict:
        """steptime.step_time_stats of the steps after the warm-up (the same summary as the trainer's)."""
        return steptime.step_time_stats(self.seconds, samples_per_step, warmup=self.warmup)

    @property
    def s_per_step(self) -> float:
        """The mean over the timed steps."""
        return self.stats(1.0)["mean_s_per_step"]


def time_steps(
    step: Callable[[int], torch.Tensor], warmup: int, steps: int, device: torch.device, gc_every_steps: int = 0
) -> Phase:
    """Run `warmup` steps, then `steps` more, every rank starting them together, each step timed alone
    (steptime.StepTimer: CUDA events, no sync inside the loop); the garbage collector as train.gc_every_steps runs it
    in training (no log here: a full collection every 100 steps)."""
    reset_peak_memory(device)
    timer, losses = steptime.StepTimer(device), []
    with Collector(gc_every_steps) as collector:
        for i in range(warmup + steps):
            if i == warmup:
                sync(device)
                engine.barrier()
            timer.start()
            losses.append(step(i))  # kept on the device: no sync inside the loop
            collector.after_step(i + 1, at_log=True)
            timer.stop()
    return Phase(
        max_over_ranks(timer.seconds(), device),
        warmup,
        max_over_ranks([peak_memory_gb(device)], device)[0],
        [float(x) for x in losses],
    )
