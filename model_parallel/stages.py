"""The encoder stage's loop and the decoder's receiving source (the bounded queue between them).

Protocol on the encoder -> first decoder link, in order:
    encoder -> decoder  {"kind": "start", "batches_per_epoch": n}   (or {"kind": "error", "message": ...})
    encoder -> decoder  what `opening` produces (the validation conditioning; model_parallel/validation.py)
    decoder -> encoder  {"kind": "ready", "start_step": s}           (after its engine and checkpoint loaded)
    encoder -> decoder  one {"kind": "batch"} per micro-batch of steps s+1 .. max_steps, in training order
                        (parallel.overlap false: each preceded by decoder -> encoder {"kind": "next"})
    encoder -> decoder  {"kind": "end", "busy_s": ..., "idle_s": ...}
Both sides derive the micro-batch count from the same config and start step (loop.start_position), so no
message is ever left unmatched; the encoder iterates the same sampler as the ZeRO-2 mode would on the rank of
its pipeline. A preemption (train/runtime/preempt.py) ends the stream early: once the decoders have decided to stop,
the encoder sends "end" after the micro-batch in hand (overlap false: the decoder sends {"kind": "stop"} in
place of the next "next"), and the decoder takes and drops what is still on its way (ReceivingSource.close).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from model_parallel import transport
from train.config import Config
from train.data import sources
from train.runtime.collector import Collector
from train.trainer import loop


def slow_stage_s(stage: str) -> float:
    """Test hook QWEN_EDIT_SLOW_STAGE=encoder:0.3 (or decoder:0.3, or both: encoder:0.3,decoder:0.5): extra
    seconds per micro-batch of that stage."""
    for spec in os.environ.get("QWEN_EDIT_SLOW_STAGE", "").split(","):
        name, _, seconds = spec.partition(":")
        if name == stage:
            return float(seconds)
    return 0.0


def num_micro_batches(cfg: Config, start_step: int) -> int:
    """Micro-batches one pipeline trains from `start_step` to the end."""
    return (cfg.project.train.max_steps - start_step) * cfg.deepspeed["gradient_accumulation_steps"]


def _micro_batches(source: sources.LoaderSource, epoch: int, skip: int):
    """The source's micro-batches from (epoch, skip) on, across epochs; each is encoded when it is asked for."""
    while True:
        source.start_epoch(epoch, skip)
        skip = 0
        yield from source
        epoch += 1


def _await_request(link, peer: int) -> tuple[str, float]:
    """parallel.overlap false: wait for the decoder's {"kind": "next"} (or "stop"); returns (kind, seconds
    waited)."""
    t0 = time.perf_counter()
    meta, _ = transport.recv(link, peer)
    assert meta["kind"] in ("next", "stop"), meta
    return meta["kind"], time.perf_counter() - t0


def run_encoder(cfg: Config, source: sources.LoaderSource, link, peer: int,
                opening: Callable[[], list[tuple[dict, dict]]] | None = None, watch=None) -> dict:
    """Encode and send every micro-batch the decoder will train on; returns {busy_s, idle_s, micro_batches,
    stopped} (stopped: a preemption ended the stream early).

    `source` is the ZeRO-2 mode's online source (loader + frozen encoders) on this pipeline's data shard.
    `opening()` makes messages sent after the opening one, while the decoder builds its engine.
    parallel.overlap true: the send of micro-batch k waits until the decoder side took micro-batch k-1 (at most
    one message in flight, plus the decoder's queue). False: micro-batch k is encoded only when the decoder asks
    for it. Either wait is this stage's idle time. `watch` (a preempt.Watch over the launch's store): a SIGTERM
    here is passed on to the decoders, and their decision to stop ends the stream.
    """
    opening_sender = transport.Sender(link, peer, 1)
    opening_sender.send({"kind": "start", "batches_per_epoch": len(source)})
    for message in opening() if opening is not None else []:
        opening_sender.send(*message)
    opening_sender.flush()
    meta, _ = transport.recv(link, peer)
    assert meta["kind"] == "ready", meta
    gas = cfg.deepspeed["gradient_accumulation_steps"]
    overlap = cfg.project.parallel.overlap
    remaining = num_micro_batches(cfg, meta["start_step"])
    batches = _micro_batches(source, *loop.start_position(meta["start_step"], gas, len(source)))
    sender = transport.Sender(link, peer, max_in_flight=1)
    delay = slow_stage_s("encoder")
    busy = idle = 0.0
    sent, stopped = 0, False
    with Collector(cfg.project.train.gc_every_steps, meta["start_step"]) as collector:
        for _ in range(remaining):
            if watch is not None:
                watch.asked()  # a SIGTERM seen here reaches the decoders through the store
                if overlap and watch.stopping():
                    stopped = True
                    break
            if not overlap:
                kind, waited = _await_request(link, peer)
                idle += waited
                if kind == "stop":
                    stopped = True
                    break
            t0 = time.perf_counter()
            batch = next(batches)  # the frozen encoders run here
            if delay:
                time.sleep(delay)
            busy += time.perf_counter() - t0
            idle += sender.send(*transport.batch_message(batch))
            sent += 1
            if sent % gas == 0:  # an optimizer step's micro-batches are out; this stage logs nothing, so every step
                collector.after_step(meta["start_step"] + sent // gas, at_log=True)  # may take the full collection
    idle += sender.flush()
    stats = {"micro_batches": sent, "busy_s": busy, "idle_s": idle, "data_wait_s": source.take_wait_s(),
             "stopped": stopped}
    sender.send({"kind": "end", **stats})
    sender.flush()
    return stats


class EncoderStopped(RuntimeError):
    """The encoder stage could not start (e.g. bad rows); its message says why."""


def receive_start(link, peer: int) -> int:
    """Decoder side: the encoder's opening message; returns its micro-batches per epoch."""
    meta, _ = transport.recv(link, peer)
    if meta["kind"] == "error":
        raise EncoderStopped(f"the encoder stage stopped: {meta['message']}")
    return meta["batches_per_epoch"]


def send_ready(link, peer: int, start_step: int) -> None:
    """Decoder side: the engine is built; the encoder may start at `start_step`."""
    sender = transport.Sender(link, peer, 1)
    sender.send({"kind": "ready", "start_step": start_step})
    sender.flush()


class ReceivingSource:
    """loop.train's source on a decoder stage: Batches received from the previous stage.

    overlap (the default): a thread receives ahead into a queue of `queue_depth` micro-batches while the decoder
    trains, so a faster encoder never makes the decoder wait. overlap False (the first decoder stage with
    parallel.overlap false): no thread; each micro-batch is asked for when it is needed ({"kind": "next"}) and
    then received, so the encoder works only while the decoder waits. `take_wait_s` is the time the decoder
    blocked on its input (its idle time). It receives exactly `total` micro-batches, then the encoder's closing
    statistics.
    """

    def __init__(self, link, peer: int, device: torch.device, batches_per_epoch: int, total: int, queue_depth: int,
                 convert, overlap: bool = True):
        self.link, self.peer = link, peer
        self.batches_per_epoch, self.total = batches_per_epoch, total
        self.convert = convert
        self.queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.encoder_stats: dict = {}
        self._wait_s = 0.0
        self.wait_s_total = 0.0  # over micro-batches 2.. (the first one also waits for the pipeline to fill)
        self.first_wait_s = 0.0
        self.delivered = 0
        self._this_epoch = batches_per_epoch
        self.delay = slow_stage_s("decoder")
        self._ask = None if overlap else transport.Sender(link, peer, 1)
        self._thread = None
        if overlap:
            self._thread = threading.Thread(target=self._receive, args=(link, peer), daemon=True)
            self._thread.start()

    def _receive(self, link, peer: int) -> None:
        try:
            for _ in range(self.total + 1):
                meta, tensors = transport.recv(link, peer)
                if meta["kind"] == "end":  # after `total` micro-batches, or earlier after a preemption
                    self.encoder_stats = meta
                    return
                self.queue.put((meta, tensors))
            raise RuntimeError(f"the previous stage sent more than the {self.total} micro-batches expected")
        except BaseException as e:  # handed to the training thread, which raises it
            self.queue.put(e)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def start_epoch(self, epoch: int, skip: int) -> None:
        """The encoder stage runs the sampler (same epoch and skip, derived from the same step); here only the
        epoch's length matters."""
        self._this_epoch = self.batches_per_epoch - skip

    def take_wait_s(self) -> float:
        wait, self._wait_s = self._wait_s, 0.0
        return wait

    def next_batch(self) -> sources.Batch:
        """The next micro-batch (blocks while the queue is empty; that time is the decoder's idle time)."""
        if self.delay and self.delivered:
            time.sleep(self.delay)  # test hook: a slower decoder (counted as busy, as compute would be)
        t0 = time.perf_counter()
        item = self._take()
        waited = time.perf_counter() - t0
        self._wait_s += waited
        if self.delivered:
            self.wait_s_total += waited
        else:
            self.first_wait_s = waited
        if isinstance(item, BaseException):
            raise RuntimeError("receiving from the previous stage failed") from item
        self.delivered += 1
        return self.convert(*item)

    def _take(self):
        if self._ask is None:
            return self.queue.get()
        self._ask.send({"kind": "next"})  # overlap off: the encoder starts on this micro-batch only now
        self._ask.flush()
        return transport.recv(self.link, self.peer)

    def __iter__(self):
        for _ in range(self._this_epoch):
            if self.delivered == self.total:
                return
            yield self.next_batch()

    def close(self) -> dict:
        """Wait for the encoder's closing statistics (after the last micro-batch; after a preemption, micro-batches
        sent before the encoder learnt of it are received and dropped, so that none of its sends is left
        waiting)."""
        if self._thread is None:
            if self.delivered < self.total:
                self._ask.send({"kind": "stop"})
                self._ask.flush()
            self.encoder_stats, _ = transport.recv(self.link, self.peer)
            return self.encoder_stats
        while self._thread.is_alive() or not self.queue.empty():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()
        return self.encoder_stats
