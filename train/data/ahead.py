"""Encode ahead (data.encode_ahead): a background thread runs a source's `to_batch` (the frozen encoders, online)
on micro-batch k+1 while the training loop trains on micro-batch k, so that the encoders' host-side and
launch-bound time overlaps the step's GPU work instead of following it.

On CUDA the thread encodes on its own stream and records an event after each micro-batch; the consumer makes its
current stream wait on that event and marks every tensor of the micro-batch as used there (`record_stream`), so
that the caching allocator does not hand their memory to the encode stream again while the step still reads it.
On the CPU the thread runs the same way, without streams.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator

import torch


class EncodeAhead:
    """`to_batch(raw)` for every raw micro-batch of `raws`, one micro-batch ahead, in a daemon thread.

    Depth one: the thread reads and encodes micro-batch k+1 only once the consumer has taken micro-batch k, so
    beside the micro-batch in training at most one encoded micro-batch waits (its memory, plus one encode's
    transient while it is made). `lock` is held around every encode: whoever else uses the same encoders (the
    validation renders) holds it too, so two threads never run them at once. An error of the thread (an encode's,
    or the loader's) is raised by the `take` that would have returned that micro-batch. `close` stops the thread
    and waits for it (at most the encode in hand); the thread never outlives the iteration that started it.
    """

    def __init__(
        self, raws: Iterator[dict], to_batch: Callable[[dict], object], lock: threading.Lock, device: torch.device
    ):
        self._raws, self._to_batch, self._lock, self._device = raws, to_batch, lock, device
        self._asked = threading.Semaphore(1)  # one permit per micro-batch to encode; the first is asked for now
        self._stop = threading.Event()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # ("batch" | "end" | "error", value, event)
        self._thread = threading.Thread(target=self._run, name="encode-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            stream = None
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread; a new one starts on cuda:0
                stream = torch.cuda.Stream(self._device)
            while True:
                self._asked.acquire()
                if self._stop.is_set():
                    return
                raw = next(self._raws, None)
                if raw is None:
                    self._done.put(("end", None, None))
                    return
                self._done.put(("batch", *self._encode(raw, stream)))
        except BaseException as e:  # an encode's, the loader's, the stream's: handed to the consumer, which raises it
            self._done.put(("error", e, None))

    def _encode(self, raw: dict, stream: torch.cuda.Stream | None) -> tuple[object, torch.cuda.Event | None]:
        """The micro-batch of `raw` and, on CUDA, an event recorded on `stream` after its last kernel."""
        with self._lock, torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            batch = self._to_batch(raw)
            return batch, stream.record_event() if stream is not None else None

    def take(self):
        """The next micro-batch, ready for the current stream; None after the last. Blocks while the thread is
        still reading or encoding it; raises the thread's error in its place."""
        kind, value, event = self._done.get()
        if kind == "error":
            raise value
        if kind == "end":
            return None
        self._asked.release()  # the next micro-batch encodes while this one trains
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            for t in _tensors(value):
                t.record_stream(current)
        return value

    def close(self) -> None:
        """Stop the thread and wait for it: it ends after the encode in hand, if any, without starting another."""
        self._stop.set()
        self._asked.release()  # wakes a thread waiting for the next request
        self._thread.join()


def _tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in a micro-batch (dataclasses, lists, tuples, dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
