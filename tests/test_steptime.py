"""train/runtime/steptime.py: each step's time (CPU clock, CUDA events read without waiting) and the one summary every
reporter gives: the mean beside the median over the steps after the warm-up."""

from __future__ import annotations

import pytest
import torch

from train.runtime import steptime

# 5 warm-up steps (a compile, then settling), then 8 timed ones of which two are slow (a collector's pause)
SECONDS = [70.0, 3.0, 1.5, 1.2, 1.1] + [1.0, 1.1, 0.9, 1.0, 3.0, 1.0, 1.2, 2.0]


def test_mean_beside_median_with_outliers():
    """Two slow steps pull the mean (what an epoch costs) 1.33x above the median, which hides them; the warm-up's
    70 s compile counts in neither. Steps are numbered from the run's first (11 after a resume at step 10)."""
    stats = steptime.step_time_stats(SECONDS, samples_per_step=4, first_step=11)
    assert stats == pytest.approx(
        {
            "timed_steps": 8,
            "warmup_steps": 5,
            "first_timed_step": 16,
            "mean_s_per_step": 1.4,
            "samples_per_s": 4 / 1.4,
            "median_s_per_step": 1.05,
            "mean_over_median": 1.4 / 1.05,
            "slowest_s": 3.0,
            "slowest_step": 20,
            "slow_steps": 2,
        }
    )
    assert steptime.describe(stats) == (
        "step time over steps 16-23 (after 5 warm-up): mean 1.400 s (2.86 samples/s), median 1.050 s (mean 1.333x), "
        "slowest 3.000 s at step 20, 2 over 1.5x the median"
    )


def test_steady_steps_and_too_few_steps():
    """Without outliers mean and median agree and no step is slow; a run of warm-up steps only has no summary."""
    stats = steptime.step_time_stats([9.0] * 5 + [2.0] * 4, samples_per_step=2)
    assert stats["mean_over_median"] == 1.0 and stats["slow_steps"] == 0 and stats["samples_per_s"] == 1.0
    assert steptime.step_time_stats([9.0] * 5, 2) is None
    assert (
        steptime.describe(None, 5)
        == "step time: not summarised: the 5 steps this process ran are warm-up (the first 5)"
    )
    assert steptime.timed(list(range(1, 8))) == [6, 7]


def test_cpu_timer_leaves_the_time_between_stop_and_start_out(monkeypatch):
    clock = iter([0.0, 1.0, 50.0, 52.5])
    monkeypatch.setattr(steptime.time, "perf_counter", lambda: next(clock))
    timer = steptime.StepTimer(torch.device("cpu"))
    timer.start()
    timer.stop()
    timer.start()  # 49 s later (a checkpoint save)
    timer.stop()
    assert timer.seconds() == [1.0, 2.5]


class _Event:
    """torch.cuda.Event's stand-in: `reached` is when the device got to it (None: not yet)."""

    log: list[_Event] = []

    def __init__(self, enable_timing: bool):
        self.reached, self.waited = None, False
        _Event.log.append(self)

    def record(self):
        pass

    def query(self) -> bool:
        return self.reached is not None

    def synchronize(self):
        self.waited = True
        if self.reached is None:
            self.reached = 100.0  # the device finished its queue

    def elapsed_time(self, end: _Event) -> float:
        return (end.reached - self.reached) * 1e3


def test_cuda_timer_reads_finished_steps_without_waiting(monkeypatch):
    """On a GPU a step's marks are events; stop() reads the steps the device has finished and never waits, so the
    host keeps its lead; seconds() waits for the rest."""
    _Event.log = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    timer = steptime.StepTimer(torch.device("cuda", 0))
    timer.start()
    timer.stop()
    first_start, first_stop = _Event.log
    timer.start()
    first_start.reached = 10.0  # the device is still in the first step when the second is queued
    timer.stop()
    assert timer.done == [] and len(timer.pending) == 2 and not first_stop.waited
    first_stop.reached, _Event.log[2].reached = 11.5, 11.5
    timer.start()
    timer.stop()  # reads the first step, the second is still running
    assert timer.done == [1.5] and len(timer.pending) == 2
    _Event.log[4].reached = 100.0
    assert timer.seconds() == [1.5, 88.5, 0.0] and _Event.log[3].waited
