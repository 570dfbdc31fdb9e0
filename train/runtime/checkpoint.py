"""DeepSpeed checkpoints that survive faults, exact resume, and the final exports.

A save is a commit: every rank writes into `global_stepN.partial/`, then rank 0 writes trainer_state.json
there (the completeness marker), renames the directory to `global_stepN/` and atomically replaces `latest`.
A crash or a failed write at any point leaves `latest` on the previous complete checkpoint.

Trust: a checkpoint is data, never code. DeepSpeed loads its files with `torch.load(weights_only=False)` (full
pickle: a planted file runs any code); here every load goes through `safe_load` (torch's weights-only unpickler,
allowing only the few DeepSpeed classes its ZeRO shards hold), and a resume only follows `latest` or a tag to a
checkpoint directory inside the output directory. A file that needs anything else is refused, naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from train.runtime import faults

STATE_FILE = "trainer_state.json"
PARTIAL = ".partial"


class ResumeError(ValueError):
    """The requested checkpoint cannot be resumed; the message says what to do."""


class CheckpointFileError(ResumeError):
    """A checkpoint file that is refused (it would run code) or damaged; the message names the file."""


def _allowed_globals() -> list:
    """The classes besides tensors, dtypes and containers that DeepSpeed 0.19's checkpoints pickle: the ZeRO
    optimizer shards hold the ZeRO stage enum, the loss scaler and the parameter fragment addresses (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-1/2, bf16 and fp16 checkpoints). Each is a plain
    data holder: rebuilding one sets attributes and runs no code of the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _refusal(path, error: pickle.UnpicklingError) -> str:
    """Why the weights-only unpickler refused `path`: the globals it names beyond the allowed ones (torch lists them
    for zip-format files), else the unpickler's own reason without its advice to load with weights_only=False."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _allowed_globals()}
    try:
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if n not in allowed]
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError):
        names = []
    if names:
        return f"it holds pickled references to {', '.join(names)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
    return (found[1] if found else str(error).splitlines()[0]).split(" Please use")[0].rstrip(".")


def safe_load(path: str | os.PathLike, map_location=None, mmap: bool | None = None):
    """torch.load through the weights-only unpickler with DeepSpeed's few classes allowed (module doc).

    Raises CheckpointFileError naming the file: refused when it needs any other global (a pickled object that
    could run code), damaged when it cannot be read (truncated, not a torch file)."""
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointFileError(
            f"{path}: refused to load: {_refusal(path, e)}. A checkpoint of this trainer holds only tensors and plain "
            "values, and a pickled object can run code; this file was not written by the trainer or was tampered "
            "with. Delete it and use an earlier checkpoint that you trust") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointFileError(f"{path}: damaged, cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


class _SafeLoading:
    """Stands in for a DeepSpeed engine's checkpoint engine (DeepSpeed's own hook for how checkpoint files are
    written and read): loads go through safe_load, everything else to the engine it wraps."""

    def __init__(self, inner):
        self.inner = inner

    def load(self, path, map_location=None):
        return safe_load(path, map_location)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _WeightsOnlyTorch:
    """The torch module as DeepSpeed's zero_to_fp32 sees it inside `weights_only_consolidation`: its loads
    (written with weights_only=False) go through safe_load."""

    @staticmethod
    def load(f, map_location=None, mmap=None, **_):
        return safe_load(f, map_location, mmap)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextmanager
def weights_only_consolidation():
    """While active, deepspeed.utils.zero_to_fp32 loads checkpoint files through safe_load (it calls torch.load
    with weights_only=False and offers no hook; only its own module's `torch` name is replaced)."""
    from deepspeed.utils import zero_to_fp32

    zero_to_fp32.torch = _WeightsOnlyTorch()
    try:
        yield
    finally:
        zero_to_fp32.torch = torch


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


# How torch reports a failed write: RuntimeError without an errno ('[enforce fail at inline_container.cc:672] .
# unexpected pos ...', 'PytorchStreamWriter failed writing file ...', 'Parent directory ... does not exist').
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "Parent directory", "file write failed")
MIN_FREE_BYTES = 64 * 2**20


def write_cause(error: Exception, directory: Path) -> tuple[int, str]:
    """(errno, what it says) of a write into `directory` that failed: the error's own errno; the 'os error N' that
    safetensors puts in its message; or, for torch's errno-less RuntimeError, what the file system says (little
    free space, or no write permission)."""
    code = getattr(error, "errno", None)
    quoted = re.search(r"\(os error (\d+)\)", str(error))
    if code is None and quoted:
        code = int(quoted.group(1))
    if code is None:
        try:
            full = shutil.disk_usage(directory).free < MIN_FREE_BYTES
        except OSError:
            full = False
        code = errno.ENOSPC if full else errno.EACCES if not os.access(directory, os.W_OK) else errno.EIO
    return code, (getattr(error, "strerror", None) or os.strerror(code))


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


def _is_write_failure(error: Exception) -> bool:
    return isinstance(error, OSError) or (isinstance(error, RuntimeError) and
                                          any(s in str(error) for s in _TORCH_WRITE_FAILURES))


# What a full or unwritable disk raises: these errnos, and safetensors' error quoting one of them ('os error 28').
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def disk_failure(error: BaseException, out_dir: str | Path) -> str | None:
    """For a write anywhere in the run (an export, metrics, validation images, ...) that a full or unwritable disk
    stopped: the line naming the file (or, where the error does not say, `out_dir`), the cause and the fix; None for
    any other error."""
    quoted = re.search(r"\(os error (\d+)\)", str(error))
    code = getattr(error, "errno", None) or (int(quoted.group(1)) if quoted else None)
    torch_write = isinstance(error, RuntimeError) and any(s in str(error) for s in _TORCH_WRITE_FAILURES)
    named = getattr(error, "filename", None)
    outside = named is not None and not Path(os.path.abspath(named)).is_relative_to(os.path.abspath(out_dir))
    if (code not in DISK_ERRNOS and not torch_write) or outside:  # not a write of the run's own files
        return None
    code, cause = write_cause(error, Path(out_dir))
    fix = ("free disk space there" if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else
           "point --output_dir at a writable file system" if code == errno.EROFS else
           f"make {out_dir} writable for this user")
    return (f"writing {named or f'into {out_dir}'} failed ({cause}); {fix}. --resume continues from the last "
            "complete checkpoint")


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
        if not _is_write_failure(e):
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


STRETCHED_SCHEDULES = ("WarmupDecayLR", "WarmupCosineLR")  # their length is filled from train.max_steps


def saved_max_steps(state: dict) -> int | None:
    """train.max_steps of the run that saved `state` (None when it was saved before configs were stored)."""
    return (state.get("config") or {}).get("qwen_edit", {}).get("train", {}).get("max_steps")


def schedule_note(state: dict, max_steps: int, step: int, scheduler) -> str | None:
    """A warning when a resume with another train.max_steps changes the LR schedule, or None when nothing changes.

    DeepSpeed's schedulers save only their position (last_batch_iteration); the length of WarmupDecayLR and
    WarmupCosineLR comes from the config, i.e. from the new max_steps, so the rest of the curve is re-stretched
    over the new length and the learning rate moves (up, for a longer run) from where the saved run left it. The
    two rates are `scheduler`'s own formula (the loaded DeepSpeed scheduler) over the new and the saved length.
    """
    saved = saved_max_steps(state)
    kind = ((state.get("config") or {}).get("scheduler") or {}).get("type")
    if saved is None or saved == max_steps or kind not in STRETCHED_SCHEDULES or scheduler is None:
        return None
    now, length = scheduler.get_lr()[0], scheduler.total_num_steps
    scheduler.total_num_steps = saved  # the saved curve: the same scheduler over the saved length, for one read
    try:
        before = scheduler.get_lr()[0]
    finally:
        scheduler.total_num_steps = length
    return (f"warning: resume: train.max_steps is {max_steps}, the checkpoint's run had {saved}; DeepSpeed's {kind} "
            f"is re-stretched over {max_steps} steps, so the learning rate of step {step + 1} is {now:.3g} instead of "
            f"{before:.3g} on the saved curve{f' ({now / before:.3g}x)' if before else ''}. To keep the saved curve, "
            "resume with the old --max_steps; to go on at a fixed rate, see docs/checkpoints.md, 'Extending a run'")


# Settings a resume cannot honour: the checkpoint's tensors, ZeRO shards or optimizer state are laid out by them.
FIXED_KEYS = ("qwen_edit.train.mode", "qwen_edit.lora.rank", "qwen_edit.lora.alpha", "qwen_edit.lora.target_modules",
              "qwen_edit.model.variant", "qwen_edit.parallel.mode", "zero_optimization.stage", "bf16.enabled",
              "fp16.enabled", "optimizer.type")
# Settings expected to differ on a resume (a longer run, a moved output directory): not reported.
FREE_KEYS = ("qwen_edit.train.max_steps", "scheduler.params.total_num_steps", "qwen_edit.output.dir")


def _flat(cfg: dict, prefix: str = "") -> dict:
    """{'a.b.c': value} of a nested config dict (lists are values)."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(state: dict, config: dict, tag: str) -> dict[str, list]:
    """{key: [saved, now]} of the settings that differ between the checkpoint's stored config and `config` (the
    resolved config of this run), for the record; ResumeError naming every key of FIXED_KEYS that changed."""
    if not isinstance(state.get("config"), dict):
        return {}  # saved before configs were stored: nothing to compare
    saved, now = _flat(state["config"]), _flat(config)
    changed = {k: [saved.get(k), now.get(k)] for k in sorted(saved.keys() | now.keys())
               if saved.get(k) != now.get(k) and k not in FREE_KEYS}
    fixed = {k: v for k, v in changed.items() if k in FIXED_KEYS}
    if fixed:
        listed = "; ".join(f"{k}: {json.dumps(old)} in the checkpoint, {json.dumps(new)} now"
                           for k, (old, new) in fixed.items())
        raise ResumeError(f"--resume {tag}: the checkpoint cannot continue with these changed settings ({listed}); "
                          "its weights and optimizer state are laid out by them. Set them back to resume, or export "
                          f"the weights (python -m train.export --checkpoint OUTPUT/{tag} --out DIR) and start a new "
                          "run from them (qwen_edit.lora.init_from = DIR/pytorch_lora_weights.safetensors)")
    return changed


def data_change(state: dict, data: dict, tag: str, step: int) -> str | None:
    """The warning for a resume over rows that changed since the checkpoint (`data`: rows.fingerprint of this run's
    rows; the checkpoint's in its trainer_state), or None (the same rows, or a checkpoint that did not record
    them). The run goes on at the checkpoint's step with the rows as they are now."""
    saved = state.get("data")
    if not isinstance(saved, dict) or saved == data:
        return None
    return (f"warning: the dataset changed since {tag}: {saved.get('rows')} rows then, {data['rows']} now (rows "
            f"added, removed or edited). The run goes on at step {step} with the rows as they are now, at the same "
            "place in its epoch counted in the new rows, so the rest of this epoch is not the one the checkpoint's "
            "rows would have given; to continue exactly, restore the data it was trained on")


def load(engine, out_dir: str | Path, tag: str) -> None:
    """Restore module (trainable part), optimizer shards, LR scheduler and this rank's RNG state; every file is read
    through safe_load (DeepSpeed's checkpoint engine is wrapped for the load)."""
    if not isinstance(engine.checkpoint_engine, _SafeLoading):
        engine.checkpoint_engine = _SafeLoading(engine.checkpoint_engine)
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
