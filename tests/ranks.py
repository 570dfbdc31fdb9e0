"""CPU ranks over gloo that stay up for a test module: spawned once, each joins the process group as DeepSpeed's
launcher sets a rank up, then runs the jobs it is sent. A module of many small distributed cases pays one start of
Python, torch and DeepSpeed per rank (seconds of CPU each) instead of one per case; the process group and
DeepSpeed's state stay out of pytest's process."""

from __future__ import annotations

import gc
import os
import queue as queues
import traceback
from collections.abc import Callable
from typing import Any

from conftest import free_port


class Ranks:
    """`world` spawned ranks; `run(job, *args)` calls job(rank, world, *args) on every rank and returns rank -> its
    result. A job that raises on any rank fails the caller with that rank's traceback, and the ranks are replaced
    (the others may wait in a collective forever), so the next case starts from fresh processes."""

    def __init__(self, world: int):
        self.world = world
        self._procs: list = []

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results, port = ctx.Queue(), free_port()
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world, port, self._jobs[r], self._results))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, job: Callable[..., Any], *args) -> dict[int, Any]:
        if not self._procs:
            self._start()
        for jobs in self._jobs:
            jobs.put((job, args))
        results: dict[int, Any] = {}
        while len(results) < self.world:
            try:
                rank, ok, out = self._results.get(timeout=2)
            except queues.Empty:
                if not all(p.is_alive() for p in self._procs):
                    codes = [p.exitcode for p in self._procs]
                    self.close()
                    raise AssertionError(f"a rank died (exit codes {codes})") from None
                continue
            if not ok:
                self.close()
                raise AssertionError(f"rank {rank} of {job.__name__}{args}:\n{out}")
            results[rank] = out
        return results

    def close(self) -> None:
        """Let the ranks leave the group and exit; a rank still busy (stuck in a collective) is terminated."""
        for jobs in self._jobs if self._procs else ():
            jobs.put(None)
        for p in self._procs:
            p.join(20)
            if p.is_alive():
                p.terminate()
                p.join()
        self._procs = []


def join(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of `world` CPU processes over gloo, as DeepSpeed's launcher sets one up and as the
    trainer joins (engine.skip_cpu_shm_op: no JIT build of DeepSpeed's shared-memory op, which training never calls)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed

    from train.runtime.engine import skip_cpu_shm_op

    skip_cpu_shm_op()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _serve(rank: int, world: int, port: int, jobs, results) -> None:
    join(rank, world, port)
    import torch

    while (item := jobs.get()) is not None:
        job, args = item
        try:
            results.put((rank, True, job(rank, world, *args)))
        except Exception:  # reported to the test with its traceback
            results.put((rank, False, traceback.format_exc()))
        gc.collect()  # what the job left is gone before the next one measures anything
    torch.distributed.destroy_process_group()
