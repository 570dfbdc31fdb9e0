"""train.gc_every_steps (train/runtime/collector.py) in loop.train over stand-ins of the engine and the data: automatic
collection off during the steps, collections exactly at the cadence, memory bounded under cyclic garbage, and the
key at 0 leaving Python's collector alone."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import pytest
import torch
from test_fault_injection import Engine as _Engine
from test_fault_injection import Metrics, Source

from train.config import Config, ProjectConfig
from train.runtime import collector
from train.runtime.engine import Dist
from train.trainer import loop


class Node:
    """One step's cyclic garbage: it refers to itself and carries a payload."""

    def __init__(self):
        self.me, self.payload = self, [[] for _ in range(20)]


class Engine(_Engine):
    """Records whether automatic collection was on in each forward (and the objects frozen), counts the optimizer
    steps; with `cycles`, each forward leaves a Node alive until the next one (so it outlives the step's collection,
    then is garbage)."""

    def __init__(self, cycles: bool = False):
        super().__init__()
        self.steps, self.automatic, self.frozen, self.cycles, self.held = 0, [], [], cycles, None
        self.nodes, self.alive = weakref.WeakSet(), []

    def forward(self, hidden_states, **kwargs):
        self.automatic.append(gc.isenabled())
        if len(self.frozen) < 5:  # get_freeze_count walks the frozen objects: the first steps' are enough
            self.frozen.append(gc.get_freeze_count())
        if len(self.frozen) == 2:  # long-lived objects made by a warm-up step, as compilation makes them
            self.compiled = [[] for _ in range(1000)]
        if self.cycles:
            self.held = Node()
            self.nodes.add(self.held)
            self.alive.append(len(self.nodes))
        return (hidden_states.float() * self.weight,)

    def step(self):
        super().step()
        self.steps += 1


def train(monkeypatch, engine: Engine, every: int, max_steps: int, log_every: int) -> None:
    monkeypatch.setattr(loop.checkpoint, "save", lambda *args, **kwargs: None)
    cfg = Config(ProjectConfig(), deepspeed={"gradient_accumulation_steps": 1})
    cfg.project.train.max_steps, cfg.project.train.gc_every_steps = max_steps, every
    cfg.project.output.log_every_steps, cfg.project.output.save_every_steps = log_every, 0
    loop.train(cfg, Dist(0, 1, 0, torch.device("cpu")), engine, Source(8), {}, Metrics(), {"variant": "edit"})


@contextlib.contextmanager
def collections(engine: Engine):
    """The collections started while automatic collection is off (the collector's own; none can start by itself
    then): (generation, optimizer steps done by then)."""
    seen = []

    def record(phase: str, info: dict) -> None:
        if phase == "start" and not gc.isenabled():
            seen.append((info["generation"], engine.steps))

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


def test_collections_come_exactly_at_the_cadence(monkeypatch):
    """gc_every_steps 3, logs every 5 steps, a full collection allowed every 4: one full collection and the freeze
    before step 1, another after the warm-up's step 3 (no young one there), young ones after steps 6 and 9, a full one
    at the log boundary 10 (the boundary 5 is too close to step 3's); automatic collection off in every step, back on
    afterwards with nothing left frozen."""
    monkeypatch.setattr(collector, "FULL_EVERY_STEPS", 4)
    engine = Engine()
    with collections(engine) as seen:
        train(monkeypatch, engine, every=3, max_steps=10, log_every=5)
    assert collector.WARM_STEPS == 3
    assert seen == [(2, 0), (2, 3), (1, 6), (1, 9), (2, 10)]
    assert engine.automatic == [False] * 10
    assert engine.frozen[0] > 10_000  # the process's objects (torch's, pytest's) frozen out of the walks
    # no freeze inside the warm-up: only gc.freeze() adds to the count, a frozen object that dies leaves it
    assert engine.frozen[0] - 100 < engine.frozen[2] <= engine.frozen[1] <= engine.frozen[0]
    assert engine.frozen[3] >= engine.frozen[2] + 1000  # what step 2 made, frozen after step 3
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_key_off_leaves_the_collector_alone(monkeypatch):
    """gc_every_steps 0: automatic collection stays on in every step, nothing is frozen, and the loop calls nothing
    of gc's but isenabled."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(gc, name)

    monkeypatch.setattr(collector, "gc", Spy())
    engine = Engine()
    train(monkeypatch, engine, every=0, max_steps=6, log_every=2)
    assert engine.automatic == [True] * 6 and set(calls) <= {"isenabled"} and gc.get_freeze_count() == 0


@pytest.mark.parametrize("full_every, bounded", [(collector.FULL_EVERY_STEPS, True), (10**9, False)])
def test_cyclic_garbage_stays_bounded(monkeypatch, full_every, bounded):
    """Each step leaves a reference cycle that is alive at its young collection and garbage a step later, so only a
    full collection frees it: with the full collections at the log boundaries (every 10 steps, at least
    FULL_EVERY_STEPS apart, the first FULL_EVERY_STEPS after the warm-up's) no more than FULL_EVERY_STEPS + 10 of them
    are ever alive over 300 steps, besides the one alive at the warm-up's freeze, which is never freed; without them
    (the control) every one made after the warm-up stays."""
    monkeypatch.setattr(collector, "FULL_EVERY_STEPS", full_every)
    engine = Engine(cycles=True)
    train(monkeypatch, engine, every=1, max_steps=300, log_every=10)
    if bounded:
        # the first full collection after the warm-up's (step 3) comes at step 110: the cycles of steps 4-110 and
        # step 3's, frozen
        assert max(engine.alive) == 110 - collector.WARM_STEPS + 1
        assert max(engine.alive) <= collector.FULL_EVERY_STEPS + 10 + 1
        assert engine.alive[-1] < max(engine.alive)
    else:  # every one but those that were garbage at the warm-up's full collection (steps 1 and 2)
        assert engine.alive[-1] == 300 - (collector.WARM_STEPS - 1)
    del engine
    gc.collect()


def test_automatic_between_steps_and_in_forked_children():
    """Work between steps (saves, renders) runs under automatic collection; a process forked during training (a
    DataLoader worker runs none of the loop's steps) gets it back."""
    with collector.Collector(2) as control:
        assert not gc.isenabled()
        with control.automatic():
            assert gc.isenabled()
        assert not gc.isenabled()
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: report and leave at once
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(child, 0)
        assert os.read(read, 1) == b"1"
        os.close(read)
        os.close(write)
    assert gc.isenabled()
