"""Validation images during training: the edits of validation.file rendered with the live weights.

Before the first step (and at every validation.every_steps and the last step) every rank renders its share of
the edits (items r::W) through diffusers' edit pipeline, built around the training run's own transformer (LoRA
active) and frozen encoders; rank 0 gathers them and writes OUTPUT/validation/step_NNNNNN.png, a grid of
reference(s) | before training | now per edit, and the same grid to tensorboard. Each edit has a fixed seed,
so grids of different steps differ only by the weights. Rendering leaves the training state as it found it:
RNG states (torch CPU and CUDA, python, numpy), every module's train/eval mode, the VAE's tiling flags, the
weights; a test checks that a run's losses are the same with and without validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

from train import inference, models
from train.config import Config
from train.engine import Dist, all_gather_objects

BEFORE = "before"  # OUTPUT/validation/before/: the images before training, reused by resumed runs


def should_validate(step: int, cfg: Config) -> bool:
    every = cfg.project.validation.every_steps
    return bool(cfg.project.validation.file) and ((every and step % every == 0) or step == cfg.project.train.max_steps)


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


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _gather_on_rank0(mine: list[tuple[int, bytes]], d: Dist) -> list[Image.Image] | None:
    """Every rank's (index, PNG) pairs -> the images in index order on rank 0 (a collective); None elsewhere."""
    parts = all_gather_objects(mine)
    if not d.is_main:
        return None
    pairs = sorted(pair for part in parts for pair in part)
    return [Image.open(io.BytesIO(png)).convert("RGB") for _, png in pairs]


def _from_rank0(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def make_grid(references: list[list[Image.Image]], columns: dict[str, list[Image.Image | None]]) -> Image.Image:
    """One row per edit: its references, then one cell per named column (None = an empty cell); a header line."""
    cells = [im for col in columns.values() for im in col if im is not None]
    cell_w, cell_h = max(im.width for im in cells), max(im.height for im in cells)
    num_refs, header = max(len(r) for r in references), 16
    names = [f"reference {i + 1}" for i in range(num_refs)] + list(columns)
    grid = Image.new("RGB", (cell_w * len(names), header + cell_h * len(references)), "white")
    draw = ImageDraw.Draw(grid)
    for j, name in enumerate(names):
        draw.text((j * cell_w + 2, 2), name, fill="black")
    for i, refs in enumerate(references):
        row = list(refs) + [None] * (num_refs - len(refs)) + [col[i] for col in columns.values()]
        for j, im in enumerate(row):
            if im is not None:
                fitted = im.copy()
                fitted.thumbnail((cell_w, cell_h))
                grid.paste(fitted, (j * cell_w + (cell_w - fitted.width) // 2, header + i * cell_h))
    return grid


class Validator:
    """The after_step hook of train.loop.train; also renders the 'before' column when built."""

    def __init__(self, cfg: Config, d: Dist, module: torch.nn.Module, encoders: models.Encoders | None, metrics):
        p = cfg.project
        self.cfg, self.d, self.module, self.encoders, self.metrics = cfg, d, module, encoders, metrics
        self.inference = p.inference
        self.variant = models.detect_variant(p.model.path, p.model.variant)
        self.requests, problems = inference.read_requests(p.validation.file, p.train.seed)
        if problems:  # config validation checked the file already; it changed since
            raise ValueError(f"qwen_edit.validation.file: line {problems[0][1]}: {problems[0][2]}")
        self.out = Path(p.output.dir) / "validation"
        self.pipe = None
        self.before: list[Image.Image | None] | None = None

    def _pipeline(self):
        if self.pipe is None:
            if self.encoders is None:  # training from a latent cache: the encoders load on first use
                model = self.cfg.project.model
                dtype = models.encoder_dtype(model.encoder_dtype, self.d.device)
                self.encoders = models.load_encoders(model.path, dtype, self.d.device)
            self.pipe = inference.pipeline_from_components(self.cfg.project.model.path, self.variant, self.module,
                                                           self.encoders)
        return self.pipe

    def render(self) -> list[Image.Image] | None:
        """Every request with the module as it is now: this rank renders items rank::world; rank 0 gets all."""
        pipe = self._pipeline()
        vae, inf = self.encoders.vae, self.inference
        mine = []
        hooks = inference.bridge(self.module, self.d.device, self.module.dtype, vae.device,
                                 self.encoders.text_encoder.dtype)
        try:
            with preserved_training_state(self.module, vae, inf.vae_tiling, inf.vae_slicing):
                for request in self.requests[self.d.rank::self.d.world_size]:
                    image = inference.edit(pipe, self.variant, inference.open_references(request), request.prompt,
                                           request.seed, inf)
                    mine.append((request.index, _png(image)))
        finally:
            for hook in hooks:
                hook.remove()
        return _gather_on_rank0(mine, self.d)

    def _fingerprint(self) -> str:
        """What the 'before' images depend on besides the base weights: the edits and the sampler settings."""
        edits = [[[str(r) for r in q.references], q.prompt, q.seed] for q in self.requests]
        return json.dumps({"edits": edits, "inference": dataclasses.asdict(self.inference)}, sort_keys=True)

    def render_before(self, start_step: int) -> None:
        """The 'before training' column: reused from OUTPUT/validation/before/ when it matches, else rendered.

        A fresh run renders the model as it starts (base, or base + lora.init_from). A resumed run without saved
        images renders the base model (LoRA adapters disabled); after full fine-tuning the base weights are gone,
        so that column stays empty.
        """
        folder = self.out / BEFORE
        saved = folder / "edits.json"
        reuse = _from_rank0(saved.is_file() and saved.read_text() == self._fingerprint())
        if reuse:
            if self.d.is_main:
                self.before = [Image.open(folder / f"{q.index:06d}.png").convert("RGB") for q in self.requests]
            return
        if start_step > 0 and self.cfg.project.train.mode != "lora":
            self.metrics.message("validation: no saved 'before' images and the base weights of a resumed full "
                                 "fine-tune are gone; the 'before' column stays empty")
            self.before = [None] * len(self.requests)
            return
        adapters_off = start_step > 0
        if adapters_off:
            self.module.disable_adapters()
        try:
            images = self.render()
        finally:
            if adapters_off:
                self.module.enable_adapters()
        if self.d.is_main:
            self.before = images
            for q, image in zip(self.requests, images, strict=True):
                inference.save_png_atomic(image, folder / f"{q.index:06d}.png")
            saved.write_text(self._fingerprint())

    def __call__(self, step: int) -> None:
        if not should_validate(step, self.cfg):
            return
        images = self.render()
        if self.d.is_main:
            references = [[im.convert("RGB") for im in inference.open_references(q)] for q in self.requests]
            grid = make_grid(references, {"before": self.before, f"step {step}": images})
            path = self.out / f"step_{step:06d}.png"
            inference.save_png_atomic(grid, path)
            self.metrics.image("validation", grid, step)
            self.metrics.message(f"validation: wrote {path}")


def build_hook(cfg: Config, d: Dist, module: torch.nn.Module, encoders: models.Encoders | None, metrics,
               start_step: int) -> Validator | None:
    """The validation hook for loop.train(after_step=...), its 'before' images rendered; None without a file.

    `encoders`: the run's frozen encoders, or None (a latent cache): then they load on the first render."""
    if not cfg.project.validation.file:
        return None
    validator = Validator(cfg, d, module, encoders, metrics)
    validator.render_before(start_step)
    return validator
