"""diffusers' edit pipelines for validation images and batch inference: build, LoRAs, memory, placement, one edit.

The same code path serves `train.trainer.validation` (the live, LoRA-wrapped transformer of a training run plus its
already-loaded encoders) and `train.infer` (a model directory, optional LoRA files). Every edit draws its noise
from its own CPU `torch.Generator` seeded per request, so an image depends on its request only: not on the device,
the process that renders it, or the number of processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import torch
from PIL import Image

from train.config import InferenceConfig, textfile
from train.model import images
from train.model.qwen_image import components, conditioning, vae_frames

# --- requests: the jsonl rows of train.infer and of validation.file ----------------------------------------------


@dataclass
class EditRequest:
    """One edit to render. `index` is the row's 0-based position among the file's non-blank lines."""

    index: int
    line: int  # 1-based line in the jsonl (for reports)
    references: list[Path]
    prompt: str
    seed: int
    name: str  # output file name without .png (may hold '/': a subfolder of the output directory)


def read_requests(path: str | Path, base_seed: int = 0) -> tuple[list[EditRequest], list[tuple[int, int, str]]]:
    """Parse a jsonl of edits: {"edit_image": path or [paths], "prompt": str, "seed"?: int, "output"?: str}.

    Paths are relative to the file's folder. A row without a seed gets base_seed + its index, a row without an
    output name is called by its index (000007.png). Returns the requests and (index, line, problem) for rows that
    cannot be parsed; image files are checked later by `check_request` (by the process that renders the row).
    """
    path = Path(path)
    requests, problems, names = [], [], {}
    lines = [(n, text) for n, text in textfile.lines(path) if text.strip()]
    for index, (line, text) in enumerate(lines):
        try:
            request = _parse_row(json.loads(text), index, line, path.parent, base_seed)
        except json.JSONDecodeError as e:
            problems.append((index, line, f"not valid JSON ({e.msg}); write one JSON object per line"))
            continue
        except ValueError as e:
            problems.append((index, line, str(e)))
            continue
        if request.name in names:
            problems.append((index, line, f"output name {request.name!r} is already used by line "
                                          f"{names[request.name]}; give the row its own 'output'"))
            continue
        names[request.name] = line
        requests.append(request)
    return requests, problems


def _parse_row(row, index: int, line: int, folder: Path, base_seed: int) -> EditRequest:
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object with keys edit_image, prompt (optional: seed, output)")
    refs = row.get("edit_image", [])  # none: a text-to-image row
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise ValueError("'edit_image' must be a path or a list of paths (relative to the jsonl's folder); leave it "
                         "out for text-to-image")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("empty or missing 'prompt'; write the edit instruction")
    seed = row.get("seed", base_seed + index)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"'seed' must be a non-negative integer, got {json.dumps(seed)}")
    name = row.get("output", f"{index:06d}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("'output' must be a non-empty file name")
    return EditRequest(index, line, [folder / r for r in refs], prompt, seed, output_name(name))


MAX_NAME_BYTES = 255 - len(".png")  # a file name component on Linux file systems is at most 255 bytes


def output_name(name: str) -> str:
    """The row's output name in one spelling per file ('./x', 'a//b', 'x.png' and 'x' name x / a/b), so rows that
    would write one file are found as duplicates; ValueError for a name the file system would refuse."""
    name = name[:-4] if name.lower().endswith(".png") else name
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"'output' {name!r} must be a relative name inside the output directory")
    if "\0" in name or name.endswith("/") or not path.parts or path.parts[-1] in (".", ""):
        raise ValueError(f"'output' {name!r} is not a file name; write e.g. \"edits/cat\"")
    long = [part for part in path.parts if len(part.encode()) > MAX_NAME_BYTES]
    if long:
        raise ValueError(f"'output' {name!r}: the part {long[0][:40]!r}... is longer than {MAX_NAME_BYTES} bytes, "
                         "the file system's limit; shorten it")
    return str(path)


def check_request(request: EditRequest, variant: str, area: int = 1024 * 1024, condition_area: int = 384 * 384,
                  processor=None) -> str | None:
    """Why the request cannot be rendered (a missing, undecodable or decompression-bomb image, one whose resize to
    `area` rounds a side to nothing, too many references, with the pipeline's `processor` a prompt longer than the
    transformer's text positions), or None."""
    limit = conditioning.MAX_REFERENCES[variant]
    if request.references and not limit:
        return f"has edit_image but the {variant} variant (text-to-image) takes none; remove 'edit_image'"
    if len(request.references) > limit:
        return f"{len(request.references)} edit images but the {variant} variant takes at most {limit}"
    sizes = []
    for ref in request.references:
        if not ref.is_file():
            return f"{ref}: file not found"
        try:
            size = images.decoded_size(ref)  # as open_references will read it: oriented, composited, 8-bit
        except images.ImageProblem as e:
            return f"{ref}: {e}"
        if min(conditioning.dimensions(area, SimpleNamespace(width=size[0], height=size[1]))) < 32:
            return (f"{ref}: {size[0]}x{size[1]} px resizes to a side below 32 px at the pipeline's area; crop it "
                    "to a less extreme aspect ratio")
        sizes.append(size)
    over = sizes and processor is not None and conditioning.prompt_overflow(
        processor, request.prompt, variant, sizes, area, condition_area, with_target=False)
    if over:
        return (f"the prompt takes {over[0]} text positions with its reference image(s), but next to images of this "
                f"size the transformer has {over[1]}; shorten the prompt by {over[0] - over[1]} tokens or more")
    return None


def open_references(request: EditRequest, background: str = images.DEFAULT_BACKGROUND) -> list[Image.Image]:
    """The request's references as a viewer shows them (train/model/images.py: EXIF orientation, alpha over
    `background`, 16-bit scaled), as the training data is opened."""
    return [images.open_rgb(ref, background) for ref in request.references]


# --- pipelines ---------------------------------------------------------------------------------------------------


def _pipeline_class(variant: str):
    import diffusers

    return getattr(diffusers, conditioning.PIPELINE_CLASSES[variant])


def load_pipeline(model_dir: str | Path, dtype: torch.dtype, variant: str = "auto", models: dict | None = None,
                  vae_2d_frames: bool = True):
    """The variant's pipeline from a local diffusers directory (on the CPU; see `place`). models: modules already
    built ({"transformer": ..., ...}, e.g. components.random_pipeline_models'), which diffusers' from_pretrained
    takes in place of loading them; the other components (scheduler, tokenizer, processor) load from the files.
    vae_2d_frames (model.vae_2d_frames): the VAE's images take vae_frames.py's 2D path, or not."""
    variant = components.detect_variant(model_dir, variant)
    pipe = _pipeline_class(variant).from_pretrained(model_dir, dtype=dtype, local_files_only=True, **(models or {}))
    # before `place`: its offloading hooks wrap the layers' forwards
    (vae_frames.apply if vae_2d_frames else vae_frames.remove)(pipe.vae)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_from_components(model_dir: str | Path, variant: str, transformer, encoders: components.Encoders):
    """A pipeline around modules that are already loaded (a training run's live transformer and encoders).

    Nothing is moved or copied: the pipeline computes on the encoders' device, and `bridge` adapts the
    transformer's inputs when its device or dtype differ.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler",
                                                                local_files_only=True)
    tokenizer = Qwen2Tokenizer.from_pretrained(Path(model_dir) / "tokenizer", local_files_only=True)
    processor = {} if variant == "t2i" else {"processor": encoders.processor}  # QwenImagePipeline takes none
    pipe = _pipeline_class(variant)(scheduler=scheduler, vae=encoders.vae, text_encoder=encoders.text_encoder,
                                    tokenizer=tokenizer, transformer=transformer, **processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    """Load each LoRA file (diffusers layout, or what load_lora_weights converts) as its own adapter, weighted."""
    names = []
    for i, (path, _) in enumerate(loras):
        names.append(f"lora{i}")
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


def text_to_image_pipeline(pipe):
    """`pipe` itself when it is a QwenImagePipeline, else one around an edit pipeline's modules (shared, not copied;
    LoRAs loaded into the edit pipeline's transformer apply): how a request without references is sampled, with the
    prompt encoding the trainer uses for rows without references."""
    from diffusers import QwenImagePipeline

    if isinstance(pipe, QwenImagePipeline):
        return pipe
    if getattr(pipe, "_text_to_image", None) is None:
        t2i = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer, transformer=pipe.transformer)
        t2i.set_progress_bar_config(disable=True)
        pipe._text_to_image = t2i
    return pipe._text_to_image


def edit(pipe, variant: str, images: list[Image.Image], prompt: str, seed: int, inference: InferenceConfig,
         ) -> Image.Image:
    """One edit with the sampler settings of `inference`, sized to inference.area (not the pipelines' fixed 1 MP);
    without images a text-to-image sample (QwenImagePipeline), square, of inference.area."""
    guided = inference.true_cfg_scale > 1
    if not images:
        width, height = conditioning.dimensions(inference.area, Image.new("RGB", (1, 1)))
        return text_to_image_pipeline(pipe)(
            prompt=prompt, negative_prompt=inference.negative_prompt if guided else None,
            true_cfg_scale=inference.true_cfg_scale, height=height, width=width,
            num_inference_steps=inference.num_inference_steps, generator=torch.Generator("cpu").manual_seed(seed),
        ).images[0]
    with conditioning.pipeline_areas(inference.area, inference.condition_area):
        return pipe(
            image=images[0] if variant == "edit" else images,
            prompt=prompt,
            negative_prompt=inference.negative_prompt if guided else None,
            true_cfg_scale=inference.true_cfg_scale,
            num_inference_steps=inference.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(seed),  # CPU noise: the same image on any device
        ).images[0]


def save_png_atomic(image: Image.Image, path: Path) -> None:
    """Write path via a temporary file and a rename, so a killed run never leaves a truncated PNG behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
