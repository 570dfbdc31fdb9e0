"""What the training loop reads: `Batch` (a micro-batch as the transformer takes it; train/model/interface.py) and
the source protocol (`LoaderSource`: a DataLoader whose raw batches are turned into `Batch`es), with the online
source that encodes images with the frozen encoders on the fly, in turn or one micro-batch ahead
(train/data/ahead.py). The latent cache (train/data/latent_cache.py) is the other source.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from train.data.ahead import EncodeAhead
from train.model import family
from train.model.interface import Batch, Encoders
from train.runtime.oom import out_of_memory


def encode_batch(batch: dict, encoders: Encoders, variant: str) -> Batch:
    """Frozen encoders: prompt embeddings, target and reference latents (no gradients), as the variant's family
    conditions its transformer."""
    return family.variant_family(variant).encode_batch(batch, encoders, variant)


class LoaderSource:
    """Micro-batches read by a DataLoader and turned into `Batch`es by `to_batch` (e.g. the frozen encoders).

    The loop takes any source with this shape: len() = micro-batches per epoch, start_epoch(epoch, skip)
    before each epoch (skip = micro-batches of it already trained, on resume), iteration yielding `Batch`es on
    the training device, and take_wait_s() = seconds the loop spent blocked on its next micro-batch since the last
    call (in turn: on the loader; ahead: on the thread, loader and encode, whatever of them the previous step did
    not hide). `encoders`: the frozen encoders it uses, if any (validation renders with them instead of loading a
    second copy), and `encoders_lock`, which every user of them holds while it runs them. `ahead`: `to_batch` runs
    one micro-batch ahead in a thread (EncodeAhead) on the encoders' device; else in turn, on the loop's thread.
    """

    def __init__(self, loader, to_batch: Callable[[dict], Batch], encoders: Encoders | None = None,
                 ahead: bool = False):
        self.loader, self.to_batch, self.encoders, self.ahead = loader, to_batch, encoders, ahead
        self.encoders_lock = threading.Lock()
        self._wait_s = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def start_epoch(self, epoch: int, skip: int) -> None:
        self.loader.batch_sampler.set_epoch(epoch)
        self.loader.batch_sampler.skip_next(skip)  # counted in micro-batches (sampling.BucketBatchSampler)

    def take_wait_s(self) -> float:
        wait, self._wait_s = self._wait_s, 0.0
        return wait

    def __iter__(self):
        return self._iter_ahead() if self.ahead else self._iter_in_turn()

    def _iter_in_turn(self):
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                raw = next(it)
            except StopIteration:
                return
            self._wait_s += time.perf_counter() - t0
            yield self.to_batch(raw)

    def _iter_ahead(self):
        # iter() here, after start_epoch, in the loop's thread; the thread then only calls next() on it
        ahead = EncodeAhead(iter(self.loader), self.to_batch, self.encoders_lock, self.encoders.vae.device)
        try:
            while True:
                t0 = time.perf_counter()
                batch = ahead.take()
                self._wait_s += time.perf_counter() - t0
                if batch is None:
                    return
                yield batch
        finally:  # the epoch's end, or the loop stopped early (break, an exception): no thread outlives it
            ahead.close()


def online_source(loader, encoders: Encoders, variant: str, ahead: bool = False) -> LoaderSource:
    """Images from the loader, encoded on the fly by the frozen encoders; `ahead`: one micro-batch ahead of the
    training step, in a thread (data.encode_ahead)."""

    def encode(raw: dict) -> Batch:
        try:
            return encode_batch(raw, encoders, variant)
        except torch.cuda.OutOfMemoryError as e:
            n = len(raw["prompts"])
            raise out_of_memory(e, f"encoding a micro-batch of {n} online", "encode", n) from e

    return LoaderSource(loader, encode, encoders, ahead)
