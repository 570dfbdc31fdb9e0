"""Stopping on SIGTERM (preemption, scancel, kill): every rank saves a checkpoint at the next optimizer step, then
the job ends with exit code 143 (128 + SIGTERM) so that a scheduler does not take it for a finished run.

How the signal reaches the ranks: `bash launch.sh` forwards SIGTERM/SIGINT to the whole process group of the
deepspeed launcher (DeepSpeed's single-node runner ignores signals, so a kill of the runner alone used to leave
the ranks training on); DeepSpeed's per-node launch.py then sends SIGTERM to every rank's process tree and kills
what is left 30 s later. A rank notices the signal, or that its launcher lost its parent (the runner died without
forwarding: `deepspeed` started directly and killed), at the end of an optimizer step. The ranks agree by an
all-reduce, so that all of them save the same step together, and the save must fit in DeepSpeed's 30 s.
"""

from __future__ import annotations

import os
import signal

import psutil
import torch
import torch.distributed as dist

EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """A SIGTERM asked the run to stop; the checkpoint of `step` has been saved."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"stopped by SIGTERM after saving the checkpoint of step {step}; resume with --resume")


class Watch:
    """Notes SIGTERM (and the launcher's runner going away) for `requested`; restores the old handler on close."""

    def __init__(self):
        self.signalled = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._launcher = _launcher()
        self._runner = self._launcher.ppid() if self._launcher is not None else None

    def _handle(self, signum, frame) -> None:
        self.signalled = True  # acted on at the next optimizer step: a handler may not save in mid-collective

    def _runner_gone(self) -> bool:
        if self._launcher is None:
            return False
        try:
            return self._launcher.ppid() != self._runner
        except psutil.Error:
            return True  # the launcher itself is gone

    def requested(self, device: torch.device, group=None) -> bool:
        """Whether any rank was asked to stop (a collective over `group`; a sync point: one int all-reduce per
        optimizer step)."""
        flag = self.signalled or self._runner_gone()
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            return flag
        value = torch.tensor([int(flag)], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _launcher() -> psutil.Process | None:
    """DeepSpeed's launch.py that started this rank, when it did (its runner is then the launcher's parent)."""
    if "LOCAL_RANK" not in os.environ:
        return None
    try:
        parent = psutil.Process(os.getppid())
        return parent if "deepspeed.launcher.launch" in " ".join(parent.cmdline()) else None
    except psutil.Error:
        return None
