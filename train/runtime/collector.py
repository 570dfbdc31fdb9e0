"""Python's garbage collector under the training loop's control (train.gc_every_steps), as large trainers run it.

Left to itself, the collector starts a collection whenever enough objects have been allocated, wherever the program
is; now and then that is a full collection, which walks every object the process tracks (the libraries', the model's
modules and parameters, DeepSpeed's state, torch.compile's graphs) and took 0.88-1.35 s of every 12th step of the 2509
step on an H200, the GPU idle meanwhile. Under control:
- gc.freeze() once the model and data are loaded: what exists then lives as long as the run, and no collection walks
  it again; and once more, after a full collection, when the first WARM_STEPS steps are done: torch.compile's graphs
  and guards, DeepSpeed's buffers and the optimizer's state, all made by the first steps, are as long-lived, and each
  full collection would otherwise walk them again. The price: an object alive at a freeze that becomes cyclic garbage
  later is never freed, at most what was alive at the two freezes;
- automatic collection off during the steps, and a young collection (generations 0 and 1) every N steps, at the same
  step on every rank, right after the optimizer step was queued, while the GPU still has its kernels to run;
- a full collection at a log boundary now and then, since a young collection only moves the objects alive at that
  moment into the oldest generation: one that becomes cyclic garbage afterwards (a batch or a closure that outlived
  its step inside a reference cycle) would otherwise never be freed, and the memory would grow for the whole run;
- between the steps (checkpoint saves, validation renders, exports) automatic collection as before.
The collector's seconds stay in metrics.jsonl's gc_s (probes.gc_seconds counts every collection).
"""

from __future__ import annotations

import contextlib
import gc
import os

FULL_EVERY_STEPS = 100  # the least number of steps between two full collections (the next log boundary after them)
WARM_STEPS = 3  # steps after the start that make long-lived objects (compilation, DeepSpeed's lazy state): then frozen

_controlling = False  # whether a Collector has automatic collection off in this process now


def _enable_in_child() -> None:
    """A process forked while the loop holds the collector (a DataLoader worker) runs no step of this loop: it gets
    automatic collection back (the frozen objects stay frozen there too, so its collections leave the parent's pages
    unwritten)."""
    if _controlling:
        gc.enable()


os.register_at_fork(after_in_child=_enable_in_child)


class Collector:
    """`with Collector(every_steps, start_step) as c:` around the loop, `c.after_step(step, at_log)` after each
    optimizer step, `with c.automatic():` around the work between steps. every_steps 0 leaves gc untouched."""

    def __init__(self, every_steps: int, start_step: int = 0):
        self.every_steps = every_steps
        self.last_full = start_step
        self.warm_step = start_step + WARM_STEPS  # the step after which the warm-up's objects are frozen
        self.was_enabled = gc.isenabled()

    def __enter__(self) -> Collector:
        global _controlling
        if self.every_steps:
            self.was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()  # loading's garbage, so that it is not frozen with the long-lived objects
            gc.freeze()
            _controlling = True
        return self

    def __exit__(self, *exc) -> None:
        global _controlling
        if self.every_steps:
            _controlling = False
            gc.unfreeze()  # a later run in this process (tests, the demo) must find its objects collectable again
            if self.was_enabled:
                gc.enable()

    def after_step(self, step: int, at_log: bool) -> None:
        """Optimizer step `step` is queued; `at_log`: its record is due. After the warm-up's last step a full
        collection and a freeze; a full collection at a log boundary once FULL_EVERY_STEPS steps have passed since the
        last one (its seconds then land in the record it closes); else a young one every `every_steps` steps."""
        if not self.every_steps:
            return
        if step == self.warm_step:
            gc.collect()
            gc.freeze()
            self.last_full = step
        elif at_log and step - self.last_full >= FULL_EVERY_STEPS:
            gc.collect()
            self.last_full = step
        elif step % self.every_steps == 0:
            gc.collect(1)

    @contextlib.contextmanager
    def automatic(self):
        """Automatic collection inside the block (work between steps: saves, renders, exports), as without control."""
        if not self.every_steps or not self.was_enabled:
            yield
            return
        gc.enable()
        try:
            yield
        finally:
            gc.disable()
