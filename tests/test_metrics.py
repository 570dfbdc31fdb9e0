"""The run's metrics: progress output (train/runtime/console.py, record.py: a tqdm bar on a terminal, started by the
first step; one plain line per logged step elsewhere, a file, a pipe, a batch job), the probes logged with each record
(probes.py) and the loss curve (plot.py)."""

from __future__ import annotations

import json

import pytest

from train.runtime.console import progress_line
from train.runtime.record import Metrics

RECORD = {"step": 20, "epoch": 1, "loss": 0.123456, "lr": 1e-4, "grad_norm": 0.5, "step_time_s": 0.5,
          "samples_per_s": 4.0}


def test_progress_line_has_every_field_and_the_eta():
    line = progress_line(RECORD, total_steps=200)
    assert line == ("step 20/200 | epoch 1 | loss 0.1235 | lr 1.00e-04 | grad_norm 0.5 | step_time 0.500s | "
                    "4.00 samples/s | ETA 1m30s")
    assert progress_line({**RECORD, "grad_norm": None, "step_time_s": 20.0}, 200).endswith("grad_norm n/a | "
                                                                                           "step_time 20.000s | "
                                                                                           "4.00 samples/s | ETA 1h00m")


def test_not_a_terminal_prints_one_line_per_log_step(tmp_path, capsys):
    """Under pytest stdout is not a terminal: no bar (no carriage returns), one line per logged record."""
    metrics = Metrics(tmp_path, total_steps=200, tensorboard=False)
    metrics.message("validation: rendering")
    for step in (10, 20):
        for _ in range(10):
            metrics.step()
        metrics.log({**RECORD, "step": step})
    metrics.close()
    out = capsys.readouterr().out
    assert "\r" not in out and metrics.bar is None
    assert out.splitlines() == ["validation: rendering", progress_line({**RECORD, "step": 10}, 200),
                                progress_line(RECORD, 200)]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [10, 20]


def test_terminal_bar_starts_with_the_first_step(tmp_path, capsys):
    """On a terminal the bar is created by the first step, so what runs before (the 'before' images) is outside
    its clock and ETA; messages before it are plain lines."""
    metrics = Metrics(tmp_path, total_steps=5, start_step=2, tensorboard=False, interactive=True)
    metrics.message("before the bar")
    assert metrics.bar is None
    metrics.step()
    assert metrics.bar is not None and metrics.bar.n == 3 and metrics.bar.total == 5
    metrics.close()
    assert capsys.readouterr().out.startswith("before the bar\n")


def test_loss_curve_png_falls_with_the_loss(tmp_path):
    """OUT/loss.png: the curve is drawn (blue) from high on the left to low on the right for a falling loss."""
    import numpy as np
    from PIL import Image

    from train.runtime.plot import plot_loss

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 21)))
    out = plot_loss(path, tmp_path / "loss.png")
    assert out == tmp_path / "loss.png"
    pixels = np.asarray(Image.open(out).convert("RGB")).astype(int)
    ys, xs = np.nonzero((pixels[..., 2] > 150) & (pixels[..., 0] < 100))
    assert len(xs) > 100
    assert ys[xs == xs.min()].mean() < ys[xs == xs.max()].mean() - 100  # left end far higher than the right end
    (tmp_path / "empty.jsonl").write_text("")
    assert plot_loss(tmp_path / "empty.jsonl", tmp_path / "none.png") is None


def test_loss_curve_has_round_grid_lines_and_survives_odd_records(tmp_path):
    """The axes carry grid lines at round values (nice_ticks: 1, 2 or 5 x 10^k apart); a NaN loss, a record without
    a loss and a torn last line (a run killed while writing) are left out instead of failing the run's end."""
    import numpy as np
    from PIL import Image

    from train.runtime.plot import nice_ticks, plot_loss

    assert nice_ticks(0, 1) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(1, 200) == [50, 100, 150, 200]
    assert nice_ticks(0.0123, 0.0456) == [0.02, 0.03, 0.04]
    assert nice_ticks(3.0, 3.0) == [3.0]
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 2.0 - s / 100}) for s in range(10, 101, 10)]
    lines[3] = json.dumps({"step": 40, "loss": float("nan")})
    path.write_text("\n".join(lines + [json.dumps({"step": 101, "note": "no loss"}), '{"step": 110, "lo']))
    pixels = np.asarray(Image.open(plot_loss(path, tmp_path / "loss.png")).convert("RGB")).astype(int)
    grey = (pixels == 225).all(axis=-1)
    rows, cols = np.nonzero(grey.sum(axis=1) > 300)[0], np.nonzero(grey.sum(axis=0) > 150)[0]
    assert len(rows) >= 3 and len(cols) >= 3  # horizontal grid lines at round losses, vertical at round steps


def test_peak_meter_measures_a_part_and_leaves_the_runs_peak(monkeypatch):
    """PeakMeter resets torch's one peak counter to measure its block alone (everything allocated counts, as in the
    memory plan's predictions) while peak_memory_gb, what metrics.jsonl logs, reports the run's peak as if no meter
    had run; reset_peak_memory (the plan's, after its measurement) starts the run's peak afresh. peak_reserved_gb
    likewise for the allocator's reserved memory, which a reset does not lower while the cache holds it. On a CPU:
    None, 0."""
    import torch
    from conftest import FakeCudaCounter

    from train.runtime import probes

    monkeypatch.setattr(probes, "_peak_floor", {})
    monkeypatch.setattr(probes, "_reserved_floor", {})
    cuda = FakeCudaCounter()
    cuda.install(monkeypatch)
    gpu = torch.device("cuda", 0)
    cuda.allocate(50)
    cuda.free(40)  # a plan measurement: gone by the reset
    probes.reset_peak_memory(gpu)
    assert probes.peak_memory_gb(gpu) == 10 / 1e9
    cuda.allocate(30)
    cuda.free(30)  # a step peaking at 40
    with probes.PeakMeter(gpu) as first:
        cuda.allocate(15)
        cuda.free(15)  # a render peaking at 25, below the step's 40
    assert first.bytes == 25 and probes.peak_memory_gb(gpu) == 40 / 1e9
    with probes.PeakMeter(gpu) as second:
        cuda.allocate(45)
        cuda.free(45)  # a render above the step peak: the run's peak includes it, as without a meter
    assert second.bytes == 55 and probes.peak_memory_gb(gpu) == 55 / 1e9
    assert probes.peak_reserved_gb(gpu) == 55 / 1e9  # the allocator kept what the render took
    cuda.allocate(50)
    cuda.free(50)
    assert probes.peak_memory_gb(gpu) == 60 / 1e9 and probes.peak_reserved_gb(gpu) == 60 / 1e9
    probes.reset_peak_memory(gpu)
    assert probes.peak_memory_gb(gpu) == 10 / 1e9
    assert probes.peak_reserved_gb(gpu) == 60 / 1e9  # reserved, not allocated: the cache still holds it
    with probes.PeakMeter(torch.device("cpu")) as cpu:
        pass
    assert cpu.bytes is None and probes.peak_memory_gb(torch.device("cpu")) == 0.0
    assert probes.peak_reserved_gb(torch.device("cpu")) == 0.0


def test_alloc_retries_counts_the_allocators_cache_flushes(monkeypatch):
    """metrics.jsonl's alloc_retries is torch's num_alloc_retries (a key torch documents): the cache flushes so far,
    which a step that ran into the budget's cap pays for; a flush leaves reserved memory at what is allocated. 0 on
    a CPU."""
    import torch
    from conftest import FakeCudaCounter

    from train.runtime import probes

    assert '"num_alloc_retries"' in torch.cuda.memory_stats.__doc__
    monkeypatch.setattr(probes, "_reserved_floor", {})
    cuda = FakeCudaCounter()
    cuda.install(monkeypatch)
    gpu = torch.device("cuda", 0)
    cuda.allocate(30)
    cuda.free(20)
    assert probes.alloc_retries(gpu) == 0 and cuda.reserved == 30
    cuda.flush()
    cuda.flush()
    assert probes.alloc_retries(gpu) == 2 and cuda.reserved == 10
    assert probes.peak_reserved_gb(gpu) == 30 / 1e9  # the logged peak keeps its high-water mark: only
    # alloc_retries shows that the allocator ran into its cap
    assert probes.alloc_retries(torch.device("cpu")) == 0


def test_compiled_graphs_counts_what_torch_compile_builds():
    """metrics.jsonl's compiled_graphs grows when torch.compile builds a graph (a first call, or a new shape that
    recompiles), and not when a compiled graph runs again: a slow step with it unchanged did not compile."""
    import torch

    from train.runtime import probes

    torch._dynamo.reset()
    before = probes.compiled_graphs()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    double(torch.ones(3))
    first = probes.compiled_graphs()
    double(torch.ones(3) * 5)
    assert first == before + 1 and probes.compiled_graphs() == first
    double(torch.ones(2, 2))  # a new shape recompiles
    assert probes.compiled_graphs() == first + 1


def test_gc_seconds_adds_up_the_collectors_time(monkeypatch):
    """metrics.jsonl's gc_s comes from gc_seconds: the time between each collection's start and stop callbacks,
    summed, so a collection of much cyclic garbage raises it and nothing else does."""
    import gc

    from train.runtime import probes

    before = probes.gc_seconds()
    assert probes.gc_seconds() == before  # reading it collects nothing
    cycles = [[] for _ in range(200_000)]
    for c in cycles:
        c.append(c)  # each list holds itself: only the cyclic collector frees it
    del cycles
    gc.collect()
    after = probes.gc_seconds()
    assert after > before
    gc.disable()  # no real collection between the two callbacks below
    try:
        clock = iter([10.0, 10.25])
        monkeypatch.setattr(probes.time, "perf_counter", lambda: next(clock))
        probes._time_collections("start", {"generation": 2})
        probes._time_collections("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        assert probes.gc_seconds() - after == 0.25
        window = probes.GcWindow()  # a log window: the seconds since its start, then since its last take
        clock = iter([20.0, 20.5, 30.0, 30.125])
        probes._time_collections("start", {"generation": 2})
        probes._time_collections("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        assert window.take() == 0.5 and window.take() == 0.0
        probes._time_collections("start", {"generation": 0})
        probes._time_collections("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
        assert window.take() == 0.125
    finally:
        gc.enable()
    assert gc.callbacks.count(probes._time_collections) == 1  # installed once, however often it is read


def test_host_memory_is_the_rss_and_torchs_pinned_pool(monkeypatch):
    """metrics.jsonl's host_rss_gb is this process's RSS: it grows by what a tensor it fills takes. host_pinned_gb is
    torch's pinned allocator's allocated_bytes.current (a key torch documents): its blocks in use and cached, as
    rounded to a power of two, not only the active ones. 0 on a CPU and with a torch without host_memory_stats."""
    import torch

    from train.runtime import probes

    before = probes.host_rss_gb()
    filled = torch.ones(2**28 // 4)  # 0.27 GB, every page written
    assert probes.host_rss_gb() - before > 0.2 and before > 0
    del filled
    assert '"allocated_bytes.{current,' in torch.cuda.host_memory_stats.__doc__
    pool = {"allocated_bytes.current": 3 * 2**30, "active_bytes.current": 2**30}  # 1 GiB in use, 2 GiB cached
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: pool)
    assert probes.host_pinned_gb(torch.device("cuda", 0)) == 3 * 2**30 / 1e9
    assert probes.host_pinned_gb(torch.device("cpu")) == 0.0
    monkeypatch.delattr(torch.cuda, "host_memory_stats")
    assert probes.host_pinned_gb(torch.device("cuda", 0)) == 0.0


class _Clock:
    """time.perf_counter's stand-in: advances only when a test says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_saves_and_renders_are_left_out_of_the_step_time(tmp_path, monkeypatch, capsys):
    """loop.train: a checkpoint save (50 s) and a validation render (100 s) after step 2 are not step time; every
    step takes 1 s, and both windows' step_time_s, samples/s and ETA say so (before, the second said 76 s), as do
    the per-step times of the run's summary (steptime.StepTimer)."""
    from types import SimpleNamespace

    import torch
    from test_fault_injection import Engine as _Engine
    from test_fault_injection import Source

    from train.config import Config, ProjectConfig
    from train.runtime import record, steptime
    from train.runtime.engine import Dist
    from train.trainer import loop

    clock = _Clock()
    monkeypatch.setattr(record, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(steptime, "time", SimpleNamespace(perf_counter=clock))

    class Engine(_Engine):
        def forward(self, hidden_states, **kwargs):
            return (hidden_states.float() * self.weight,)

        def step(self):
            clock.t += 1.0  # one optimizer step of the stand-in takes 1 s
            super().step()

    def save(*args, **kwargs):
        clock.t += 50.0

    def render(step: int) -> None:
        if step == 2:
            clock.t += 100.0

    monkeypatch.setattr(loop.checkpoint, "save", save)
    cfg = Config(ProjectConfig(), deepspeed={"gradient_accumulation_steps": 1})
    cfg.project.train.max_steps, cfg.project.output.log_every_steps, cfg.project.output.save_every_steps = 4, 2, 2
    metrics = Metrics(tmp_path, total_steps=4, tensorboard=False, interactive=False)
    timer = steptime.StepTimer(torch.device("cpu"))
    loop.train(cfg, Dist(0, 1, 0, torch.device("cpu")), Engine(), Source(8), {}, metrics, {"variant": "edit"},
               after_step=render, timer=timer)
    metrics.close()
    assert timer.seconds() == [1.0] * 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["step_time_s"], r["samples_per_s"]) for r in records] == [(2, 1.0, 1.0), (4, 1.0, 1.0)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("step_time 1.000s | 1.00 samples/s | ETA 2s"), lines


def test_terminal_bar_leaves_paused_time_out_of_its_rate(tmp_path):
    """On a terminal, Metrics.unpause (called by the loop after a save or render) restarts tqdm's clock from its
    last print: the bar's elapsed time and rate count the steps alone, so its ETA does not jump after a render."""
    clock = _Clock()
    metrics = Metrics(tmp_path, total_steps=10, tensorboard=False, interactive=True)
    metrics.step()
    bar = metrics.bar
    bar._time, bar.mininterval = clock, 0  # tqdm reads its clock through _time
    bar.start_t = bar.last_print_t = clock()
    bar.last_print_n = bar.n
    for _ in range(3):
        clock.t += 1.0
        metrics.step()
    clock.t += 100.0  # a validation render
    metrics.unpause()
    clock.t += 1.0
    metrics.step()
    assert bar.format_dict["elapsed"] == 4.0 and bar.format_dict["rate"] == pytest.approx(1.0)
    metrics.close()


def test_progress_off_a_terminal_prints_whole_lines(monkeypatch):
    """metrics.progress (the cache build's and train.infer's bar): off a terminal, tqdm's own text as one plain line
    per refresh (every interval_s and at the end), no carriage return; on a terminal, tqdm's bar as it is."""
    import io

    from tqdm import tqdm

    from train.runtime import console

    clock = _Clock()
    log = io.StringIO()
    bar = console.progress(desc="encoding", unit="sample", total=100, file=log, interval_s=30.0)
    bar._time = clock
    bar.start_t = bar.last_print_t = clock()
    for _ in range(100):
        clock.t += 1.0  # a sample a second: a line at 30, 60, 90 s, and the last one
        bar.update()
    bar.close()
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue() and lines[-1] == ""
    assert [line.split("|")[0] for line in lines[:-1]] == ["encoding:   0%", "encoding:  30%", "encoding:  60%",
                                                          "encoding:  90%", "encoding: 100%"], lines
    assert lines[-2].endswith("100/100 [01:40<00:00,  1.00sample/s]")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    on_terminal = console.progress(desc="encoding", unit="sample", total=3, file=Terminal())
    assert type(on_terminal) is tqdm
    on_terminal.close()


def test_library_bars_turned_off_only_off_a_terminal(monkeypatch):
    """transformers' and diffusers' bars (loading weights) stay on a terminal and are turned off in a log."""
    import io

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from train.runtime.console import library_bars_off_terminal

    calls = []
    monkeypatch.setattr(transformers_logging, "disable_progress_bar", lambda: calls.append("transformers"))
    monkeypatch.setattr(diffusers_logging, "disable_progress_bar", lambda: calls.append("diffusers"))

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not library_bars_off_terminal(Terminal()) and calls == []
    assert library_bars_off_terminal(io.StringIO()) and calls == ["transformers", "diffusers"]


def test_the_console_docs_show_the_plain_progress_line():
    """docs/checkpoints.md's console paragraph quotes the line progress_line prints for RECORD."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md").read_text()
    assert f"`{progress_line(RECORD, 200)}`" in page


def test_write_loss_curve_prints_its_path_and_never_raises(tmp_path, capsys, monkeypatch):
    """The runs call write_loss_curve on the way out of training (finished, preempted or failed): it prints the
    PNG's path, says when nothing was logged, and turns a write error into a line instead of masking the run's own
    outcome."""
    from train.runtime import plot

    assert plot.write_loss_curve(tmp_path) is None  # no metrics.jsonl: stopped before any log
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 0.5}) + "\n")
    assert plot.write_loss_curve(tmp_path) == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").is_file()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "plot_loss", full_disk)
    assert plot.write_loss_curve(tmp_path) is None
    assert capsys.readouterr().out.splitlines() == [
        "loss curve: no step was logged", f"loss curve: {tmp_path / 'loss.png'}",
        "loss curve: not written ([Errno 28] No space left on device)"]


def test_a_terminal_of_no_width_gets_plain_lines():
    """is_terminal: a pseudo-terminal with columns is one (tqdm's bar); one of 0 columns (`script`, some container
    runtimes) is not, since tqdm would draw its bar as nothing; a file or StringIO is not."""
    import fcntl
    import io
    import os
    import struct
    import termios

    from train.runtime.console import is_terminal

    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            for columns, expected in ((80, True), (0, False)):
                fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
                assert is_terminal(tty) is expected
    finally:
        os.close(leader)
        os.close(follower)
    assert not is_terminal(io.StringIO())
