"""Stopping on SIGTERM (preemption, scancel, kill): every rank saves a checkpoint at the next optimizer step, then
the job ends with exit code 143 (128 + SIGTERM) so that a scheduler does not take it for a finished run.

How the signal reaches the ranks: `bash launch.sh` forwards SIGTERM/SIGINT to the whole process group of the
deepspeed launcher (DeepSpeed's single-node runner ignores signals, so a kill of the runner alone used to leave
the ranks training on); DeepSpeed's per-node launch.py then sends SIGTERM to every rank's process tree and kills
what is left 30 s later. A rank notices the signal, or that its launcher lost its parent (the runner died without
forwarding: `deepspeed` started directly and killed), at the end of an optimizer step. The ranks agree by an
all-reduce, so that all of them save the same step together, and the save must fit in DeepSpeed's 30 s.

The model-parallel mode (model_parallel/runner.py) has two worlds: the encoders feed the decoders, which train and
save. A signal may reach only one of them (DeepSpeed's launch.py terminates its ranks one at a time, the encoder of
launch rank 0 first, and gives each 30 s), so the request travels through the launch-wide TCPStore: a process that
was signalled sets REQUEST_KEY; the decoders look for it at every optimizer step, agree, set STOP_KEY and save; the
encoders then stop sending micro-batches and close their streams (stages.run_encoder), and wait for SAVED_KEY
before they exit, so that no process of the job ends before the checkpoint is written.
"""

from __future__ import annotations

import os
import signal

import psutil
import torch
import torch.distributed as dist

EXIT_CODE = 128 + signal.SIGTERM
REQUEST_KEY, STOP_KEY, SAVED_KEY = "preempt/request", "preempt/stop", "preempt/saved"


class Preempted(Exception):
    """A SIGTERM asked the run to stop; the checkpoint of `step` has been saved."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"stopped by SIGTERM after saving the checkpoint of step {step}; resume with --resume")


class Watch:
    """Notes SIGTERM (and the launcher's runner going away) for `requested`; restores the old handler on close.

    `group`: the processes that stop together (None = the default world). `store` (model parallel): the
    launch-wide store through which a request reaches the other role world (see the module docstring)."""

    def __init__(self, group=None, store=None):
        self.signalled = False
        self.group, self._store = group, store
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

    def asked(self) -> bool:
        """Whether this process was asked to stop; with a store, also tells the other processes of the launch."""
        flag = self.signalled or self._runner_gone()
        if flag and self._store is not None:
            self._store.set(REQUEST_KEY, "1")
        return flag

    def requested(self, device: torch.device) -> bool:
        """Whether any process was asked to stop (a collective over the watch's group; a sync point: one int
        all-reduce per optimizer step). With a store, a True verdict is published as STOP_KEY."""
        flag = self.asked() or (self._store is not None and self._store.check([REQUEST_KEY]))
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            value = torch.tensor([int(flag)], device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(value.item())
        if flag and self._store is not None:
            self._store.set(STOP_KEY, "1")
        return flag

    def stopping(self) -> bool:
        """Model parallel, encoder side: whether the decoders have decided to stop (they need no more input)."""
        return self._store is not None and self._store.check([STOP_KEY])

    def saved(self) -> None:
        """Decoder side: the preemption checkpoint is written."""
        if self._store is not None:
            self._store.set(SAVED_KEY, "1")

    def wait_saved(self, timeout_s: float) -> None:
        """Encoder side: stay until the decoders have saved (this process may host the store, and an early
        exit of any rank makes the launcher terminate the others)."""
        from datetime import timedelta

        self._store.wait([SAVED_KEY], timedelta(seconds=timeout_s))

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
