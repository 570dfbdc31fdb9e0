"""Rank-0 output: progress bar, metrics.jsonl, tensorboard. Other ranks get a sink that does nothing."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import psutil
import torch


class _Prefixed:
    """A text stream that starts every line with `prefix` (for the output of ranks other than 0)."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding ... of the wrapped stream
        return getattr(self.stream, name)


def prefix_rank_output(environ=None) -> None:
    """Tag every stdout/stderr line of a non-zero rank with its rank and node (launcher env variables); every command
    calls it first. Off a terminal, the libraries' own progress bars are turned off too (library_bars_off_terminal)."""
    library_bars_off_terminal()
    env = os.environ if environ is None else environ
    rank = int(env.get("RANK", "0"))
    if rank != 0:
        prefix = f"[rank {rank} node {env.get('CROSS_RANK', '0')}] "
        sys.stdout, sys.stderr = _Prefixed(sys.stdout, prefix), _Prefixed(sys.stderr, prefix)


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal a bar can be drawn on: a tty with a width (a pseudo-terminal of 0 columns, as
    `script` or some container runtimes open, would show tqdm's bar as nothing at all)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor (a StringIO), or a closed one
        return bool(getattr(stream, "isatty", lambda: False)())


def library_bars_off_terminal(stream=None) -> bool:
    """Turn transformers' and diffusers' own progress bars off (loading weights, pipeline components) when `stream`
    (sys.stderr, where they draw) is not a terminal: in a log each of their redraws would join one long line. True
    when they were turned off."""
    stream = sys.stderr if stream is None else stream
    if is_terminal(stream):
        return False
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # also huggingface_hub's
    diffusers_logging.disable_progress_bar()
    return True


def _tqdm_lines():
    """tqdm printing a whole line per refresh instead of redrawing one (tqdm's documented way: override display)."""
    from tqdm import tqdm

    class LineTqdm(tqdm):
        def display(self, msg=None, pos=None):
            if msg == "":  # tqdm clearing its line on close: there is no line to clear in a log
                return False
            self.fp.write(f"{self if msg is None else msg}\n")
            self.fp.flush()
            return True

        def close(self):
            if not self.disable and self.n != self.last_print_n:
                self._ema_dt = lambda: None  # the last line's rate: the whole run's mean, as tqdm's own close
                self.display()
            super().close()

    return LineTqdm


def progress(iterable=None, *, desc: str, unit: str, total: int | None = None, disable: bool = False, file=None,
             interval_s: float = 10.0):
    """A tqdm bar over `iterable` on `file` (default sys.stderr, as tqdm's) when that is a terminal; elsewhere (a
    log, a pipe, a batch job) the same tqdm text as one plain line every `interval_s` seconds and at the end, so
    that a phase longer than that shows it is moving."""
    file = sys.stderr if file is None else file
    if is_terminal(file):
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, unit=unit, total=total, disable=disable, file=file, dynamic_ncols=True)
    return _tqdm_lines()(iterable, desc=desc, unit=unit, total=total, disable=disable, file=file, leave=False,
                         mininterval=interval_s, maxinterval=interval_s)


def print0(*args, rank: int = 0, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


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


def _duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m: short enough for a log line."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(record: dict, total_steps: int) -> str:
    """One greppable line per logged step (for logs that are not a terminal: Slurm, nohup, `> log`); the ETA is
    the window's step time times the steps left. Fields a record lacks are left out."""
    step, parts = record["step"], [f"step {record['step']}/{total_steps}"]
    formats = {"epoch": "epoch {}", "loss": "loss {:.4f}", "lr": "lr {:.2e}", "grad_norm": "grad_norm {:.3g}",
               "step_time_s": "step_time {:.3f}s", "samples_per_s": "{:.2f} samples/s"}
    for key, form in formats.items():
        if key in record:
            parts.append(form.format(record[key]) if record[key] is not None else f"{key} n/a")
    if "step_time_s" in record:
        parts.append(f"ETA {_duration(record['step_time_s'] * max(total_steps - step, 0))}")
    return " | ".join(parts)


class Metrics:
    """Writes each logged record to OUT/metrics.jsonl and tensorboard; shows progress on stdout.

    On a terminal a tqdm bar, started by the first step (so work before it, such as validation's 'before'
    images, stays out of its rate and ETA); elsewhere (a file, a pipe, a batch job) one plain line per logged
    step instead, since a bar's carriage returns would make the whole run one line.
    """

    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 gpu_monitor=None, interactive: bool | None = None):
        self.gpu_monitor = gpu_monitor  # a gpumon.GpuMonitor: each record gets its GPUs' window summary
        self.total_steps, self.start_step = total_steps, start_step
        self.interactive = is_terminal(sys.stdout) if interactive is None else interactive
        self.bar = None

        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def _bar(self):
        if self.bar is None and self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=self.start_step, desc="train", unit="step",
                            file=sys.stdout, dynamic_ncols=True)
        return self.bar

    @staticmethod
    def truncate(out_dir: str | Path, last_step: int) -> None:
        """Keep only records up to `last_step` (a resumed run trains the later steps again). A line that is no
        record (the torn last line of a run killed while writing it) is dropped and reported."""
        path = Path(out_dir) / "metrics.jsonl"
        if not path.is_file():
            return
        keep = []
        for n, line in enumerate(path.read_text(errors="replace").split("\n"), start=1):
            try:
                step = json.loads(line)["step"] if line.strip() else None
            except (json.JSONDecodeError, TypeError, KeyError):
                print(f"{path} line {n}: not a complete record (a write cut short); dropped", flush=True)
                continue
            if step is not None and step <= last_step:
                keep.append(line)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)

    def step(self, n: int = 1) -> None:
        if self._bar() is not None:
            self.bar.update(n)

    def unpause(self) -> None:
        """Work between two steps that is not training (a validation render, a checkpoint save) is over: the bar's
        clock restarts from its last print (tqdm's unpause), so its rate and ETA leave that time out."""
        if self.bar is not None:
            self.bar.unpause()

    def log(self, record: dict) -> None:
        if self.gpu_monitor is not None:
            record = {**record, **self.gpu_monitor.window()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, record["step"])
        if self._bar() is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 sps=f"{record['samples_per_s']:.2f}")
        else:
            print(progress_line(record, self.total_steps), flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)  # above the bar, which then redraws
        else:
            print(text, flush=True)

    def image(self, tag: str, image, step: int) -> None:
        """A PIL image into tensorboard (when enabled)."""
        if self.writer is not None:
            import numpy as np

            self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
            self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 x a power of ten apart) inside [lo, hi], for an axis's labels."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _loss_points(metrics_path: Path) -> list[tuple[int, float]]:
    """(step, loss) of every record with a finite loss; lines that are no record (a torn write) are skipped."""
    points = []
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        loss = record.get("loss") if isinstance(record, dict) else None
        if isinstance(loss, (int, float)) and math.isfinite(loss) and isinstance(record.get("step"), int):
            points.append((record["step"], float(loss)))
    return points


_PLOT_MARGINS = (72, 20, 32, 44)  # left, right, top, bottom: px around the plot area of loss.png


def _draw_axes(draw, size: tuple[int, int], steps: tuple[float, float], losses: tuple[float, float], xy) -> None:
    """The frame, grey grid lines at round values of both axes with their labels, and the axis names."""
    width, height = size
    left, right, top, bottom = _PLOT_MARGINS
    for loss in nice_ticks(*losses):
        y = xy(steps[0], loss)[1]
        draw.line([left, y, width - right, y], fill=(225, 225, 225))
        draw.text((4, y - 6), f"{loss:.4g}", fill="black")
    for step in nice_ticks(*steps):
        x = xy(step, losses[0])[0]
        draw.line([x, top, x, height - bottom], fill=(225, 225, 225))
        draw.text((x - 3 * len(f"{step:g}"), height - bottom + 4), f"{step:g}", fill="black")
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text(((left + width - right) // 2 - 12, height - 18), "step", fill="black")
    draw.text((4, top - 16), "loss", fill="black")


def plot_loss(metrics_path: str | Path, out_path: str | Path, size: tuple[int, int] = (640, 360)) -> Path | None:
    """OUT/loss.png from metrics.jsonl: the logged loss (each record the mean of its window) against the step, on
    round-valued grid lines; None when no step was logged. Drawn with Pillow: matplotlib is not a dependency."""
    from PIL import Image, ImageDraw

    points = _loss_points(Path(metrics_path))
    if not points:
        return None
    width, height = size
    left, right, top, bottom = _PLOT_MARGINS
    (s0, s1), (l0, l1) = ((min(v), max(v)) for v in zip(*points, strict=True))
    s1 = max(s1, s0 + 1)
    pad = (l1 - l0) * 0.05 or abs(l0) * 0.05 or 1e-12  # a little room above and below the curve
    l0, l1 = l0 - pad, l1 + pad

    def xy(step: float, loss: float) -> tuple[float, float]:
        return (left + (step - s0) / (s1 - s0) * (width - left - right),
                height - bottom - (loss - l0) / (l1 - l0) * (height - top - bottom))

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    _draw_axes(draw, size, (s0, s1), (l0, l1), xy)
    if len(points) > 1:
        draw.line([xy(*p) for p in points], fill=(40, 80, 220), width=2)
    else:
        x, y = xy(*points[0])
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(40, 80, 220))
    (first_step, first), (last_step, last) = points[0], points[-1]
    draw.text((left + 40, 8), f"training loss: {first:.4g} at step {first_step} -> {last:.4g} at step {last_step}",
              fill="black")
    out_path = Path(out_path)
    image.save(out_path)
    return out_path


def write_loss_curve(out_dir: str | Path) -> Path | None:
    """OUT/loss.png from OUT/metrics.jsonl, its path printed. The runs call it on the way out of training, whether
    it finished, was preempted or stopped on an error (a diverging loss is worth a look), so nothing here raises."""
    metrics_path = Path(out_dir) / "metrics.jsonl"
    try:
        curve = plot_loss(metrics_path, Path(out_dir) / "loss.png") if metrics_path.is_file() else None
    except OSError as e:  # a full disk or a read-only directory: the run's own outcome matters more
        print(f"loss curve: not written ({e})", flush=True)
        return None
    print(f"loss curve: {curve}" if curve else "loss curve: no step was logged", flush=True)
    return curve


class NullMetrics:
    def step(self, n: int = 1) -> None: ...
    def unpause(self) -> None: ...
    def log(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def image(self, tag: str, image, step: int) -> None: ...
    def close(self) -> None: ...


class Throughput:
    """Wall time and samples between two log points (callers sync the device before `read`)."""

    def __init__(self):
        self.t0, self.samples, self.tokens = time.perf_counter(), 0, 0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.t0, 1e-9)

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside is left out of the window (validation renders, checkpoint saves, exports between two
        steps): step_time_s, samples/s and the ETA then describe training alone."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t0 += time.perf_counter() - start

    def read(self, steps: int) -> dict:
        elapsed = self.elapsed()
        out = {"step_time_s": elapsed / max(steps, 1), "samples_per_s": self.samples / elapsed,
               "tokens_per_s": self.tokens / elapsed}
        self.__init__()
        return out
