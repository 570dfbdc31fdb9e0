"""Fault injection for the fault-tolerance tests, driven by environment variables (unset in normal runs).

QWEN_EDIT_FAIL_SAVE_AT=N      the save of step N raises ENOSPC after every rank wrote its files, before commit
QWEN_EDIT_NAN_LOSS_AT=N,M     the loss of optimizer steps N, M (1-based) is replaced by NaN
QWEN_EDIT_OOM_AT=N            step N raises torch.cuda.OutOfMemoryError
"""

from __future__ import annotations

import errno
import os

import torch


def _steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}


def maybe_fail_save(step: int) -> None:
    if step in _steps("QWEN_EDIT_FAIL_SAVE_AT"):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def maybe_poison_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    return loss * float("nan") if step in _steps("QWEN_EDIT_NAN_LOSS_AT") else loss


def maybe_oom(step: int) -> None:
    if step in _steps("QWEN_EDIT_OOM_AT"):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
