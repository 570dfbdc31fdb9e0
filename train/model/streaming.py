"""Build the transformer for training tensor by tensor, each tensor placed directly in its training form.

`from_pretrained` materialises the whole transformer in the model dtype (40.9 GB in bf16) before anything else
can happen, and converting it to fp8 afterwards briefly holds both copies. Here the model is first built without
storage (accelerate's `init_empty_weights`, what diffusers' own low-memory loading uses), then each tensor of the
safetensors shards is read alone (safetensors maps the file; one tensor is in host memory at a time) and put where
training keeps it: the GPU in the model dtype; the GPU in float8 (quantised there, `train.fp8_base`), its bf16 copy
freed at once; or host memory for the large frozen tensors of blocks that train.model.offload keeps in pinned host
memory. GPU memory therefore never rises above the final footprint plus one tensor, and host memory stays about
one tensor above what is kept there.

With QWEN_EDIT_RANDOM_INIT=1 the same placement is filled with random values drawn on the device per tensor
(seeded by its name), for measurements on full-size shapes without the weights.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from train.config import files
from train.model import fp8
from train.model.offload import moves, placeholder

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # diffusers' names for a model's weights (one file or shards)
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")


class WeightsError(ValueError):
    """The transformer's weight files do not match its config (missing, unexpected or misshapen tensors)."""


@dataclass
class Placement:
    """Where and in what form each transformer tensor is kept for training."""

    device: torch.device
    dtype: torch.dtype
    fp8: Callable[[str], str | None] | None = None  # train.fp8_base: the family's fp8 kind of a linear (fp8_kind)
    offload: set[int] = field(default_factory=set)  # block indices whose large frozen tensors stay on the host
    skip_offloaded: bool = False  # another process of the node fills the shared host copy of those (NodeShare)

    def block(self, name: str) -> int | None:
        m = _BLOCK.match(name)
        return int(m.group(1)) if m else None


def shard_files(transformer_dir: Path) -> list[Path]:
    """The safetensors files of a diffusers model directory, in the index's order (or the single file)."""
    index = transformer_dir / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (transformer_dir / n).is_file()]
        if missing:
            raise WeightsError(f"{index} names shard(s) {missing} that are not in {transformer_dir}; copy them "
                               "there (a partial download?)")
        return [transformer_dir / n for n in names]
    single = transformer_dir / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise WeightsError(f"{transformer_dir} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; point --model at a "
                       "diffusers-format directory (safetensors weights)")


def checkpoint_tensors(transformer_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, host tensor) for every tensor of the shards, one at a time."""
    from safetensors import SafetensorError, safe_open

    paths = shard_files(transformer_dir)
    damaged = files.weights_file_problems(paths)  # the pre-flight's check: the files may have changed since
    if damaged:
        raise WeightsError("; ".join(damaged))
    for path in paths:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except SafetensorError as e:
            raise WeightsError(f"{path} is damaged: it cannot be read ({e}); copy the file again") from None


def random_tensors(model: torch.nn.Module, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) drawn on `device` for every parameter of `model` (which has no storage): matrices
    uniform in +-1/sqrt(fan_in) like nn.Linear's default, norm scales 1, other vectors small uniform."""
    for name, p in model.named_parameters():
        g = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
        if p.dim() >= 2:
            bound = p.shape[1] ** -0.5
        elif "norm" in name and name.endswith("weight"):
            yield name, torch.ones(p.shape, device=device)
            continue
        else:
            bound = p.shape[0] ** -0.5
        yield name, (torch.rand(p.shape, generator=g, device=device) * 2 - 1) * bound


def empty_transformer(transformer_dir: Path):
    """The diffusers transformer of `transformer_dir/config.json` with parameters on the meta device (no memory);
    its non-parameter state (rotary tables) is real, as diffusers computes it in __init__."""
    from accelerate import init_empty_weights

    cls = files.transformer_class(transformer_dir)
    config = cls.load_config(transformer_dir)
    with init_empty_weights(include_buffers=False):
        return cls.from_config(config)


def _fp8_target(name: str, placement: Placement) -> bool:
    return (placement.fp8 is not None and name.endswith(".weight")
            and placement.fp8(name[: -len(".weight")]) is not None)


def load(model_dir: str | Path, placement: Placement, frozen: bool, random: bool = False):
    """The transformer with every tensor in its training form, and {linear name: (e4m3 weight, scale)} for the
    fp8 targets (their nn.Linear weights are placeholders until fp8.convert_frozen_linears swaps them).

    frozen: the base will not be trained (LoRA), so blocks may be offloaded and linears quantised."""
    transformer_dir = Path(model_dir) / "transformer"
    model = empty_transformer(transformer_dir)
    if not frozen and (placement.fp8 is not None or placement.offload):
        raise ValueError("fp8 and offloaded blocks need a frozen base (train.mode = 'lora')")
    params = dict(model.named_parameters())
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    unexpected, misshapen, seen = [], [], set()
    source = random_tensors(model, placement.device) if random else checkpoint_tensors(transformer_dir)
    for name, tensor in source:
        p = params.get(name)
        if p is None:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(p.shape):
            misshapen.append(f"{name} {tuple(tensor.shape)} (config: {tuple(p.shape)})")
            continue
        seen.add(name)
        value = tensor.to(placement.dtype) if tensor.is_floating_point() else tensor
        on_host = placement.block(name) in placement.offload and moves(tensor)
        skip = on_host and placement.skip_offloaded  # the node's shared copy comes from its writer
        if _fp8_target(name, placement):
            q, scale = fp8.quantize_weight(value.to(placement.device))  # quantised on the GPU, bf16 freed
            q = placeholder(q.shape, q.dtype, torch.device("cpu")) if skip else (q.cpu() if on_host else q)
            quantized[name[: -len(".weight")]] = (q, scale)  # every process needs the row scales
            value = placeholder(p.shape, placement.dtype, placement.device)
        elif skip:
            value = placeholder(p.shape, placement.dtype, torch.device("cpu"))
        else:
            value = value.to("cpu" if on_host else placement.device)
        _assign(model, name, value)
    missing = sorted(set(params) - seen)
    problems = ([f"missing tensors: {_few(missing)}"] if missing else []) + (
        [f"tensors the config has no place for: {_few(unexpected)}"] if unexpected else []) + (
        [f"tensors of another shape: {_few(misshapen)}"] if misshapen else [])
    if problems:
        raise WeightsError(f"{transformer_dir}: the weights do not match config.json ({'; '.join(problems)}); "
                           "the directory mixes files of two models, or a shard is damaged")
    return model, quantized


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=owner._parameters[attr].requires_grad)


def _few(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")
