"""Validation images in the model-parallel mode: conditioning encoded on the encoder stage, images rendered on
the decoder stage.

The encoder stage holds the text encoder and the VAE, the decoder stage the transformer being trained. Once, at
start, each pipeline's encoder records the conditioning of its share of validation.file
(`train.trainer.replay.encode_requests`: prompt embeddings and masks, reference latents, as diffusers' pipeline
computes them) and sends it after its opening message. The decoder loads only a VAE (to decode latents to
images) and renders with the live transformer through `train.trainer.validation.Validator`, which replays the
recordings instead of encoding: the same cadence, grids, tensorboard images and 'before' images as the ZeRO-2
mode. Pipeline p renders items p::P (as rank p of the ZeRO-2 mode would); decoder rank 0 writes the grids.
A decoder cut is refused by config validation: every denoising step would have to cross the stages.
"""

from __future__ import annotations

import torch

from model_parallel import transport
from train.config import Config, ValidationConfig
from train.model import family, loading
from train.model.interface import Encoders
from train.runtime.engine import Dist
from train.trainer import replay, validation


def conditioning_message(recorded: dict[int, replay.Recorded]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Recordings as (meta, tensors) for `transport.Sender.send`. A call's layout is None for a bare tensor, else
    which elements of its tuple are tensors (the prompt mask may be None)."""
    items, tensors = {}, {}
    for index, calls in recorded.items():
        layouts = []
        for j, (name, out) in enumerate(calls):
            if torch.is_tensor(out):
                layouts.append([name, None])
                tensors[f"{index}.{j}"] = out
                continue
            layouts.append([name, [t is not None for t in out]])
            tensors.update({f"{index}.{j}.{k}": t for k, t in enumerate(out) if t is not None})
        items[str(index)] = layouts
    return {"kind": "validation", "items": items}, tensors


def message_conditioning(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[int, replay.Recorded]:
    """Inverse of `conditioning_message` (tensors stay on the CPU; the replay moves them)."""
    assert meta["kind"] == "validation", meta
    recorded = {}
    for index, layouts in meta["items"].items():
        calls = []
        for j, (name, layout) in enumerate(layouts):
            if layout is None:
                calls.append((name, tensors[f"{index}.{j}"]))
            else:
                calls.append((name, tuple(tensors[f"{index}.{j}.{k}"] if present else None
                                          for k, present in enumerate(layout))))
        recorded[int(index)] = calls
    return recorded


def encoder_opening(cfg: Config, d: Dist, encoders: Encoders | None) -> list[tuple[dict, dict]]:
    """The encoder stage's extra opening messages: its pipeline's share of the validation conditioning (none
    without validation.file). `encoders`: the stage's own, or None (a latent cache): then they load for this."""
    p = cfg.project
    if not p.validation.file:
        return []
    if encoders is None:
        dtype = loading.encoder_dtype(p.model.encoder_dtype, d.device)
        encoders = family.family_of(p.model.path, p.model.variant).load_encoders(
            p.model.path, dtype, d.device, vae_2d_frames=p.model.vae_2d_frames)
    return [conditioning_message(replay.encode_requests(cfg, encoders, d.rank, d.world_size))]


def receive_conditioning(v: ValidationConfig, link, peer: int) -> dict[int, replay.Recorded] | None:
    """Decoder side: the encoder's validation conditioning (None without validation.file)."""
    if not v.file:
        return None
    return message_conditioning(*transport.recv(link, peer))


def decoder_hook(cfg: Config, d: Dist, module: torch.nn.Module, metrics, start_step: int,
                 conditioning: dict[int, replay.Recorded] | None) -> validation.Validator | None:
    """loop.train's after_step hook on the decoder stage, its 'before' images rendered; None without a file."""
    if conditioning is None:
        return None
    vae = replay.vae_only(cfg.project.model, d)
    return validation.build_hook(cfg, d, module, vae, metrics, start_step, conditioning)
