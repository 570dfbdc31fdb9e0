"""Room on disk for the run's checkpoints and exports, checked once after the engine is built, before the first step.

A checkpoint is counted from the engine's own tensors, as DeepSpeed's save_checkpoint (called by checkpoint.save)
writes them: mp_rank_00_model_states.pt on the ranks DeepSpeed picks (`save_non_zero_checkpoint`: data-parallel rank
0, or each node's local rank 0 with node-local storage) holds the trainable weights in their training dtype and the
persistent buffers (frozen weights are left out); *zero_pp_rank_R_*_optim_states.pt on every rank holds its fp32
master partition and optimizer state (without ZeRO the model file holds the optimizer state too). torch.save writes
each storage once and whole, so does the count. The optimizer state that the first step creates (Adam's moments) is
not there yet: its bytes per element come from a one-step probe of the same optimizer on a 16-element tensor.

Every rank counts its own files, and the rank that writes the model states file into a file system reads the free
space there (one statvfs); one gather gives every rank all of them, so every rank reaches the same verdict and a
refusal stops them together. The ranks that write into one file system are all of them, or each node's own with
DeepSpeed's checkpoint.use_node_local_storage. The run's small files (metrics, rng states, trainer_state.json,
validation images) are left out: kilobytes to megabytes against a checkpoint's gigabytes.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from train.runtime import checkpoint, outdir
from train.runtime.console import print0
from train.runtime.engine import Dist, all_gather_objects

GB = 1e9


def gb(n: int) -> str:
    """Bytes as GB: one decimal, or two significant digits below 0.1 GB (the tiny model's)."""
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / GB:.2g} GB"


def saved_bytes(*objs) -> int:
    """Tensor bytes that torch.save writes for `objs` (nested dicts, lists, tuples): every storage once and whole
    (a view of a flat buffer saves the whole buffer), as torch's pickler does."""
    seen, total, stack = set(), 0, list(objs)
    while stack:
        obj = stack.pop()
        if torch.is_tensor(obj):
            storage = obj.untyped_storage()
            key = (storage.device, storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state per parameter element that `optimizer`'s step creates (AdamW: 8, two fp32 moments), from one
    step of a copy of it over 16 zeros of its first parameter's dtype and device; twice the element size (Adam's two
    moments) when the optimizer cannot be rebuilt from its defaults."""
    like = optimizer.param_groups[0]["params"][0]
    probe = torch.zeros(16, dtype=like.dtype, device=like.device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        copy = type(optimizer)([probe], **optimizer.defaults)
        copy.step()
    except (TypeError, ValueError, RuntimeError):
        return 2 * like.element_size()
    return sum(t.element_size() for t in copy.state[probe].values() if torch.is_tensor(t) and t.numel() == 16)


def state_to_come(optimizer) -> int:
    """Bytes of optimizer state that the first step will create: the parameters without state yet (all of them
    before the first step, none after a resume) times the probed bytes per element."""
    base = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO / bf16 optimizers wrap the torch one
    bare = sum(p.numel() for g in base.param_groups for p in g["params"] if not base.state.get(p))
    return bare * state_bytes_per_element(base) if bare else 0


def checkpoint_bytes(engine) -> tuple[int, int]:
    """(weights, optimizer state) bytes of the files this rank writes in one checkpoint.save (module doc); the
    small files (rng state, trainer_state.json, DeepSpeed's recovery scripts) are left out."""
    weights = saved_bytes(engine.module_state_dict(exclude_frozen_parameters=True)) if (
        engine.save_non_zero_checkpoint) else 0
    # the files that hold the optimizer state: the ZeRO shard, and without ZeRO the model states file too
    copies = engine.save_zero_checkpoint + (engine.save_non_zero_checkpoint and not engine.zero_optimization())
    optimizer = saved_bytes(engine.optimizer.state_dict()) + state_to_come(engine.optimizer) if copies else 0
    return weights, copies * optimizer


def num_writes(every: int, max_steps: int, start_step: int) -> int:
    """Checkpoints (or exports) this run writes at a cadence of `every` steps (output.save_every_steps,
    output.export_every_steps; 0 = none): one at each multiple before the last step, and the final one."""
    return 1 + (max(0, (max_steps - 1) // every - start_step // every) if every else 0)


def checkpoints_held(saves: int, existing: int, keep_last: int) -> int:
    """New checkpoints on disk at once at the run's peak, beyond the `existing` complete ones: a save writes a whole
    checkpoint before keep_last (0 = keep all) prunes the oldest, so keep_last + 1 are there for a moment."""
    if not keep_last:
        return saves
    return max(1, min(existing + saves - 1, keep_last) + 1 - existing)


@dataclass
class Room:
    """One file system the run writes checkpoints into: what its ranks write there and what it has free."""

    where: str  # '--output_dir OUT' (on HOST with node-local storage)
    num_ranks: int
    weights: int  # bytes of one checkpoint's trainable weights
    optimizer: int  # bytes of one checkpoint's optimizer state
    export: int  # bytes of one export (0 on a node that does not write it)
    free: int
    existing: int  # complete checkpoints there already (a resume's)

    def verdict(self, out, max_steps: int, start_step: int) -> tuple[bool, str]:
        """(refused, message): refused when one checkpoint and the final export do not fit; a warning when the
        run's peak does not (the new checkpoints there at once, and every export); else a one-line summary."""
        one = self.weights + self.optimizer
        saves, exports = (num_writes(every, max_steps, start_step) for every in (out.save_every_steps,
                                                                                 out.export_every_steps))
        held = checkpoints_held(saves, self.existing, out.keep_last)
        need, peak = one + self.export, held * one + exports * self.export
        ranks = f"{self.num_ranks} rank{'s' if self.num_ranks > 1 else ''}"
        counted = (f"one checkpoint of {gb(one)} ({gb(self.weights)} of trainable weights, {gb(self.optimizer)} of "
                   f"optimizer state from {ranks})" + (f" and the export of {gb(self.export)}" if self.export else ""))
        at_peak = f"{held} checkpoint{'s' * (held > 1)}"
        if self.export:
            at_peak += f" and {exports} exports" if exports > 1 else " and the export"
        keep = (f"each save writes a whole new checkpoint before keep_last ({out.keep_last}) deletes the oldest"
                if out.keep_last else "keep_last 0 keeps every checkpoint")
        if self.free < need:
            later = f"; leave room for {at_peak} ({gb(peak)}): {keep}" if held > 1 or exports > 1 else ""
            return True, (f"{self.where}: {gb(self.free)} free, the run needs {gb(need)} there: {counted}. Free disk "
                          f"space or choose another --output_dir{later}")
        if self.free < peak:
            return False, (f"warning: {self.where}: {gb(self.free)} free takes {counted}, not the run's peak of "
                           f"{at_peak} ({gb(peak)}): {keep}; a later save will fail. Free disk space, lower "
                           "keep_last or choose another --output_dir")
        return False, f"disk: {counted}; at its peak the run holds {gb(peak)} of {gb(self.free)} free in {self.where}"


def check(engine, d: Dist, out, max_steps: int, start_step: int, export_bytes: int,
          overwrite: bool) -> None:
    """Refuse the run (OutputDirError on every rank: a collective) when a file system it writes into cannot take
    one checkpoint and the final export; warn when it cannot take the run's peak (Room.verdict). `out`: the config's
    output section (dir, save_every_steps, keep_last, export_every_steps). The rank that writes the model states
    file into a file system reads its free space; --overwrite counts the earlier run's files, which it deletes, as
    free."""
    out_dir = Path(out.dir)
    node = socket.gethostname() if engine.use_node_local_storage() else ""
    disk = None
    if engine.save_non_zero_checkpoint:  # one such rank per file system
        disk = (shutil.disk_usage(out_dir).free + (outdir.overwritten_bytes(out_dir) if overwrite else 0),
                0 if overwrite else len(checkpoint.complete_checkpoints(out_dir)))
    ranks = all_gather_objects((node, *checkpoint_bytes(engine), export_bytes if d.is_main else 0, disk))
    refusals = []
    for name in dict.fromkeys(r[0] for r in ranks):
        mine = [r for r in ranks if r[0] == name]
        free, existing = next(r[4] for r in mine if r[4] is not None)
        room = Room(f"--output_dir {out_dir}" + (f" on {name}" if name else ""), len(mine),
                    *(sum(r[i] for r in mine) for i in (1, 2, 3)), free, existing)
        refused, message = room.verdict(out, max_steps, start_step)
        if refused:
            refusals.append(message)
        else:
            print0(message, rank=d.rank)
    if refusals:
        raise outdir.OutputDirError("; ".join(refusals))
