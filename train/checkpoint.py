"""DeepSpeed checkpoints that survive faults, exact resume, and the final exports.

A save is a commit: every rank writes into `global_stepN.partial/`, then rank 0 writes trainer_state.json
there (the completeness marker), renames the directory to `global_stepN/` and atomically replaces `latest`.
A crash or a failed write at any point leaves `latest` on the previous complete checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from train import faults

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
STATE_FILE = "trainer_state.json"
PARTIAL = ".partial"


class ResumeError(ValueError):
    """The requested checkpoint cannot be resumed; the message says what to do."""


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


def save(engine, out_dir: str | Path, step: int, trainer_state: dict, keep_last: int = 0) -> Path:
    """Every rank calls this (ZeRO-2: each writes its optimizer shard). Frozen weights are left out.

    Returns the committed directory. On failure the previous checkpoint and `latest` are untouched.
    """
    out_dir = Path(out_dir)
    tag = checkpoint_tag(step)
    partial = out_dir / (tag + PARTIAL)
    committer = _is_committer(engine)
    if committer and partial.exists():
        shutil.rmtree(partial)  # left by an interrupted save of this same step
    _barrier()
    try:
        client_state = {"step": step, "config": trainer_state.get("config")}
        engine.save_checkpoint(str(out_dir), tag=partial.name, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=True)
        torch.save(_rng_state(), partial / f"rng_state_rank{_rank()}.pt")
        faults.maybe_fail_save(step)
    except OSError as e:
        hint = "free disk space" if e.errno == errno.ENOSPC else "check permissions and free space"
        raise OSError(e.errno, f"saving checkpoint {tag} into {out_dir} failed ({e.strerror or e}); "
                               f"{hint}. 'latest' still names the previous complete checkpoint") from e
    _barrier()
    final = out_dir / tag
    if committer:
        _write_atomic(partial / STATE_FILE, json.dumps({**trainer_state, "step": step, "tag": tag}, indent=2))
        if final.exists():  # re-saving a step after a resume: move the old copy aside first
            old = out_dir / (tag + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        _write_atomic(out_dir / "latest", tag)
        if keep_last:
            prune(out_dir, keep_last)
    _barrier()
    return final


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first."""
    dirs = [p for p in out_dir.glob("global_step*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(dirs, key=lambda p: json.loads((p / STATE_FILE).read_text())["step"])


def prune(out_dir: Path, keep_last: int) -> None:
    for old in complete_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old)


def resolve_tag(out_dir: str | Path, tag: str) -> tuple[str, dict]:
    """('global_stepN', trainer_state) for `tag` ('latest' or a directory name); raises ResumeError."""
    out_dir = Path(out_dir)
    if tag == "latest":
        latest = out_dir / "latest"
        if not latest.is_file():
            raise ResumeError(f"--resume: {out_dir} has no 'latest' checkpoint; run without --resume to start anew")
        tag = latest.read_text().strip()
    state_file = out_dir / tag / STATE_FILE
    if not state_file.is_file():
        done = [p.name for p in complete_checkpoints(out_dir)]
        why = "its save was interrupted" if (out_dir / tag).is_dir() or (out_dir / (tag + PARTIAL)).is_dir() \
            else "it does not exist"
        raise ResumeError(f"--resume {tag}: {out_dir / tag} is not a complete checkpoint ({why}); "
                          f"complete ones: {done or 'none'}")
    return tag, json.loads(state_file.read_text())


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
    """Restore module (trainable part), optimizer shards, LR scheduler and this rank's RNG state."""
    path, _ = engine.load_checkpoint(str(out_dir), tag=tag, load_module_strict=False,
                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise ResumeError(f"--resume {tag}: DeepSpeed found no checkpoint files in {Path(out_dir) / tag}")
    rng_file = Path(out_dir) / tag / f"rng_state_rank{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def write_diffusers_lora(layers: dict[str, torch.Tensor], out: str | Path, alpha: float, rank: int,
                         dtype: torch.dtype | None = None) -> Path:
    """OUT/pytorch_lora_weights.safetensors (`transformer.X.lora_A.weight` keys) for the pipelines'
    load_lora_weights. The diffusers layout stores no alpha, so alpha / rank is folded into lora_B."""
    from diffusers import QwenImageEditPipeline

    scale = alpha / rank
    layers = {k: (v * scale if scale != 1 and ".lora_B." in k else v).to(dtype or v.dtype) for k, v in layers.items()}
    QwenImageEditPipeline.save_lora_weights(Path(out), transformer_lora_layers=layers, weight_name=LORA_WEIGHT_NAME,
                                            safe_serialization=True)
    return Path(out) / LORA_WEIGHT_NAME


def export_lora(transformer, out_dir: str | Path, alpha: float, rank: int) -> Path:
    """The end-of-training LoRA export (same layout as `python -m train.export`)."""
    return write_diffusers_lora(lora_state_dict(transformer), out_dir, alpha, rank)


def export_full(transformer, out_dir: str | Path) -> Path:
    """OUT/transformer/: a diffusers QwenImageTransformer2DModel directory (config + safetensors)."""
    out = Path(out_dir) / "transformer"
    transformer.save_pretrained(out, safe_serialization=True)
    return out
