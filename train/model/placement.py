"""A diffusers pipeline of any model family on its devices (validation images, train.infer): its modules placed,
the bridge that lets the transformer live on another device or in another dtype, and the LoRA files it loads."""

from __future__ import annotations

from pathlib import Path

import torch

from train.config import InferenceConfig
from train.model import family, lora_io


def parse_lora(spec: str) -> tuple[Path, float]:
    """'FILE[:WEIGHT]' -> (path, weight); weight 1.0 when none is given."""
    path, _, weight = spec.rpartition(":")
    if path:
        try:
            return Path(path), float(weight)
        except ValueError:
            pass
    return Path(spec), 1.0


def load_loras(pipe, loras: list[tuple[Path, float]]) -> None:
    """Load each LoRA file (diffusers layout, or what load_lora_weights converts) as its own adapter, weighted; a
    file in a layout the pipeline's converter would partly drop goes in as the family's LoraKeys.reads gives it."""
    reads = family.transformer_family(pipe.transformer).lora.reads
    names = []
    for i, (path, _) in enumerate(loras):
        names.append(f"lora{i}")
        tensors = lora_io.read_file(path)[0] if reads else {}
        converted = reads(tensors) if reads else tensors
        if converted.keys() != tensors.keys():
            pipe.load_lora_weights(converted, adapter_name=names[-1])
        else:
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=names[-1],
                                   local_files_only=True)
    if names:
        pipe.set_adapters(names, adapter_weights=[weight for _, weight in loras])


def place(pipe, inference: InferenceConfig, device: torch.device, placement: str = "single",
          decoder_device: torch.device | None = None) -> None:
    """Put the pipeline's modules on devices and apply the memory options of `inference`.

    single: everything on `device`, or CPU offload onto it (inference.cpu_offload). split: the text encoder and VAE
    on `device`, the transformer on `decoder_device`, with `bridge` moving tensors across (a model too big for one
    GPU with its encoders; no offload then).
    """
    if inference.vae_tiling:
        pipe.vae.enable_tiling()
    if inference.vae_slicing:
        pipe.vae.enable_slicing()
    if placement == "split":
        pipe.text_encoder.to(device)
        pipe.vae.to(device)
        pipe.transformer.to(decoder_device)
        bridge(pipe.transformer, decoder_device, pipe.transformer.dtype, device, pipe.text_encoder.dtype)
    elif inference.cpu_offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif inference.cpu_offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)


def _move(obj, device, dtype):
    """Tensors inside obj (tensors, tuples, lists, dicts, diffusers outputs) to device; floating ones to dtype."""
    if torch.is_tensor(obj):
        return obj.to(device, dtype if dtype is not None and obj.is_floating_point() else None)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(x, device, dtype) for x in obj)
    if isinstance(obj, dict):
        return type(obj)(**{k: _move(v, device, dtype) for k, v in obj.items()})
    return obj


def bridge(module: torch.nn.Module, device, dtype, out_device, out_dtype) -> list:
    """Hooks that feed `module` its inputs on (device, dtype) and hand its outputs back on (out_device, out_dtype).

    The pipelines create latents and prompt embeddings on their execution device in the text encoder's dtype;
    this lets the transformer live elsewhere (split placement) or in another precision (a bf16 or fp32 training
    run). Returns the hook handles (`.remove()` each to detach). Keyword arguments are moved too: the pipelines
    call the transformer with keywords only.
    """

    def before(_module, args, kwargs):
        return _move(args, device, dtype), _move(kwargs, device, dtype)

    def after(_module, _args, _kwargs, output):
        return _move(output, out_device, out_dtype)

    return [module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True)]
