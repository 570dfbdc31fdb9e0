"""Console output: rank prefixes on other ranks' lines, print0 (rank 0 only), tqdm progress on a terminal or plain lines
in a log, and the one-line progress record of a logged step."""

from __future__ import annotations

import os
import sys


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
