"""DeepSpeed checkpoints that survive faults, and exact resume.

A save is a commit: every rank writes into `global_stepN.partial/`, then rank 0 writes trainer_state.json
there (the completeness marker), renames the directory to `global_stepN/` and atomically replaces `latest`.
A crash or a failed write at any point leaves `latest` on the previous complete checkpoint.

Trust: a checkpoint is data, never code. Every file is read through checkpoint_files.safe_load, and a resume only
follows `latest` or a tag to a checkpoint directory inside the output directory. What a resume changes against its
checkpoint: train/runtime/resume_changes.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from train.runtime import faults
from train.runtime.checkpoint_files import CheckpointFileError, ResumeError, SafeLoading, safe_load
from train.runtime.write_failures import is_write_failure, write_cause

STATE_FILE = "trainer_state.json"
PARTIAL = ".partial"


def checkpoint_tag(step: int) -> str:
    return f"global_step{step}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_committer(engine) -> bool:
    """The process that commits a save: global rank 0, or each node's local rank 0 with node-local storage
    (DeepSpeed's checkpoint.use_node_local_storage: every node keeps its own copy on its own disk)."""
    if engine.use_node_local_storage():
        return int(os.environ.get("LOCAL_RANK", "0")) == 0
    return _rank() == 0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class SaveError(OSError):
    """A checkpoint could not be written; 'latest' still names the previous complete checkpoint."""

    def __str__(self) -> str:
        return self.strerror  # the whole message, without OSError's '[Errno 28] ' prefix


def _save_failure(error: Exception, tag: str, out_dir: Path) -> SaveError:
    """The documented message for a failed save, with the cause found by write_cause."""
    code, cause = write_cause(error, out_dir)
    hint = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free space within your quota",
            errno.EROFS: "the file system is read-only; point --output_dir at a writable one",
            errno.EACCES: f"make {out_dir} writable for this user and resume", errno.EPERM: f"make {out_dir} "
            "writable for this user and resume"}.get(
        code, "check permissions and free space")
    return SaveError(code, f"saving checkpoint {tag} into {out_dir} failed ({cause}); {hint}. 'latest' still "
                           "names the previous complete checkpoint")


def save(engine, out_dir: str | Path, step: int, trainer_state: dict, keep_last: int = 0) -> Path:
    """Every rank calls this (ZeRO-2: each writes its optimizer shard). Frozen weights are left out.

    Returns the committed directory. On failure the previous checkpoint and `latest` are untouched, and SaveError
    says why (torch's RuntimeError from a full disk included).
    """
    out_dir = Path(out_dir)
    tag = checkpoint_tag(step)
    partial = out_dir / (tag + PARTIAL)
    committer = _is_committer(engine)
    if committer and partial.exists():
        try:
            shutil.rmtree(partial)  # left by an interrupted save of this same step
        except OSError as e:
            raise _save_failure(e, tag, out_dir) from e
    _barrier()
    try:
        client_state = {"step": step, "config": trainer_state.get("config")}
        engine.save_checkpoint(str(out_dir), tag=partial.name, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=True)
        torch.save(_rng_state(), partial / f"rng_state_rank{_rank()}.pt")
        faults.maybe_fail_save(step)
    except (OSError, RuntimeError) as e:
        if not is_write_failure(e):
            raise
        raise _save_failure(e, tag, out_dir) from e
    _barrier()
    final = out_dir / tag
    if committer:
        try:
            _commit(out_dir, partial, final, {**trainer_state, "step": step, "tag": tag}, keep_last)
        except OSError as e:
            raise _save_failure(e, tag, out_dir) from e
    _barrier()
    return final


def _commit(out_dir: Path, partial: Path, final: Path, state: dict, keep_last: int) -> None:
    """Mark `partial` complete, move it to `final`, point `latest` at it (the atomic last step), prune."""
    _write_atomic(partial / STATE_FILE, json.dumps(state, indent=2))
    if final.exists():  # re-saving a step after a resume: move the old copy aside first
        old = out_dir / (final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old)
    else:
        partial.rename(final)
    _write_atomic(out_dir / "latest", final.name)
    if keep_last:
        prune(out_dir, keep_last)


def read_state(directory: Path) -> dict | None:
    """The trainer_state.json of a checkpoint directory; None when it is missing or unreadable (a torn write)."""
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Committed checkpoint directories (a readable trainer_state.json), oldest first."""
    states = {p: read_state(p) for p in out_dir.glob("global_step*") if p.is_dir()}
    return sorted((p for p, s in states.items() if s is not None), key=lambda p: states[p]["step"])


def prune(out_dir: Path, keep_last: int) -> None:
    for old in complete_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old)


def confined_tag(out_dir: Path, tag: str, source: str) -> str:
    """`tag` when it names a directory directly inside `out_dir` (also after following links); ResumeError naming
    `source` ('latest' or --resume) otherwise, so a resume never reads files from outside the output directory."""
    inside = tag not in ("", ".", "..") and Path(tag).name == tag and "\\" not in tag
    if inside and (out_dir / tag).exists():
        inside = (out_dir / tag).resolve().parent == out_dir.resolve()
    if not inside:
        raise ResumeError(f"--resume: {source} names {tag!r}, which is not a checkpoint directory inside {out_dir}; "
                          "only checkpoints inside the output directory are resumed. Pass --resume global_stepN "
                          f"(complete ones: {[p.name for p in complete_checkpoints(out_dir)] or 'none'})")
    return tag


def resolve_tag(out_dir: str | Path, tag: str) -> tuple[str, dict]:
    """('global_stepN', trainer_state) for `tag` ('latest' or a directory name); raises ResumeError.

    The checkpoint's files are checked too (check_files): a refused or damaged one is named before any model
    loads."""
    out_dir = Path(out_dir)
    source = f"--resume {tag}"
    if tag == "latest":
        latest = out_dir / "latest"
        if not latest.is_file():
            raise ResumeError(f"--resume: {out_dir} has no 'latest' checkpoint; run without --resume to start anew")
        tag, source = latest.read_text(errors="replace").strip(), f"{latest}"
    tag = confined_tag(out_dir, tag, source)
    state = read_state(out_dir / tag)
    if state is None:
        done = [p.name for p in complete_checkpoints(out_dir)]
        if (out_dir / tag / STATE_FILE).is_file():
            why = f"its {STATE_FILE} is damaged"
        elif (out_dir / tag).is_dir() or (out_dir / (tag + PARTIAL)).is_dir():
            why = "its save was interrupted"
        else:
            why = "it does not exist"
        raise ResumeError(f"--resume {tag}: {out_dir / tag} is not a complete checkpoint ({why}); "
                          f"complete ones: {done or 'none'}{earlier_hint(out_dir, tag)}")
    check_files(out_dir, tag, state)
    return tag, state


def previous_complete(out_dir: Path, tag: str) -> str | None:
    """The newest complete checkpoint before `tag` in `out_dir` (any other one when `tag` names no step), or None."""
    done = [p.name for p in complete_checkpoints(out_dir) if p.name != tag]
    step = int(tag.removeprefix("global_step")) if re.fullmatch(r"global_step\d+", tag) else None
    earlier = [t for t in done if step is None or int(t.removeprefix("global_step")) < step]
    return earlier[-1] if earlier else None


def earlier_hint(out_dir: Path, tag: str) -> str:
    """'; resume from the previous complete one with --resume global_stepK' when there is one before `tag`."""
    earlier = previous_complete(out_dir, tag)
    return f"; resume from the previous complete one with --resume {earlier}" if earlier else ""


def check_files(out_dir: Path, tag: str, state: dict) -> None:
    """Every .pt file of checkpoint `tag` opens through safe_load (memory-mapped where it can, so the weights are
    not read), and the files DeepSpeed will look for are there; CheckpointFileError names the file otherwise."""
    ckpt = out_dir / tag
    expected = ["mp_rank_00_model_states.pt"]
    rank = _rank()  # this rank's own shard: with node-local storage a node holds only its ranks' shards
    sharded = any(ckpt.glob("*zero_pp_rank_*_optim_states.pt"))
    if sharded and "parallel" not in state and rank < state.get("world_size", 1):
        prefix = "bf16_" if any(ckpt.glob("bf16_zero_pp_rank_*")) else ""
        expected.append(f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    for name in expected:
        if not (ckpt / name).is_file():
            raise CheckpointFileError(f"--resume {tag}: {ckpt / name} is missing; the checkpoint is damaged"
                                      f"{earlier_hint(out_dir, tag)}")
    for path in sorted(ckpt.glob("*.pt")):
        try:
            safe_load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
        except CheckpointFileError as e:
            raise CheckpointFileError(f"--resume {tag}: {e}{earlier_hint(out_dir, tag)}") from None


def check_world_size(state: dict, world_size: int, tag: str) -> None:
    saved = state.get("world_size", world_size)
    if saved != world_size:
        raise ResumeError(
            f"--resume {tag}: saved by {saved} processes, resumed by {world_size}. ZeRO-2 optimizer shards are per "
            f"rank: resume with {saved} processes, or export the weights (python -m train.export --checkpoint "
            f"OUTPUT/{tag} --out DIR) and start a new run from them (qwen_edit.lora.init_from = "
            "DIR/pytorch_lora_weights.safetensors; for full fine-tuning, DIR/transformer in a copy of the model "
            "directory); the optimizer state then starts afresh"
        )


def load(engine, out_dir: str | Path, tag: str) -> None:
    """Restore module (trainable part), optimizer shards, LR scheduler and this rank's RNG state; every file is read
    through safe_load (DeepSpeed's checkpoint engine is wrapped for the load)."""
    if not isinstance(engine.checkpoint_engine, SafeLoading):
        engine.checkpoint_engine = SafeLoading(engine.checkpoint_engine)
    path, _ = engine.load_checkpoint(str(out_dir), tag=tag, load_module_strict=False,
                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise ResumeError(f"--resume {tag}: DeepSpeed found no checkpoint files in {Path(out_dir) / tag}")
    rng_file = Path(out_dir) / tag / f"rng_state_rank{_rank()}.pt"
    if rng_file.is_file():
        rng = safe_load(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
