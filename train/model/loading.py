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


def random_text_encoder(model_class, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                        on_host: bool = False):
    """The VL text encoder (`model_class`, a transformers VL model) from MODEL/text_encoder's config at random init on
    `device`; on_host: kept in host memory, drawn on `device` (random_vl_in_host_memory)."""
    from transformers import AutoConfig

    with random_init_scope("text encoder", dtype, torch.device("cpu") if on_host else device):
        vl_config = AutoConfig.from_pretrained(Path(model_dir) / "text_encoder")
        if on_host:
            return random_vl_in_host_memory(model_class, vl_config, device)
        return model_class(vl_config)


def random_vl_in_host_memory(model_class, vl_config, device: torch.device):
    """A random-init VL model in host memory, its values drawn on `device` (transformers' initialisation on a CPU
    takes minutes for 8 B parameters): normal(0, initializer_range) matrices and embeddings, ones for norm weights,
    zeros for biases, from a fixed seed. Its values differ from the resident random init's (measurements only)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = model_class(vl_config)
    generator = torch.Generator(device).manual_seed(zlib.crc32(b"streamed text encoder"))
    std = getattr(vl_config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.ndim == 1:
                t.fill_(1.0 if "norm" in name else 0.0)
            else:
                t.copy_(torch.randn(t.shape, generator=generator, device=device, dtype=t.dtype).mul_(std))
    return model


def stream_from_host(text_encoder: torch.nn.Module, device: torch.device) -> None:
    """A Qwen VL encoder's blocks (the ViT's and the decoder's; Qwen2.5-VL and Qwen3-VL name them alike) keep their
    matrices in pinned host memory and are copied to `device` ahead of use, the next one prefetched on a side
    stream: train/model/offload.py's BlockOffloader, one per block list (two device slots each); everything else
    (embeddings, lm_head, norms, the ViT's patch embedding and merger, the blocks' vectors) moves to `device`.

    Not diffusers' group offloading: the VL model's blocks are two levels down, and with its block_modules reaching
    them (diffusers 0.42.1) the embeddings, which the parent module calls, stay in host memory, and its stream
    prefetch registers its layer tracker twice (both seen on an H200)."""
    from train.model.offload import BlockOffloader

    model = text_encoder.model
    text_encoder.stream_offloaders = [BlockOffloader(dict(enumerate(blocks)), device)
                                      for blocks in (model.visual.blocks, model.language_model.layers)]
    text_encoder.to(device)  # what the offloaders left: their placeholders and slots are on `device` already


def load_text_encoder(model_class, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                      stream: bool = False):
    """MODEL/text_encoder (`model_class`, a transformers VL model), frozen, on `device` (at random init under
    QWEN_EDIT_RANDOM_INIT=1); with `stream` it stays in host memory and runs on `device` block by block
    (stream_from_host)."""
    if random_init():
        text_encoder = random_text_encoder(model_class, model_dir, dtype, device, on_host=stream)
    else:
        text_encoder = model_class.from_pretrained(Path(model_dir) / "text_encoder", dtype=dtype,
                                                   local_files_only=True)
    text_encoder.requires_grad_(False).eval().to(torch.device("cpu") if stream else device)
    if stream:
        stream_from_host(text_encoder, device)
    return text_encoder
