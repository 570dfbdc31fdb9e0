"""Fault injection for the fault-tolerance tests, driven by environment variables (unset in normal runs).

QWEN_EDIT_FAIL_SAVE_AT=N      the save of step N raises ENOSPC after every rank wrote its files, before commit
QWEN_EDIT_NAN_LOSS_AT=N,M     the loss of optimizer steps N, M (1-based) is replaced by NaN
QWEN_EDIT_OOM_AT=N            step N raises torch.cuda.OutOfMemoryError
QWEN_EDIT_HOLD_AT=N           step N waits (HOLD_S, or until SIGTERM) before its forward: a hung step, so that a test
                              can kill a rank at a known point (after step N-1's log line and before step N's save)

The training loop reads these once, into a `FaultPlan`, before its first step, and wraps its loss function only
when a step fault is requested: a normal run's hot loop neither parses the environment nor calls into this module.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

FAIL_SAVE_AT, NAN_LOSS_AT, OOM_AT = "QWEN_EDIT_FAIL_SAVE_AT", "QWEN_EDIT_NAN_LOSS_AT", "QWEN_EDIT_OOM_AT"
HOLD_AT = "QWEN_EDIT_HOLD_AT"
HOLD_S = 600.0  # longer than any test waits for a held run
HOLD_POLL_S = 0.1

StepLoss = Callable[..., torch.Tensor]
"""loss_of(step, *args): the loss of one micro-batch of optimizer step `step` (1-based)."""


def _steps(environ: Mapping[str, str], name: str) -> frozenset[int]:
    text = environ.get(name, "")
    try:
        return frozenset(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a comma-separated list of optimizer steps (e.g. 2,3); fix it or "
                         "unset it") from None


@dataclass(frozen=True)
class FaultPlan:
    """The optimizer steps (1-based) whose save fails, whose loss is NaN, that run out of memory, that hang; empty
    normally."""

    fail_save_at: frozenset[int] = frozenset()
    nan_loss_at: frozenset[int] = frozenset()
    oom_at: frozenset[int] = frozenset()
    hold_at: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan the QWEN_EDIT_* variables of `environ` (None = os.environ) ask for."""
        environ = os.environ if environ is None else environ
        return cls(_steps(environ, FAIL_SAVE_AT), _steps(environ, NAN_LOSS_AT), _steps(environ, OOM_AT),
                   _steps(environ, HOLD_AT))

    def around_loss(self, loss_of: StepLoss) -> StepLoss:
        """`loss_of` itself when no step fault is requested; otherwise a wrapper that waits HOLD_S before the
        forward of a step in `hold_at`, raises the injected OOM before the forward of a step in `oom_at` and turns
        the loss of a step in `nan_loss_at` into NaN."""
        if not (self.oom_at or self.nan_loss_at or self.hold_at):
            return loss_of

        def faulty(step: int, *args, **kwargs) -> torch.Tensor:
            if step in self.hold_at:
                hold(HOLD_S)
            if step in self.oom_at:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
            loss = loss_of(step, *args, **kwargs)
            return loss * float("nan") if step in self.nan_loss_at else loss

        return faulty

    def check_save(self, step: int) -> None:
        """Raise the injected ENOSPC when the save of `step` is asked to fail."""
        if step in self.fail_save_at:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")


def hold(seconds: float) -> None:
    """Wait `seconds`, or until a SIGTERM reaches the handler in place (the trainer's, which still runs): when
    another rank dies, the launcher ends the job with SIGTERM, and a held rank that waited on would only be
    killed after the launcher's 30 s of grace. Without a handler of Python's, SIGTERM ends the process anyway."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        time.sleep(seconds)
        return
    asked = []

    def handle(signum, frame):
        asked.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGTERM, handle)
    try:
        deadline = time.monotonic() + seconds
        while not asked and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_S)
    finally:
        signal.signal(signal.SIGTERM, previous)


def maybe_fail_save(step: int) -> None:
    """checkpoint.save's hook: runs once per save (never per micro-step), so it reads the environment each time."""
    FaultPlan.from_env().check_save(step)
