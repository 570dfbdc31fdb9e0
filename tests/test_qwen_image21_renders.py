"""Qwen-Image-2.1 renders on the tiny checkpoint: train.infer and validation images equal QwenImage21Pipeline's own
output for the same seed and weights (edits with RGBA references keep their alpha, several references, text-to-image
rows), also when the conditioning is recorded where the encoders are and replayed with a VAE alone (the cache's and
the model-parallel mode's validation, train.infer's streamed blocks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from PIL import Image

from train import config, infer
from train.config import Config, ProjectConfig
from train.model import images, loading
from train.model.interface import Encoders
from train.model.qwen_image21 import components
from train.runtime.engine import Dist
from train.runtime.record import NullMetrics
from train.trainer import replay, validation

SETTINGS = {"num_inference_steps": 2, "true_cfg_scale": 1.0, "area": 128 * 128}
CPU = Dist(0, 1, 0, torch.device("cpu"))


def noise_image(width: int, height: int, seed: int, alpha: bool = False) -> Image.Image:
    """Random pixels; with `alpha` a left-to-right alpha ramp (transparent to opaque), a real alpha channel."""
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    if not alpha:
        return Image.fromarray(rgb, "RGB")
    ramp = np.broadcast_to(np.linspace(0, 255, width, dtype=np.uint8), (height, width))[..., None]
    return Image.fromarray(np.concatenate([rgb, ramp], axis=-1), "RGBA")


@pytest.fixture(scope="module")
def edits(tmp_path_factory) -> Path:
    """DIR/edits.jsonl: an edit of an RGBA reference, one of two references (RGB, then RGBA of another aspect ratio,
    which sizes the output), a text-to-image row."""
    folder = tmp_path_factory.mktemp("edits21")
    noise_image(128, 128, 0, alpha=True).save(folder / "logo.png")
    noise_image(128, 96, 1).save(folder / "photo.png")
    noise_image(96, 128, 2, alpha=True).save(folder / "tall.png")
    rows = [
        {"edit_image": "logo.png", "prompt": "make the circle blue", "seed": 7},
        {"edit_image": ["photo.png", "tall.png"], "prompt": "put picture 2 on picture 1"},
        {"prompt": "a red circle on grey", "output": "t2i"},
    ]
    (folder / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "infer.json").write_text(json.dumps({"qwen_edit": {"inference": SETTINGS}}))
    return folder


@pytest.fixture(scope="module")
def pipe(tiny_21):
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_render(pipe, references: list[Image.Image], prompt: str, seed: int, **extra) -> np.ndarray:
    """The pipeline's own render at the tests' area (output_resolution 128), two steps."""
    height = width = 128 if not references else None
    return np.asarray(
        pipe(
            prompt=prompt,
            image=references or None,
            height=height,
            width=width,
            num_inference_steps=2,
            output_resolution=128,
            generator=torch.Generator().manual_seed(seed),
            **extra,
        ).images[0]
    )


def expected(pipe, folder: Path, base_seed: int, **extra) -> dict[str, np.ndarray]:
    """{output name: the pipeline's render} of every row of DIR/edits.jsonl, its references read with alpha."""
    out = {}
    lines = (folder / "edits.jsonl").read_text().splitlines()
    for index, row in enumerate(json.loads(line) for line in lines):
        names = row.get("edit_image", [])
        references = [images.open_image(folder / n, alpha=True) for n in ([names] if isinstance(names, str) else names)]
        seed = row.get("seed", base_seed + index)
        out[row.get("output", f"{index:06d}")] = pipeline_render(pipe, references, row["prompt"], seed, **extra)
    return out


def infer_args(tiny_21: Path, folder: Path, out: Path) -> list[str]:
    return [
        "--model",
        str(tiny_21),
        "--input",
        str(folder / "edits.jsonl"),
        "--out",
        str(out),
        "--config",
        str(folder / "infer.json"),
        "--seed",
        "100",
    ]


def test_infer_writes_the_pipelines_rgba_renders(tiny_21, edits, pipe, tmp_path):
    """python -m train.infer (in process): every row's PNG is the pipeline's own render, RGBA with its alpha; the
    RGBA reference was read with its alpha (composited on white it renders another image)."""
    args = infer.parse_args(infer_args(tiny_21, edits, tmp_path))
    assert infer.check_args(args, world_size=1) == []
    assert infer.run(args, config.inference_settings(args.config), CPU) == 0
    wanted = expected(pipe, edits, base_seed=100)
    for name, image in wanted.items():
        written = Image.open(tmp_path / f"{name}.png")
        assert written.mode == "RGBA" and np.array_equal(np.asarray(written), image), name
    assert Image.open(tmp_path / "000001.png").size == (96, 160)  # the last (tall) reference sizes it
    flattened = [images.open_rgb(edits / "logo.png")]
    assert not np.array_equal(pipeline_render(pipe, flattened, "make the circle blue", 7), wanted["000000"])


def test_streamed_blocks_render_the_same_images(tiny_21, edits, pipe, tmp_path, monkeypatch):
    """cpu_offload "blocks": the encoders record every row's conditioning first, then the transformer (its first
    block streamed from host memory) replays it with the VAE alone: the images equal the pipeline's."""
    from train.plan.inference import InferencePlacement

    args = infer.parse_args(infer_args(tiny_21, edits, tmp_path))
    settings = config.inference_settings(args.config)
    settings.inference.cpu_offload = "blocks"
    monkeypatch.setattr(infer, "plan", lambda *a: InferencePlacement("blocks", 1, False))
    assert infer.run(args, settings, CPU) == 0
    for name, image in expected(pipe, edits, base_seed=100).items():
        # streamed weights compute in another memory layout: a pixel may round the other way
        written = np.asarray(Image.open(tmp_path / f"{name}.png"), dtype=np.int16)
        assert np.abs(written - image).max() <= 1 and (written != image).mean() < 1e-3, name


def test_random_init_renders_a_directory_without_weights(tiny_21, edits, tmp_path, monkeypatch, capsys):
    """QWEN_EDIT_RANDOM_INIT=1: a 2.1 directory of configs alone renders, every model built at random init."""
    model = tmp_path / "model"
    shutil.copytree(tiny_21, model)
    for f in model.glob("*/*.safetensors"):
        f.unlink()
    monkeypatch.setenv(loading.RANDOM_INIT_ENV, "1")
    args = infer.parse_args(infer_args(model, edits, tmp_path / "out"))
    assert infer.check_args(args, world_size=1) == []
    assert infer.run(args, config.inference_settings(args.config), CPU) == 0
    assert len(list((tmp_path / "out").glob("*.png"))) == 3
    printed = capsys.readouterr().out
    assert all(f"{what} at RANDOM INIT on cpu" in printed for what in ("text encoder", "VAE", "transformer"))


def validation_config(tiny_21: Path, edits: Path, out: Path, **inference) -> Config:
    cfg = Config(ProjectConfig(), deepspeed={})
    p = cfg.project
    p.model.path, p.output.dir, p.validation.file = str(tiny_21), str(out), str(edits / "edits.jsonl")
    p.inference = config.InferenceConfig(**{**SETTINGS, **inference})
    return cfg


def test_validation_renders_the_pipelines_images_encoded_or_replayed(tiny_21, edits, pipe, tmp_path):
    """A Validator around the live transformer renders each edit as the pipeline does (guidance on: the negative
    prompt is encoded too); with the conditioning recorded by replay.encode_requests and a VAE alone, the same
    images. The 'before' images keep their alpha."""
    cfg = validation_config(tiny_21, edits, tmp_path / "out", true_cfg_scale=2.0)
    encoders = components.load_encoders(tiny_21, torch.float32, CPU.device)
    recorded = replay.encode_requests(cfg, encoders, 0, 1)
    assert [name for name, _ in recorded[1]] == ["encode_prompt"] * 2 + ["_encode_vae_image"] * 2
    direct = validation.Validator(cfg, CPU, pipe.transformer, encoders, NullMetrics())
    direct.render_before(0)
    vae_only = Encoders(None, None, components.load_vae(tiny_21, torch.float32, CPU.device))
    replayed = validation.Validator(cfg, CPU, pipe.transformer, vae_only, NullMetrics(), recorded).render()
    wanted = expected(pipe, edits, cfg.project.train.seed, negative_prompt=" ", true_cfg_scale=2.0)
    for index, image in enumerate(wanted.values()):
        for rendered in (direct.before[index], replayed[index]):
            assert rendered.mode == "RGBA" and np.array_equal(np.asarray(rendered), image), index
    saved = Image.open(tmp_path / "out" / "validation" / "before" / "000000.png")
    assert saved.mode == "RGBA" and np.array_equal(np.asarray(saved), wanted["000000"])


def test_a_prompt_past_the_rotary_positions_is_a_bad_row(tiny_21, edits):
    """train.infer's row check: a prompt whose text positions, with the references', push the target's position
    past the rotary embedding's table is refused with the count to cut; an ordinary prompt passes. The room it
    counts is diffusers' own: with that many text tokens the target's block sits on the table's last positive
    position, with one more past it."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    from train.model import renders
    from train.model.qwen_image21 import samples

    processor = components.load_processor(tiny_21)
    (request, *_), _ = renders.read_requests(edits / "edits.jsonl")  # one 128 x 128 reference
    area = 128 * 96
    assert renders.check_request(request, "qwen_image_21", area, 0, processor) is None
    request.prompt = " ".join(["circle"] * samples.ROPE_POSITIONS)
    length, room = samples.prompt_overflow(processor, request.prompt, "", [(128, 128)], area, 0, with_target=False)
    problem = renders.check_request(request, "qwen_image_21", area, 0, processor)
    assert problem.startswith(f"the prompt takes {length} text positions") and f"has {room};" in problem

    rope = QwenImage21Rope(theta=10000, axes_dim=[4, 6, 6])
    rope.freqs[0] = rope.freqs[0][: samples.ROPE_POSITIONS]  # the positive positions alone: one past them fails
    width, height = samples.image_size(area, 128, 128)
    reference, target = (1, height // 16, width // 16), (1, 4, 4)  # the reference's latent grid; any target

    def positions(num_text: int) -> None:
        before = 3  # text tokens ahead of the reference's slot, the rest after it
        blocks = [reference[1] * reference[2], target[1] * target[2]]
        mask = [False] * before + [True] * blocks[0] + [False] * (num_text - before) + [True] * blocks[1]
        rope([reference, target], torch.tensor(mask), torch.device("cpu"))

    positions(room)
    with pytest.raises(IndexError):
        positions(room + 1)
