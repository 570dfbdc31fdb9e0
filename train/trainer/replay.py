"""Rendering with the diffusers pipelines next to a training run: the state a render must leave as it found it, and
the conditioning recorded where the encoders are and replayed where the transformer is.

`encode_requests` runs each edit's pipeline up to its denoising loop and records what the pipeline's frozen-encoder
methods (the family's encoder_calls) returned: prompt embeddings and masks (Qwen-Image-2.1: and the image-slot mask),
reference latents. `replayed_conditioning` makes a pipeline that has only a VAE for decoding return those
recordings instead of encoding. The pipeline code is diffusers' own on both sides, so the images are the same either
way; the model-parallel mode (the encoder stage holds the text encoder, the decoder stage the transformer), training
from the latent cache (the encoders leave the GPU before the transformer loads) and train.infer's streamed blocks
render so.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from train.config import Config, ModelConfig
from train.config.files import transformer_class
from train.model import family, images, loading, renders
from train.model.interface import Encoders
from train.runtime.engine import Dist


@contextlib.contextmanager
def preserved_training_state(module: torch.nn.Module, vae, vae_tiling: bool, vae_slicing: bool):
    """Eval mode and no gradients inside; RNG states, module modes and the VAE's flags restored on the way out."""
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
           random.getstate(), np.random.get_state())
    modes = [(m, m.training) for m in module.modules()]
    vae_flags = (vae.use_tiling, vae.use_slicing)
    module.eval()
    vae.use_tiling, vae.use_slicing = vae_tiling, vae_slicing
    try:
        with torch.no_grad():
            yield
    finally:
        vae.use_tiling, vae.use_slicing = vae_flags
        for m, training in modes:
            m.training = training
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        random.setstate(rng[2])
        np.random.set_state(rng[3])


Recorded = list  # [(method name, what it returned)] in call order: (embeds, mask or None) or a latents tensor


class _Encoded(Exception):  # a signal, not an error: the pipeline's encoders have all run
    """Stops a recording pipeline before its denoising loop."""


@contextlib.contextmanager
def _patched(pipe, methods: dict):
    """Instance attributes shadowing the pipeline's methods inside; the class's own methods again outside."""
    for name, method in methods.items():
        setattr(pipe, name, method)
    try:
        yield
    finally:
        for name in methods:
            delattr(pipe, name)


def shape_only_transformer(model_dir: str):
    """The transformer on the meta device: the pipeline reads its config before encoding (no weights load)."""
    cls = transformer_class(Path(model_dir) / "transformer")
    with torch.device("meta"):
        return cls.from_config(cls.load_config(Path(model_dir) / "transformer"))


def record_conditioning(pipe, variant: str, request: renders.EditRequest, inf,
                        background: str = images.DEFAULT_BACKGROUND) -> Recorded:
    """Run the edit of `request` up to its denoising loop; return what the frozen encoders gave the pipeline
    (its references opened over the alpha `background`)."""
    calls: Recorded = []
    fam = family.variant_family(variant)
    pipe = fam.sampling_pipeline(pipe, bool(request.references))
    encoder_calls = [name for name in fam.encoder_calls if hasattr(pipe, name)]  # a text-to-image one has fewer

    def recording(name: str):
        original = getattr(pipe, name)

        def call(*args, **kwargs):
            calls.append((name, original(*args, **kwargs)))
            return calls[-1][1]

        return call

    prepare_latents = pipe.prepare_latents

    def stop(*args, **kwargs):  # the reference latents are encoded in here; the denoising loop comes next
        prepare_latents(*args, **kwargs)
        raise _Encoded

    with _patched(pipe, {**{name: recording(name) for name in encoder_calls}, "prepare_latents": stop}):
        try:
            references = renders.open_references(request, background, fam.rgba)
            fam.sample(pipe, variant, references, request.prompt, request.seed, inf)
        except _Encoded:
            return calls
    raise AssertionError("the edit pipeline never prepared its latents")


@contextlib.contextmanager
def replayed_conditioning(pipe, calls: Recorded, device: torch.device):
    """Inside, the pipeline's frozen-encoder methods (those `calls` recorded) return `calls` (in order, moved to
    `device`) instead."""
    pending = list(calls)

    def replaying(name: str):
        def call(*_args, **_kwargs):
            recorded, out = pending.pop(0)
            assert recorded == name, f"the pipeline called {name}, the recording has {recorded}"
            if torch.is_tensor(out):
                return out.to(device)
            return tuple(None if t is None else t.to(device) for t in out)

        return call

    with _patched(pipe, {name: replaying(name) for name in dict.fromkeys(name for name, _ in calls)}):
        yield
    assert not pending, f"{len(pending)} recorded encoder calls were not replayed"


def encode_requests(cfg: Config, encoders: Encoders, rank: int, world_size: int) -> dict[int, Recorded]:
    """{request index: recording} of validation.file's items rank::world_size (the share a Validator of that
    rank renders), made with `encoders` under the inference section's VAE settings."""
    p = cfg.project
    fam, variant = family.detect(p.model.path, p.model.variant)
    requests, _ = renders.read_requests(p.validation.file, p.train.seed)
    pipe = fam.pipeline_from_components(p.model.path, variant, shape_only_transformer(p.model.path), encoders)
    with preserved_training_state(encoders.vae, encoders.vae, p.inference.vae_tiling, p.inference.vae_slicing):
        return {q.index: record_conditioning(pipe, variant, q, p.inference, p.data.alpha_background)
                for q in requests[rank::world_size]}


def record_before_training(cfg: Config, d: Dist) -> dict[int, Recorded] | None:
    """Training from the cache with validation.file: the encoders load once, before the transformer does, record
    this rank's share of the validation conditioning and leave the GPU; renders then replay the recordings with a
    VAE alone (as the model-parallel decoder renders), so validation adds only the VAE to the training GPU instead
    of loading the 16 GB VL encoder beside the model at the first render. None when that does not apply."""
    import gc

    p = cfg.project
    if not p.validation.file or p.data.cache == "off":
        return None
    dtype = loading.encoder_dtype(p.model.encoder_dtype, d.device)
    encoders = family.family_of(p.model.path, p.model.variant).load_encoders(p.model.path, dtype, d.device,
                                                                             vae_2d_frames=p.model.vae_2d_frames)
    recorded = encode_requests(cfg, encoders, d.rank, d.world_size)
    del encoders
    gc.collect()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    if d.is_main:
        print(f"validation: the conditioning of {len(recorded)} edit(s) per rank recorded; the encoders left the "
              "device before the transformer loads, renders replay it with the VAE alone", flush=True)
    return recorded


def vae_only(model: ModelConfig, d: Dist) -> Encoders:
    """What replayed validation needs of the encoders: the VAE (to decode)."""
    vae = family.family_of(model.path, model.variant).load_vae(
        model.path, loading.encoder_dtype(model.encoder_dtype, d.device), d.device, model.vae_2d_frames)
    return Encoders(text_encoder=None, processor=None, vae=vae)

