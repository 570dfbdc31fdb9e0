"""Rank-0 records of the run: each logged record into OUT/metrics.jsonl and tensorboard with progress on stdout
(Metrics), a sink that does nothing on the other ranks (NullMetrics), and the wall time and samples of a log window
(Throughput)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from train.runtime.console import is_terminal, progress_line


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
