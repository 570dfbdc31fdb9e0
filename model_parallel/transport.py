"""Messages between stages over a 2-process gloo link: a header (length, then JSON), then the tensors.

The receiver cannot know the shapes in advance (every micro-batch may have its own image size, prompt length and
reference count), so each message sends its layout first: an int64 byte count, the JSON header naming each
tensor's dtype and shape plus small metadata, then each tensor's bytes. Tensors travel as raw bytes, so any
dtype (bf16 included) crosses unchanged.
"""

from __future__ import annotations

import json
from collections import deque

import torch

from train.model.interface import Batch

_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
                              torch.uint8)}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class Sender:
    """Non-blocking sends with at most `max_in_flight` messages outstanding (the oldest is waited for first)."""

    def __init__(self, link, peer: int, max_in_flight: int = 2):
        self.link, self.peer, self.max_in_flight = link, peer, max_in_flight
        self.pending: deque[list] = deque()

    def send(self, meta: dict, tensors: dict[str, torch.Tensor | None] | None = None) -> float:
        """Post one message; returns the seconds spent waiting for an earlier one to complete."""
        import time

        tensors = {k: v for k, v in (tensors or {}).items() if v is not None}
        header = {"meta": meta, "tensors": [[k, str(v.dtype), list(v.shape)] for k, v in tensors.items()]}
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        parts = [torch.tensor([raw.numel()], dtype=torch.int64), raw, *(_as_bytes(v) for v in tensors.values())]
        works = [self.link.send([p], self.peer, 0) for p in parts if p.numel()]
        self.pending.append([works, parts])  # the buffers must live until their sends complete
        t0 = time.perf_counter()
        while len(self.pending) > self.max_in_flight:
            self._wait_oldest()
        return time.perf_counter() - t0

    def _wait_oldest(self) -> None:
        works, _ = self.pending.popleft()
        for w in works:
            w.wait()

    def flush(self) -> float:
        import time

        t0 = time.perf_counter()
        while self.pending:
            self._wait_oldest()
        return time.perf_counter() - t0


def recv(link, peer: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Blocking receive of one message: (meta, {name: CPU tensor})."""
    size = torch.zeros(1, dtype=torch.int64)
    link.recv([size], peer, 0).wait()
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    link.recv([raw], peer, 0).wait()
    header = json.loads(bytes(raw.numpy()).decode())
    tensors = {}
    for name, dtype, shape in header["tensors"]:
        t = torch.empty(shape, dtype=_DTYPES[dtype])
        if t.numel():
            link.recv([t.reshape(-1).view(torch.uint8)], peer, 0).wait()
        tensors[name] = t
    return header["meta"], tensors


def batch_message(b: Batch) -> tuple[dict, dict[str, torch.Tensor | None]]:
    """A Batch as (meta, tensors) for `Sender.send`: the target latents, and the conditioning per sample (its
    family's parts, Conditioning.samples)."""
    parts = b.cond.samples()
    tensors = {f"{i}.{name}": t for i, (_, sample) in enumerate(parts) for name, t in sample.items()}
    meta = {"kind": "batch", "target_hw": list(b.target_hw), "samples": [m for m, _ in parts],
            "names": [list(sample) for _, sample in parts]}
    return meta, {"x0": b.x0, **tensors}


def message_batch(meta: dict, tensors: dict[str, torch.Tensor], device: torch.device, join) -> Batch:
    """Inverse of `batch_message`, moved to `device`; `join` is the family's join_conditioning."""
    parts = [(m, {name: tensors[f"{i}.{name}"] for name in names})
             for i, (m, names) in enumerate(zip(meta["samples"], meta["names"], strict=True))]
    cond = join(parts).to(device)
    return Batch(tensors["x0"].to(device, non_blocking=True), tuple(meta["target_hw"]), cond)
