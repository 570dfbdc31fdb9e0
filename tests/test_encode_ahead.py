"""Encoding one micro-batch ahead in a thread (data.encode_ahead, train/data/ahead.py) on the CPU: the same
micro-batches as encoding in turn, the thread's errors raised in the loop's thread, no thread left behind when the
loop stops early, one micro-batch ahead at most, and the encoders never run by two threads at once."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import metrics, patch_family, run_trainer, write_config

from train import config
from train.data import sources
from train.data.ahead import EncodeAhead
from train.model.qwen_image import components
from train.runtime import engine
from train.runtime.oom import OutOfMemory, oom_advice
from train.trainer import build, validation

CPU = torch.device("cpu")
WORLD_OF_ONE = engine.Dist(rank=0, world_size=1, local_rank=0, device=CPU)
CPU_ENCODERS = SimpleNamespace(vae=SimpleNamespace(device=CPU))  # what the thread reads of the encoders: the device


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "encode-ahead"]


@pytest.fixture(autouse=True)
def no_thread_left():
    """Every test ends with no encode-ahead thread alive."""
    yield
    assert not ahead_threads()


class Sampler:
    """The part of sampling.BucketBatchSampler that LoaderSource.start_epoch calls."""

    def set_epoch(self, epoch: int) -> None:
        pass

    def skip_next(self, skip: int) -> None:
        pass


class Loader(list):
    """Raw micro-batches {"i": k} of one prompt; raises `error` instead of micro-batch `fail_at`."""

    def __init__(self, n: int, fail_at: int | None = None, error: Exception | None = None):
        super().__init__({"i": k, "prompts": ["a prompt"]} for k in range(n))
        self.batch_sampler, self.fail_at, self.error = Sampler(), fail_at, error

    def __iter__(self):
        for raw in super().__iter__():
            if raw["i"] == self.fail_at:
                raise self.error
            yield raw


def load_cfg(tiny: Path, tmp: Path, has_gpu: bool = False, **changes) -> config.Config:
    """The tiny test config with dotted-key `changes`, loaded as train/main.py loads it on a CPU (or a GPU host)."""
    path = write_config(tmp / "cfg.json", **changes)
    argv = ["--ds_config", path, "--model", tiny / "model", "--data", tiny / "data", "--output_dir", tmp / "out"]
    return config.load_config(config.parse_args([str(a) for a in argv]), 1, has_gpu=has_gpu)


def source_of(loader, to_batch, ahead: bool = True) -> sources.LoaderSource:
    source = sources.LoaderSource(loader, to_batch, CPU_ENCODERS, ahead)
    source.start_epoch(0, 0)
    return source


def tensors(b: sources.Batch) -> dict[str, torch.Tensor | None]:
    c = b.cond
    return {"x0": b.x0, "embeds": c.prompt_embeds, "mask": c.prompt_mask, "references": c.reference_tokens}


def test_the_same_batches_in_the_same_order(tiny_plus, tmp_path):
    """The tiny 2509 model (two references per row), micro-batch 2, a loader worker process: two
    epochs, the second resumed after 3 micro-batches (start_epoch's skip), give the micro-batches of encoding in
    turn bit for bit, in the same order; take_wait_s counted the waits for them."""
    cfg = load_cfg(tiny_plus, tmp_path, **{"train_micro_batch_size_per_gpu": 2, "qwen_edit.data.num_workers": 1})
    variant = components.detect_variant(cfg.project.model.path)
    encoders = components.load_encoders(cfg.project.model.path, torch.float32, CPU)

    def epochs(ahead: bool) -> tuple[list[sources.Batch], float]:
        _, loader = build.build_data(cfg, WORLD_OF_ONE, variant)
        source = sources.online_source(loader, encoders, variant, ahead)
        got = []
        for epoch, skip in ((0, 0), (1, 3)):
            source.start_epoch(epoch, skip)
            got += list(source)
        return got, source.take_wait_s()

    in_turn, _ = epochs(False)
    ahead, waited = epochs(True)
    assert len(in_turn) == 8 + 5 and len(ahead) == len(in_turn)
    for k, (a, b) in enumerate(zip(ahead, in_turn, strict=True)):
        assert (a.target_hw, a.cond.reference_shapes) == (b.target_hw, b.cond.reference_shapes), k
        for (name, x), y in zip(tensors(a).items(), tensors(b).values(), strict=True):
            assert (x is None and y is None) or torch.equal(x, y), f"micro-batch {k}: {name} differs"
    assert waited > 0


@pytest.mark.slow
def test_training_ahead_gives_the_losses_of_training_in_turn(tiny_edit, tmp_path):
    """train/main.py, 4 steps, with data.encode_ahead on and off: the same losses, bit for bit."""
    losses = {}
    for ahead in (True, False):
        cfg = write_config(
            tmp_path / f"{ahead}.json", **{"qwen_edit.data.encode_ahead": ahead, "qwen_edit.output.log_every_steps": 1}
        )
        proc = run_trainer(tiny_edit, tmp_path / str(ahead), config=cfg, extra=("--max_steps", "4"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert ("online encoding: one micro-batch ahead" in proc.stdout) == ahead
        records = metrics(tmp_path / str(ahead))
        assert all(0 <= r["data_wait_fraction"] <= 1 for r in records), records
        losses[ahead] = [r["loss"] for r in records]
    assert len(losses[True]) == 4 and losses[True] == losses[False], losses


@pytest.mark.parametrize("where", ["encode", "loader"])
def test_an_error_of_the_thread_is_raised_in_the_loop(where, monkeypatch):
    """An out-of-memory error while encoding micro-batch 2 reaches the loop as the OutOfMemory that encoding
    in turn raises, with the same message (its advice included); a loader's error as itself. Micro-batches 0 and 1
    arrive first."""

    def encode_batch(raw: dict, encoders, variant: str) -> int:
        if where == "encode" and raw["i"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return raw["i"]

    monkeypatch.setattr(sources, "encode_batch", encode_batch)

    def run(ahead: bool) -> tuple[list, BaseException]:
        loader = Loader(5, *((2, OSError("image 2 unreadable")) if where == "loader" else ()))
        got = []
        with pytest.raises((OutOfMemory, OSError)) as e:
            source = sources.online_source(loader, CPU_ENCODERS, "edit", ahead)
            source.start_epoch(0, 0)
            for batch in source:
                got.append(batch)
        return got, e.value

    (got_in_turn, in_turn), (got_ahead, ahead) = run(False), run(True)
    assert got_ahead == got_in_turn == [0, 1]
    assert type(ahead) is type(in_turn) and str(ahead) == str(in_turn)
    if where == "encode":
        assert "while encoding a micro-batch of" in str(ahead) and oom_advice("encode", 1) in str(ahead)
        assert "(torch: tried to allocate 2.00 GiB" in str(ahead)  # torch's own figures, shortened
        assert isinstance(ahead.__cause__, torch.cuda.OutOfMemoryError)


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where the thread cannot make its CUDA stream")
def test_a_thread_that_cannot_start_raises_in_the_loop():
    """The thread fails before its first encode (here: no CUDA for its stream): the loop gets the error, no hang."""
    encode_ahead = EncodeAhead(iter([{"i": 0}]), lambda raw: raw, threading.Lock(), torch.device("cuda", 0))
    with pytest.raises((RuntimeError, AssertionError)):
        encode_ahead.take()
    encode_ahead.close()


def test_stopping_early_ends_the_thread():
    """A loop that breaks, one that raises, and a generator closed while the thread encodes: each returns at once
    (the thread finishes the encode in hand and starts no other) and leaves no thread alive."""
    encoded = []

    def slow(raw: dict) -> int:
        encoded.append(raw["i"])
        time.sleep(0.05)
        return raw["i"]

    for batch in source_of(Loader(100), slow):
        if batch == 2:
            break
    assert not ahead_threads() and encoded[:3] == [0, 1, 2] and len(encoded) <= 4  # 3 only if already asked for

    with pytest.raises(ValueError, match="the step failed"):
        for batch in source_of(Loader(100), slow):
            if batch == 1:
                raise ValueError("the step failed")
    assert not ahead_threads()

    it = iter(source_of(Loader(100), slow))
    assert next(it) == 0
    time.sleep(0.01)  # micro-batch 1 is being encoded
    start = time.perf_counter()
    it.close()
    assert time.perf_counter() - start < 1 and not ahead_threads()


def test_one_micro_batch_ahead_at_most():
    """While the loop trains on micro-batch k, the thread encodes k + 1 and then waits: it never reads k + 2."""
    read = []

    def to_batch(raw: dict) -> int:
        read.append(raw["i"])
        return raw["i"]

    it = iter(source_of(Loader(10), to_batch))
    assert next(it) == 0
    time.sleep(0.2)  # a long step
    assert read == [0, 1]
    assert next(it) == 1
    time.sleep(0.2)
    assert read == [0, 1, 2]
    it.close()


def test_the_encoders_are_never_run_by_two_threads_at_once(monkeypatch):
    """A validation render holds the source's encoders_lock while it runs: the thread's next encode waits for the
    render to end. Both mark the encoders as in use; neither ever finds them in use by the other."""
    in_use, overlaps, order = [], [], []

    @contextlib.contextmanager
    def using(who: str):
        if in_use:
            overlaps.append((who, in_use[0]))
        in_use.append(who)
        order.append(who)
        time.sleep(0.1)
        yield
        in_use.remove(who)

    def encode(raw: dict) -> int:
        with using(f"encode {raw['i']}"):
            return raw["i"]

    source = source_of(Loader(4), encode)
    v = validation.Validator.__new__(validation.Validator)  # only what render() reads
    v.d, v.metrics, v.peak_bytes = WORLD_OF_ONE, SimpleNamespace(message=print), None
    v.encoders_lock = source.encoders_lock

    def render(label):
        with using("render"):
            return ["image"]

    monkeypatch.setattr(v, "_render", render)
    for batch in source:
        if batch == 0:
            time.sleep(0.05)  # micro-batch 1 is being encoded now: the render waits for it
            assert v.render() == ["image"]
    assert not overlaps, overlaps
    assert order == ["encode 0", "encode 1", "render", "encode 2", "encode 3"]


def test_off_keeps_everything_on_the_loops_thread():
    """data.encode_ahead false: no thread, each micro-batch encoded when the loop asks for it."""
    threads = []

    def to_batch(raw: dict) -> int:
        threads.append(threading.current_thread())
        return raw["i"]

    assert list(source_of(Loader(3), to_batch, ahead=False)) == [0, 1, 2]
    assert threads == [threading.main_thread()] * 3


def test_the_config_key_reaches_the_source(tiny_edit, tmp_path, monkeypatch):
    """build_source: data.encode_ahead in the zero2 mode; never in the model-parallel mode (its encoder stage is
    ahead of its decoder already, and parallel.overlap false must encode each micro-batch only when asked). The
    default, auto, is on with a GPU and off on the CPU."""
    patch_family(monkeypatch, load_encoders=lambda *a, **k: CPU_ENCODERS)

    def ahead(**changes) -> bool:
        cfg = load_cfg(tiny_edit, tmp_path, **changes)
        return build.build_source(cfg, WORLD_OF_ONE, "edit", [], Loader(1)).ahead

    assert not ahead() and ahead(**{"qwen_edit.data.encode_ahead": True})  # auto: off on the CPU
    assert not ahead(**{"qwen_edit.data.encode_ahead": True, "qwen_edit.parallel.mode": "model_parallel"})
    # auto resolves when the config loads: on for a GPU host, off for a CPU one; true and false stay as written
    for key, has_gpu, expected in (("auto", True, True), ("auto", False, False), (False, True, False),
                                   (True, False, True)):
        cfg = load_cfg(tiny_edit, tmp_path, has_gpu, **{"qwen_edit.data.encode_ahead": key})
        assert cfg.project.data.encode_ahead is expected, (key, has_gpu)
    assert load_cfg(tiny_edit, tmp_path, True).project.data.encode_ahead is True  # the default is auto
    mp = {"qwen_edit.data.encode_ahead": True, "qwen_edit.parallel.mode": "model_parallel"}
    assert load_cfg(tiny_edit, tmp_path, True, **mp).project.data.encode_ahead is False  # resolved with the mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_micro_batches_cross_the_streams_intact():
    """On a GPU the thread encodes on its own stream. A loop whose stream is busy (a chain of matmuls queued before
    it reads each micro-batch) and that drops each micro-batch as soon as its reads are queued still reads the values
    of encoding in turn: its stream waits for the encode's event, and record_stream keeps the allocator from giving
    the memory to the next encode before those reads ran. No synchronisation until the end."""
    device = torch.device("cuda", 0)
    w = torch.randn(4096, 4096, device=device, generator=torch.Generator(device).manual_seed(0)) / 128

    def encode(raw: dict) -> dict:
        x = torch.full((1024, 1024), float(raw["i"] + 1), device=device)
        for _ in range(50):  # many small kernels, deterministic
            x = x * 1.0001 + 0.5
        return {"x": x, "y": x.sum(0)}

    def step(batch: dict) -> torch.Tensor:
        z = w
        for _ in range(30):
            z = z @ w
        return batch["x"].double().sum() + batch["y"].double().sum() + 0 * z.sum().double()

    in_turn = [step(encode({"i": k})) for k in range(12)]
    ahead, encode_ahead = [], EncodeAhead(iter([{"i": k} for k in range(12)]), encode, threading.Lock(), device)
    try:
        while (batch := encode_ahead.take()) is not None:
            ahead.append(step(batch))
            del batch  # freed now, read later on the loop's stream
    finally:
        encode_ahead.close()
    torch.cuda.synchronize()
    assert [t.item() for t in ahead] == [t.item() for t in in_turn]
