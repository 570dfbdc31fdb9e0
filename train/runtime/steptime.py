"""Each step's wall time, and the one summary of it that every reporter gives (train.bench's rows, tests/gpu_memory.sh's
records, summary.json, the end-of-run line): the mean beside the median, since a user's epoch time is the mean and a
median hides the occasional slow step.

The timed steps are the steps after the first WARMUP_STEPS that the process ran: in those torch.compile compiles the
blocks (the first step, and a recompile in the second when a shape turns dynamic), the caching allocator grows to its
working set and an H200 under load slows over its first steps as its power climbs to the limit. A resumed run counts
from its own first step, since it compiles again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

WARMUP_STEPS = 5
SLOW_FACTOR = 1.5  # a step this many times the median counts as slow


class StepTimer:
    """The seconds of each step, from start() to stop(). On a GPU the two marks are CUDA events recorded on the current
    stream, so the host never waits for them: a step's time is the device's, from reaching its start to reaching its
    stop, and a pause of the host inside the step (the garbage collector, a data wait) is in it, the device idling.
    A finished pair is read at the next stop(), the rest by seconds(). On a CPU, time.perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done: list[float] = []
        self.pending: list[tuple] = []
        self.begun = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.begun = self._mark()

    def stop(self) -> None:
        assert self.begun is not None, "StepTimer.stop() without start()"
        self.pending.append((self.begun, self._mark()))
        self.begun = None
        self._read(wait=False)

    def _read(self, wait: bool) -> None:
        """Move the finished steps, in order, from `pending` to `done`; `wait`: wait for the device to finish them."""
        while self.pending:
            begin, end = self.pending[0]
            if not self.cuda:
                self.done.append(end - begin)
            elif wait or end.query():
                end.synchronize()
                self.done.append(begin.elapsed_time(end) / 1e3)  # milliseconds
            else:
                return
            self.pending.pop(0)

    def seconds(self) -> list[float]:
        """Every stopped step's seconds, in order (on a GPU, waits for the last ones to finish)."""
        self._read(wait=True)
        return list(self.done)


def timed(values: Sequence, warmup: int = WARMUP_STEPS) -> list:
    """The entries of the timed steps in `values` (one per step, the process's first step first)."""
    return list(values[warmup:])


def step_time_stats(
    seconds: Sequence[float], samples_per_step: float, first_step: int = 1, warmup: int = WARMUP_STEPS
) -> dict | None:
    """The summary of the timed steps of `seconds` (one entry per step, step number `first_step` first;
    `samples_per_step`: over every rank): their count and first step, the mean step time and the samples/s it gives,
    the median and the mean's ratio to it, the slowest step's time and number, and how many steps took over
    SLOW_FACTOR x the median. None when every step was a warm-up step."""
    times = timed(seconds, warmup)
    if not times:
        return None
    mean, median = statistics.fmean(times), statistics.median(times)
    slowest = max(range(len(times)), key=times.__getitem__)
    return {
        "timed_steps": len(times),
        "warmup_steps": warmup,
        "first_timed_step": first_step + warmup,
        "mean_s_per_step": mean,
        "samples_per_s": samples_per_step / mean,
        "median_s_per_step": median,
        "mean_over_median": mean / median,
        "slowest_s": times[slowest],
        "slowest_step": first_step + warmup + slowest,
        "slow_steps": sum(t > SLOW_FACTOR * median for t in times),
    }


def describe(stats: dict | None, steps_run: int | None = None) -> str:
    """step_time_stats as one console line; `steps_run` (the steps of this process) says why there are none."""
    if stats is None:
        ran = f" the {steps_run} steps this process ran are" if steps_run is not None else " every step is"
        return f"step time: not summarised:{ran} warm-up (the first {WARMUP_STEPS})"
    s = stats
    last = s["first_timed_step"] + s["timed_steps"] - 1
    return (
        f"step time over steps {s['first_timed_step']}-{last} (after {s['warmup_steps']} warm-up): mean "
        f"{s['mean_s_per_step']:.3f} s ({s['samples_per_s']:.3g} samples/s), median {s['median_s_per_step']:.3f} s "
        f"(mean {s['mean_over_median']:.3f}x), slowest {s['slowest_s']:.3f} s at step {s['slowest_step']}, "
        f"{s['slow_steps']} over {SLOW_FACTOR:g}x the median"
    )
