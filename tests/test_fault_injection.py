"""Fault injection is read once: loop.train parses the QWEN_EDIT_* variables before its first step and calls into
train.faults per micro-step only when a fault is requested (in-process, a stand-in engine; test_faults.py runs
the real trainer under each fault)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

from train.config import Config, ProjectConfig
from train.data.sources import Batch
from train.model.qwen_image import batches
from train.runtime import faults
from train.runtime.engine import Dist
from train.runtime.oom import OutOfMemory
from train.trainer import loop


class CountingEnviron(dict):
    """os.environ's stand-in: counts the reads of every QWEN_EDIT_* key."""

    def __init__(self, values):
        super().__init__(values)
        self.reads = Counter()

    def _count(self, key):
        if isinstance(key, str) and key.startswith("QWEN_EDIT_"):
            self.reads[key] += 1

    def __getitem__(self, key):
        self._count(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._count(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._count(key)
        return super().__contains__(key)


class Engine(torch.nn.Module):
    """The DeepSpeed engine's part that loop.train uses; SGD on one weight, an update skipped when its gradient
    is not finite (as DeepSpeed's overflow check does). `env_reads_at_forward`: QWEN_EDIT_* reads so far, per call."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.env_reads_at_forward: list[int] = []
        self.applied = True

    def forward(self, hidden_states, **kwargs):
        self.env_reads_at_forward.append(sum(os.environ.reads.values()))
        return (hidden_states.float() * self.weight,)

    def backward(self, loss):
        loss.backward()

    def step(self):
        grad = self.weight.grad
        self.applied = bool(grad is None or grad.isfinite().all())
        if self.applied and grad is not None:
            with torch.no_grad():
                self.weight -= 0.1 * grad
        self.weight.grad = None

    def was_step_applied(self):
        return self.applied

    def get_lr(self):
        return [0.1]

    def get_global_grad_norm(self):
        return None


class Source:
    """`num` micro-batches of 4 target tokens, no reference, 3 prompt tokens."""

    def __init__(self, num: int):
        g = torch.Generator().manual_seed(0)
        cond = batches.Conditioning(torch.randn(1, 3, 8, generator=g), None, torch.zeros(1, 0, 16), [])
        self.batches = [Batch(torch.randn(1, 4, 16, generator=g), (2, 2), cond) for _ in range(num)]

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def start_epoch(self, epoch, skip):
        pass

    def take_wait_s(self):
        return 0.0


class Metrics:
    def __init__(self):
        self.records, self.messages = [], []

    def step(self):
        pass

    def unpause(self):
        pass

    def log(self, record):
        self.records.append(record)

    def message(self, text):
        self.messages.append(text)


def run(monkeypatch, env: dict[str, str], max_steps: int, gas: int = 2):
    """loop.train over the stand-ins with `env` as the whole environment; (engine, metrics, the calls into
    train/faults.py as (function name, forwards run before it))."""
    monkeypatch.setattr(os, "environ", CountingEnviron(env))
    monkeypatch.setattr(loop.checkpoint, "save", lambda *args, **kwargs: None)
    cfg = Config(ProjectConfig(), deepspeed={"gradient_accumulation_steps": gas})
    cfg.project.train.max_steps = max_steps
    cfg.project.output.log_every_steps = 1
    engine, metrics, calls = Engine(), Metrics(), []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == faults.__file__:
            calls.append((frame.f_code.co_name, len(engine.env_reads_at_forward)))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        loop.train(cfg, Dist(0, 1, 0, torch.device("cpu")), engine, Source(4), {}, metrics, {"variant": "edit"})
    finally:
        sys.setprofile(previous)
    return engine, metrics, calls


def test_no_fault_requested_reads_the_environment_once_and_adds_no_call(monkeypatch):
    """Without a QWEN_EDIT_* fault: each variable is read once, before the first forward; nothing in train.faults
    runs after the plan is made, however many steps the loop takes."""
    engine, metrics, calls = run(monkeypatch, {}, max_steps=6)
    assert len(engine.env_reads_at_forward) == 12  # 6 steps x GAS 2
    assert set(engine.env_reads_at_forward) == {4}  # no read after the plan, none per step
    assert os.environ.reads == {faults.FAIL_SAVE_AT: 1, faults.NAN_LOSS_AT: 1, faults.OOM_AT: 1, faults.HOLD_AT: 1}
    assert {name for name, _ in calls} >= {"from_env", "around_loss"}
    assert all(forwards == 0 for _, forwards in calls), calls  # every call is made before the loop
    assert [r["step"] for r in metrics.records] == list(range(1, 7))


def test_requested_nan_loss_fires_at_its_step_only(monkeypatch):
    """QWEN_EDIT_NAN_LOSS_AT=3: step 3 (both micro-batches) is skipped, the steps before it train exactly as in a
    run without faults; the environment is still read only once."""
    _, plain, _ = run(monkeypatch, {}, max_steps=5)
    engine, faulty, calls = run(monkeypatch, {faults.NAN_LOSS_AT: "3"}, max_steps=5)
    assert set(engine.env_reads_at_forward) == {4}
    hooked = [forwards for name, forwards in calls if name == "faulty"]
    assert hooked == list(range(10))  # only a requested fault adds a call per micro-step (5 steps x GAS 2)
    assert [r["step"] for r in faulty.records] == [1, 2, 4, 5]
    assert [r["skipped_steps"] for r in faulty.records] == [0, 0, 1, 1]
    assert faulty.messages == ["warning: step 3 skipped: non-finite loss or gradient norm (1 of at most 10)"]
    assert [r["loss"] for r in faulty.records[:2]] == [r["loss"] for r in plain.records[:2]]


def test_requested_oom_fires_at_its_step(monkeypatch):
    """QWEN_EDIT_OOM_AT=2: the first micro-batch of step 2 raises, reported as the trainer's OutOfMemory."""
    with pytest.raises(OutOfMemory, match="CUDA out of memory at step 2: micro-batch 1"):
        run(monkeypatch, {faults.OOM_AT: "2"}, max_steps=4)


def test_requested_hold_waits_before_its_steps_forward(monkeypatch):
    """QWEN_EDIT_HOLD_AT=3: step 3 waits HOLD_S before its forward (the killed-rank test holds the run there, so
    that the kill lands between two known checkpoints); the other steps do not wait."""
    slept, seen = [], []
    monkeypatch.setattr(faults, "hold", slept.append)
    faulty = faults.FaultPlan.from_env({faults.HOLD_AT: "3"}).around_loss(
        lambda step: seen.append((step, len(slept))) or torch.ones(()))
    for step in (1, 2, 3, 4):
        faulty(step)
    assert slept == [faults.HOLD_S] and seen == [(1, 0), (2, 0), (3, 1), (4, 1)]


def test_a_hold_waits_its_time_or_ends_at_sigterm():
    """faults.hold waits its seconds; a SIGTERM (the launcher ending the job after a rank died) ends it at once and
    still reaches the handler that was in place, which is back afterwards."""
    import os
    import signal
    import threading
    import time

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        start = time.monotonic()
        faults.hold(0.3)
        assert time.monotonic() - start >= 0.3 and received == []
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        start = time.monotonic()
        faults.hold(60)
        timer.join()
        assert time.monotonic() - start < 10 and received == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the handler in place again
        time.sleep(0.2)
        assert received == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_plan_parses_once_and_names_a_bad_value():
    plan = faults.FaultPlan.from_env({faults.NAN_LOSS_AT: "2, 3", faults.OOM_AT: ""})
    assert plan == faults.FaultPlan(nan_loss_at=frozenset({2, 3}))
    loss = lambda step: torch.ones(())  # noqa: E731
    assert faults.FaultPlan().around_loss(loss) is loss
    with pytest.raises(ValueError, match="QWEN_EDIT_OOM_AT='two': not a comma-separated list"):
        faults.FaultPlan.from_env({faults.OOM_AT: "two"})
