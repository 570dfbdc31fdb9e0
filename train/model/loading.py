"""What loading any family's model directory shares: the encoders' dtype, the scheduler's config, the transformer
streamed into its training form, and QWEN_EDIT_RANDOM_INIT=1's models built at random init (measurements on
full-size shapes without the weights). Everything loads with `local_files_only=True`; nothing comes from a hub.
"""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from train.config import ModelConfig
from train.config.files import RANDOM_INIT_ENV, random_init, transformer_class  # random_init: QWEN_EDIT_RANDOM_INIT=1
from train.model import streaming


def encoder_dtype(name: str, device: torch.device) -> torch.dtype:
    """qwen_edit.model.encoder_dtype resolved for `device`: auto = bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, name)


def scheduler_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "scheduler" / "scheduler_config.json").read_text())


def _init_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def random_init_scope(what: str, dtype: torch.dtype, device: torch.device | None = None):
    """Create modules on `device` (default: the current device) in `dtype` (no fp32 copy first), and say so loudly.
    The weights are drawn from a seed fixed per model (`what`), so every process and every run builds the same ones
    (two runs to compare, or a model-parallel decoder's VAE and its encoder's); the caller's RNG state is left as it
    was."""
    device = device or _init_device()
    random_init_notice(what, device)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    devices = [device.index] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(zlib.crc32(what.encode()))
            yield
    finally:
        torch.set_default_dtype(saved)


def random_init_notice(what: str, device: torch.device) -> None:
    print(f"{RANDOM_INIT_ENV}=1: {what} at RANDOM INIT on {device} (for measurements only)", flush=True)


def streamed_transformer(model_dir: str | Path, placement: streaming.Placement, frozen: bool,
                         kept: torch.device | None = None):
    """streaming.load from the checkpoint, or at random init under QWEN_EDIT_RANDOM_INIT=1, said so with where the
    model is `kept` (default: the placement's device)."""
    if random_init():
        random_init_notice("transformer", kept or placement.device)
    return streaming.load(model_dir, placement, frozen=frozen, random=random_init())


def load_transformer(model_cfg: ModelConfig, dtype: torch.dtype):
    """The transformer of qwen_edit.model.path as diffusers' from_pretrained loads it (at random init under
    QWEN_EDIT_RANDOM_INIT=1): every weight in `dtype`, nothing frozen."""
    cls = transformer_class(Path(model_cfg.path) / "transformer")
    if random_init():
        with random_init_scope("transformer", dtype):
            return cls.from_config(cls.load_config(Path(model_cfg.path) / "transformer"))
    return cls.from_pretrained(model_cfg.path, subfolder="transformer", torch_dtype=dtype, local_files_only=True)
