"""A checkpoint's files read as data, never code: the trust boundary of --resume and python -m train.export.

DeepSpeed loads its files with `torch.load(weights_only=False)` (full pickle: a planted file runs any code); here
every load goes through `safe_load` (torch's weights-only unpickler, allowing only the few DeepSpeed classes its
ZeRO shards hold), also DeepSpeed's own loads (SafeLoading) and zero_to_fp32's (weights_only_consolidation). A file
that needs anything else is refused, naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from contextlib import contextmanager

import torch


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
            "with. Delete it and use an earlier checkpoint that you trust"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointFileError(f"{path}: damaged, cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


class SafeLoading:
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
