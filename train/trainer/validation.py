"""Validation images during training: the edits of validation.file rendered with the live weights.

Before the first step (and at every validation.every_steps and the last step) every rank renders its share of
the edits (items r::W) through diffusers' edit pipeline, built around the training run's own transformer (LoRA
active) and frozen encoders; rank 0 gathers them and writes OUTPUT/validation/step_NNNNNN.png, a grid of
reference(s) | before training | now per edit, and the same grid to tensorboard. Each edit has a fixed seed,
so grids of different steps differ only by the weights. Rendering leaves the training state as it found it:
RNG states (torch CPU and CUDA, python, numpy), every module's train/eval mode, the VAE's tiling flags, the
weights; a test checks that a run's losses are the same with and without validation.

On a GPU each render's peak (torch.cuda.max_memory_allocated while it runs, everything allocated included) is
measured with probes.PeakMeter, which leaves the run's logged peak as it was; rank 0 logs it, and summary.json gets
the largest of every rank's renders (render_peak_gb), beside the memory plan's predicted_render_peak_gb.

The conditioning may also be computed elsewhere (the model-parallel mode: the encoder stage holds the text
encoder, the decoder stage the transformer; training from the latent cache): a Validator given the recordings of
train/trainer/replay.py replays them into a pipeline that has only a VAE for decoding, and renders the same images.
The images keep their mode: a family whose pipelines render RGBA (Qwen-Image-2.1) saves its 'before' images with
their alpha; the grid shows them over white (train/trainer/grid.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image

from train.config import Config, ValidationConfig
from train.model import family, loading, placement, renders
from train.model.interface import Encoders
from train.runtime.engine import Dist, all_gather_objects
from train.runtime.oom import out_of_memory
from train.runtime.probes import PeakMeter
from train.trainer.grid import make_grid
from train.trainer.replay import Recorded, preserved_training_state, replayed_conditioning

BEFORE = "before"  # OUTPUT/validation/before/: the images before training, reused by resumed runs


def should_validate(step: int, v: ValidationConfig, max_steps: int) -> bool:
    every = v.every_steps
    return bool(v.file) and ((every and step % every == 0) or step == max_steps)


def _file_id(path: Path) -> list:
    """[resolved path, size, mtime_ns] of a file ([path] when it is missing): changes when the file is replaced."""
    path = Path(path)
    if not path.is_file():
        return [str(path)]
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _opened(file) -> Image.Image:
    """A rendered PNG (a path or a file object) decoded: RGBA when it has alpha, else RGB."""
    with Image.open(file) as im:
        return im.convert("RGBA" if "A" in im.getbands() else "RGB")


def _gather_on_rank0(mine: list[tuple[int, bytes]], d: Dist) -> list[Image.Image] | None:
    """Every rank's (index, PNG) pairs -> the images in index order on rank 0 (a collective); None elsewhere."""
    parts = all_gather_objects(mine)
    if not d.is_main:
        return None
    pairs = sorted(pair for part in parts for pair in part)
    return [_opened(io.BytesIO(png)) for _, png in pairs]


def _from_rank0(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


class Validator:
    """The after_step hook of train.trainer.loop.train; also renders the 'before' column when built.

    `conditioning`: this rank's share of the edits as replay.encode_requests recorded them elsewhere; then
    `encoders` needs only its VAE (for decoding), and the pipeline replays the recordings instead of encoding.
    `encoders_lock`: held while a render runs the encoders (the training source's, which a thread of its may be
    encoding the next micro-batch with: data.encode_ahead); None = nobody else uses them.
    """

    def __init__(self, cfg: Config, d: Dist, module: torch.nn.Module, encoders: Encoders | None, metrics,
                 conditioning: dict[int, Recorded] | None = None, encoders_lock: threading.Lock | None = None):
        p = cfg.project
        self.cfg, self.d, self.module, self.encoders, self.metrics = cfg, d, module, encoders, metrics
        self.conditioning = conditioning
        self.encoders_lock = encoders_lock or contextlib.nullcontext()
        self.inference = p.inference
        self.family, self.variant = family.detect(p.model.path, p.model.variant)
        self.requests, problems = renders.read_requests(p.validation.file, p.train.seed)
        if problems:  # config validation checked the file already; it changed since
            raise ValueError(f"qwen_edit.validation.file: line {problems[0][1]}: {problems[0][2]}")
        self.out = Path(p.output.dir) / "validation"
        self.pipe = None
        self.before: list[Image.Image | None] | None = None
        self.peak_bytes: int | None = None  # this rank's largest render peak so far (None: no render on a GPU yet)

    def _pipeline(self):
        if self.pipe is None:
            if self.encoders is None:  # training from a latent cache: the encoders load on first use
                model = self.cfg.project.model
                dtype = loading.encoder_dtype(model.encoder_dtype, self.d.device)
                self.encoders = self.family.load_encoders(model.path, dtype, self.d.device,
                                                          vae_2d_frames=model.vae_2d_frames)
            self.pipe = self.family.pipeline_from_components(self.cfg.project.model.path, self.variant, self.module,
                                                             self.encoders)
        return self.pipe

    def render(self, label: str | None = None) -> list[Image.Image] | None:
        """Every request with the module as it is now: this rank renders items rank::world; rank 0 gets all.
        With a `label`, rank 0 prints a progress line per image it renders (its share of the edits)."""
        try:
            with self.encoders_lock, PeakMeter(self.d.device) as meter:
                rendered = self._render(label)
        except torch.cuda.OutOfMemoryError as e:
            raise out_of_memory(e, "rendering validation images", "validation") from e
        if meter.bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, meter.bytes)
            self.metrics.message(f"validation: the render peaked at {meter.bytes / 1e9:.2f} GB of GPU memory on rank 0 "
                                 "(torch.cuda.max_memory_allocated while it ran)")
        return rendered

    def _render(self, label: str | None) -> list[Image.Image] | None:
        pipe = self._pipeline()
        vae, inf = self.encoders.vae, self.inference
        mine = []
        share = self.requests[self.d.rank::self.d.world_size]
        # the pipeline computes on the encoders' device, in their dtype (the VAE's, which the text encoder shares)
        hooks = placement.bridge(self.module, self.d.device, self.module.dtype, vae.device, vae.dtype)
        try:
            with preserved_training_state(self.module, vae, inf.vae_tiling, inf.vae_slicing):
                for k, request in enumerate(share, 1):
                    start = time.perf_counter()
                    with self._encoded(pipe, request):
                        image = self.family.sample(pipe, self.variant, self._references(request),
                                                   request.prompt, request.seed, inf)
                    mine.append((request.index, _png(image)))
                    if label:
                        self.metrics.message(f"validation: {label} image {k}/{len(share)} of this rank "
                                             f"({len(self.requests)} edits on {self.d.world_size} rank(s)) in "
                                             f"{time.perf_counter() - start:.1f}s")
        finally:
            for hook in hooks:
                hook.remove()
        return _gather_on_rank0(mine, self.d)

    def _references(self, request: renders.EditRequest) -> list[Image.Image]:
        return renders.open_references(request, self.cfg.project.data.alpha_background, self.family.rgba)

    def _encoded(self, pipe, request: renders.EditRequest):
        """Replays the request's recorded conditioning when it was computed elsewhere; encodes otherwise."""
        if self.conditioning is None:
            return contextlib.nullcontext()
        return replayed_conditioning(self.family.sampling_pipeline(pipe, bool(request.references)),
                                     self.conditioning[request.index],
                                     self.encoders.vae.device)

    def _fingerprint(self, adapters_off: bool = False) -> dict:
        """What produced the 'before' images: the base model (every file of its directory: transformer, VAE, text
        encoder, processor), the variant, the precision and fp8 base it ran in, the LoRA it started from
        (lora.init_from and the LoRA settings it loads under; `adapters_off`: none, a resumed run's base), the edits
        (validation file rows, reference files) and the sampler settings. Files are identified by path, size and
        modification time (hashing tens of GB would take minutes)."""
        p = self.cfg.project
        model = Path(p.model.path)
        lora = None
        if p.train.mode == "lora" and p.lora.init_from and not adapters_off:
            lora = {"init_from": _file_id(Path(p.lora.init_from)), "rank": p.lora.rank, "alpha": p.lora.alpha,
                    "target_modules": p.lora.target_modules}
        files = {str(f.relative_to(model)): _file_id(f) for f in sorted(model.rglob("*")) if f.is_file()}
        produced = {"model": str(model.resolve()), "variant": self.variant, "model files": files,
                    "precision": self.cfg.precision, "fp8_base": p.train.fp8_base and p.train.mode == "lora",
                    "encoder_dtype": p.model.encoder_dtype, "lora.init_from": lora,
                    "adapters": "off (a resumed run's base)" if adapters_off else "as the run starts",
                    "edits": [[[_file_id(r) for r in q.references], q.prompt, q.seed] for q in self.requests],
                    "alpha_background": p.data.alpha_background, "inference": dataclasses.asdict(self.inference)}
        return json.loads(json.dumps(produced))  # as edits.json reads back (tuples are lists there)

    def _saved_matches(self, saved: Path, start_step: int) -> bool:
        """Whether OUTPUT/validation/before/ holds images of what this run would render (a resumed run also takes
        those of its base, adapters off); when it holds others, the keys that differ are printed."""
        try:
            found = json.loads(saved.read_text()) if saved.is_file() else None
        except (OSError, json.JSONDecodeError):
            found = None
        wanted = [self._fingerprint()] + ([self._fingerprint(adapters_off=True)] if start_step > 0 else [])
        if found in wanted:
            return True
        if isinstance(found, dict):
            changed = sorted(k for k in wanted[0].keys() | found.keys() if found.get(k) != wanted[0].get(k))
            self.metrics.message(f"validation: the saved 'before' images in {saved.parent} were rendered with other "
                                 f"{', '.join(changed)}; rendering them again")
        return False

    def render_before(self, start_step: int) -> None:
        """The 'before training' column: reused from OUTPUT/validation/before/ when it matches, else rendered.

        A fresh run renders the model as it starts (base, or base + lora.init_from). A resumed run without saved
        images renders the base model (LoRA adapters disabled); after full fine-tuning the base weights are gone,
        so that column stays empty.
        """
        folder = self.out / BEFORE
        saved = folder / "edits.json"
        if _from_rank0(self._saved_matches(saved, start_step) if self.d.is_main else None):
            if self.d.is_main:
                self.before = [_opened(folder / f"{q.index:06d}.png") for q in self.requests]
            return
        if start_step > 0 and self.cfg.project.train.mode != "lora":
            self.metrics.message("validation: no saved 'before' images and the base weights of a resumed full "
                                 "fine-tune are gone; the 'before' column stays empty")
            self.before = [None] * len(self.requests)
            return
        adapters_off = start_step > 0
        if adapters_off:
            self.module.disable_adapters()
        self.metrics.message(f"validation: rendering the 'before' images of {len(self.requests)} edit(s) before the "
                             "first step (they are saved in OUTPUT/validation/before/ and reused while nothing that "
                             "produced them changes)" + (" from the base model, LoRA adapters off (a resumed run)"
                                                         if adapters_off else ""))
        try:
            rendered = self.render(label="'before'")
        finally:
            if adapters_off:
                self.module.enable_adapters()
        if self.d.is_main:
            self.before = rendered
            for q, image in zip(self.requests, rendered, strict=True):
                renders.save_png_atomic(image, folder / f"{q.index:06d}.png")
            saved.write_text(json.dumps(self._fingerprint(adapters_off), sort_keys=True, indent=1) + "\n")

    def __call__(self, step: int) -> None:
        if not should_validate(step, self.cfg.project.validation, self.cfg.project.train.max_steps):
            return
        images = self.render(label=f"step {step}")
        if self.d.is_main:
            references = [self._references(q) for q in self.requests]
            grid = make_grid(references, {"before": self.before, f"step {step}": images},
                             [q.prompt for q in self.requests])
            path = self.out / f"step_{step:06d}.png"
            renders.save_png_atomic(grid, path)
            self.metrics.image("validation", grid, step)
            self.metrics.message(f"validation: wrote {path}")


def render_peak_gb(hook: Validator | None) -> float | None:
    """The largest validation render's GPU peak over every rank, in GB (a collective: every rank calls it); None
    without renders or without a GPU."""
    peaks = [peak for peak in all_gather_objects(None if hook is None else hook.peak_bytes) if peak is not None]
    return max(peaks) / 1e9 if peaks else None


def build_hook(cfg: Config, d: Dist, module: torch.nn.Module, encoders: Encoders | None, metrics,
               start_step: int, conditioning: dict[int, Recorded] | None = None,
               encoders_lock: threading.Lock | None = None) -> Validator | None:
    """The validation hook for loop.train(after_step=...), its 'before' images rendered; None without a file.

    `encoders`: the run's frozen encoders, or None (a latent cache): then they load on the first render.
    `conditioning` (encoders then holds only a VAE) and `encoders_lock`: see Validator."""
    if not cfg.project.validation.file:
        return None
    validator = Validator(cfg, d, module, encoders, metrics, conditioning, encoders_lock)
    validator.render_before(start_step)
    return validator
