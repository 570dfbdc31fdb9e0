"""Validation images during training (train/trainer/validation.py): grids at the configured steps from 2 ranks, and
training that is bitwise unchanged by them."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import metrics, run_trainer, write_config
from PIL import Image
from safetensors.torch import load_file

from train.config import Config, ProjectConfig, ValidationConfig
from train.trainer import replay, validation
from train.trainer.grid import CAPTION, caption_lines, make_grid

TINY_INFERENCE = {"num_inference_steps": 2, "true_cfg_scale": 1.0, "area": 128 * 128, "condition_area": 64 * 64}


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


def edits_file(tiny: Path, path: Path, num_edits: int = 3, references: bool = True) -> Path:
    """Validation rows on the references of the tiny dataset's first rows (two per edit for 2509; none for the
    text-to-image model, or without `references`)."""
    data = tiny / "data"
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()[:num_edits]]
    rows = [{"prompt": f"{row['prompt']} ({i})", **({"edit_image": [str(data / r) for r in row["edit_image"]]
             if isinstance(row["edit_image"], list) else str(data / row["edit_image"])}
             if references and "edit_image" in row else {})} for i, row in enumerate(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_changes(edits: Path | None, **common) -> dict:
    """The config changes of a validation test's run: every step logged, the tiny inference settings, `common`, and
    with `edits` the validation of its edits every 2 steps."""
    validation = {"qwen_edit.validation": {"file": str(edits), "every_steps": 2}} if edits else {}
    return {"qwen_edit.output.log_every_steps": 1, "qwen_edit.inference": TINY_INFERENCE, **common, **validation}


def validated_runs(tiny: Path, tmp_path: Path, edits: Path, **common) -> dict[str, Path]:
    """2 processes, 4 steps, with `common` config changes (run_changes), once plain and once validating the 3 edits
    of `edits`: {"plain": OUT, "validated": OUT}."""
    runs = {}
    for name, validated in {"plain": None, "validated": edits}.items():
        cfg = write_config(tmp_path / f"{name}.json", **run_changes(validated, **common))
        runs[name] = tmp_path / name
        check(run_trainer(tiny, runs[name], config=cfg, num_procs=2, extra=("--max_steps", "4")))
    return runs


def check_validated_run(runs: dict[str, Path]) -> None:
    """validated_runs: 'before' images and grids at steps 2 and 4 (also in tensorboard); losses and the exported
    LoRA equal those of the plain run, bit for bit."""
    runs = {name: runs[name] for name in ("plain", "validated")}
    losses = {name: [r["loss"] for r in metrics(out)] for name, out in runs.items()}
    assert len(losses["plain"]) == 4 and losses["validated"] == losses["plain"], losses
    a, b = (load_file(out / "export" / "pytorch_lora_weights.safetensors") for out in runs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for out in runs.values():  # the renders' measured GPU peak: a key of summary.json, None on a CPU
        summary = json.loads((out / "summary.json").read_text())
        assert "measured_render_peak_gb" in summary and summary["measured_render_peak_gb"] is None

    out = runs["validated"] / "validation"
    assert sorted(p.name for p in out.glob("step_*.png")) == ["step_000002.png", "step_000004.png"]
    assert sorted(p.name for p in (out / "before").glob("*.png")) == ["000000.png", "000001.png", "000002.png"]
    before = Image.open(out / "before" / "000000.png")
    grids = {s: np.asarray(Image.open(out / f"step_00000{s}.png").convert("RGB")) for s in (2, 4)}
    w, h, c = before.size + (CAPTION,)
    assert grids[4].shape == (16 + 3 * (c + h), 3 * w, 3)  # header + 3 edits under their prompts; ref | before | now
    first_before = grids[4][16 + c:16 + c + h, w:2 * w]
    assert np.array_equal(first_before, np.asarray(before.convert("RGB")))
    assert (grids[4][16:16 + c] < 128).any(), "no prompt text above the first edit"
    assert not np.array_equal(grids[2][16:, 2 * w:], grids[4][16:, 2 * w:]), "the 'now' column did not change"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["validated"] / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("validation")] == [2, 4]


@pytest.mark.slow
def test_validation_grids_and_unchanged_training(validated_zero2):
    """ZeRO-2 on 2 ranks: the 3 edits are spread over the ranks and gathered on rank 0 (check_validated_run)."""
    check_validated_run(validated_zero2)


def test_should_validate():
    v = ValidationConfig()
    assert not any(validation.should_validate(s, v, 10) for s in range(1, 11))  # no file: off
    v.file = "v.jsonl"
    assert [s for s in range(1, 11) if validation.should_validate(s, v, 10)] == [10]
    v.every_steps = 4
    assert [s for s in range(1, 11) if validation.should_validate(s, v, 10)] == [4, 8, 10]


def test_preserved_training_state_restores_everything():
    """RNG states, module modes and the VAE's flags come back, also when rendering fails; no gradients inside."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    module[0].eval()  # a mixed state is restored module by module
    vae = type("Vae", (), {"use_tiling": False, "use_slicing": True})()

    def reseed():
        torch.manual_seed(1), random.seed(1), np.random.seed(1)

    def draw():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    reseed()
    expected = draw()
    for fail in (True, False):
        reseed()
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            with replay.preserved_training_state(module, vae, True, False):
                assert not module.training and not torch.is_grad_enabled()
                assert vae.use_tiling and not vae.use_slicing
                draw(), draw()
                if fail:
                    raise RuntimeError("render failed")
        assert draw() == expected
        assert module.training and not module[0].training and module[1].training
        assert (vae.use_tiling, vae.use_slicing) == (False, True) and torch.is_grad_enabled()


def test_make_grid_layout():
    """Columns: as many reference cells as the edit with most references, then the named columns; a header line."""
    red, blue = Image.new("RGB", (32, 16), "red"), Image.new("RGB", (16, 16), "blue")
    grid = make_grid([[red], [red, blue]], {"before": [None, blue], "now": [blue, red]})
    assert grid.size == (4 * 32, 16 + 2 * 16)
    assert grid.getpixel((32 + 16, 16 + 8)) == (255, 255, 255)  # edit 1 has no second reference
    assert grid.getpixel((2 * 32 + 16, 16 + 8)) == (255, 255, 255)  # nor a 'before' image
    assert grid.getpixel((3 * 32 + 16, 16 + 16 + 8)) == (255, 0, 0)
    captioned = make_grid([[red], [red, blue]], {"now": [blue, red]}, ["make it red", "make it blue"])
    c = CAPTION
    assert captioned.size == (3 * 32, 16 + 2 * (c + 16))
    text_rows = np.asarray(captioned.convert("L"))[16:16 + c]
    assert (text_rows < 128).any() and captioned.getpixel((16, 16 + c + 8)) == (255, 0, 0)


def test_make_grid_wraps_long_prompts():
    """A prompt wider than the grid is broken at spaces over as many caption lines as it needs, each within the
    grid, every word kept; the row under it moves down by those lines."""
    from PIL import ImageDraw

    red = Image.new("RGB", (32, 32), "red")
    prompt = "replace the sky with a sunset over the sea and keep the face of the person exactly as it is"
    lines = caption_lines(prompt, 2 * 32 - 4)
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    assert len(lines) > 2 and " ".join(lines) == prompt
    assert all(draw.textlength(line) <= 60 for line in lines)
    assert caption_lines("a-single-word-wider-than-the-grid", 10) == ["a-single-word-wider-than-the-grid"]
    grid = make_grid([[red], [red]], {"now": [red, red]}, [prompt, "short"])
    c = CAPTION
    assert grid.size == (2 * 32, 16 + len(lines) * c + 32 + c + 32)
    assert grid.getpixel((16, 16 + len(lines) * c + 8)) == (255, 0, 0)  # edit 1's reference under its lines
    assert grid.getpixel((16, 16 + len(lines) * c + 32 + c + 8)) == (255, 0, 0)  # edit 2's under its one line
    text = np.asarray(grid.convert("L"))[16:16 + len(lines) * c]
    assert all((text[k * c:(k + 1) * c] < 128).any() for k in range(len(lines))), "a caption line is blank"


def before_images_harness(cfg, monkeypatch):
    """render_before on a Validator of `cfg` whose renders, adapter switches and messages are recorded: returns
    (events, before), before(start_step) running render_before on a new Validator and returning it."""
    from train.runtime.engine import Dist
    from train.runtime.record import NullMetrics

    events = []

    class Module:
        def disable_adapters(self):
            events.append("off")

        def enable_adapters(self):
            events.append("on")

    class Messages(NullMetrics):
        def message(self, text: str) -> None:
            events.append(text)

    monkeypatch.setattr(validation.Validator, "render",
                        lambda self, label=None: events.append("render") or [Image.new("RGB", (8, 8), "red")])

    def before(start_step: int) -> validation.Validator:
        v = validation.Validator(cfg, Dist(0, 1, 0, torch.device("cpu")), Module(), None, Messages())
        v.render_before(start_step)
        return v

    return events, before


def test_before_images_reused_on_resume(tiny_edit, tmp_path, monkeypatch):
    """'before' images are saved once and reused while the edits and sampler settings stay the same; a resumed
    LoRA run without them renders the base (adapters off); a resumed full fine-tune leaves the column empty."""
    edits = tmp_path / "val.jsonl"
    edits.write_text(f'{{"edit_image": "{tiny_edit}/data/0000_ref.png", "prompt": "make it red"}}\n')
    cfg = Config(ProjectConfig(), deepspeed={})
    cfg.project.model.path, cfg.project.output.dir = str(tiny_edit / "model"), str(tmp_path / "out")
    cfg.project.validation.file = str(edits)
    events, run = before_images_harness(cfg, monkeypatch)

    def before(start_step: int):
        v = run(start_step)
        messages.extend(e for e in events if e.startswith("validation:"))
        events[:] = [e for e in events if not e.startswith("validation:")]
        return v.before

    messages = []
    assert before(0)[0].getpixel((0, 0)) == (255, 0, 0) and events == ["render"]
    assert messages == ["validation: rendering the 'before' images of 1 edit(s) before the first step (they are "
                        "saved in OUTPUT/validation/before/ and reused while nothing that produced them changes)"]
    assert (tmp_path / "out" / "validation" / "before" / "000000.png").is_file()
    assert before(5)[0].getpixel((0, 0)) == (255, 0, 0) and events == ["render"]  # reused
    cfg.project.inference.num_inference_steps = 7  # other settings: the saved images no longer apply
    before(5)
    assert events == ["render", "off", "render", "on"]
    cfg.project.inference.num_inference_steps = 8
    cfg.project.train.mode = "full"
    assert before(5) == [None] and events[-1] == "on"


def test_before_images_keyed_on_what_produced_them(tiny_edit, tmp_path, monkeypatch):
    """The saved 'before' images are re-rendered when the base model's transformer files, lora.init_from (set, or
    replaced), the variant-bearing model path or a reference file changes; reused when nothing did."""
    import shutil
    import time

    from train.runtime.engine import Dist
    from train.runtime.record import NullMetrics

    model = tmp_path / "model"
    shutil.copytree(tiny_edit / "model", model)
    shutil.copy(tiny_edit / "data" / "0000_ref.png", tmp_path / "ref.png")
    edits = tmp_path / "val.jsonl"
    edits.write_text('{"edit_image": "ref.png", "prompt": "make it red"}\n')
    cfg = Config(ProjectConfig(), deepspeed={})
    cfg.project.model.path, cfg.project.output.dir = str(model), str(tmp_path / "out")
    cfg.project.validation.file = str(edits)
    renders = []
    monkeypatch.setattr(validation.Validator, "render",
                        lambda self, label=None: renders.append(1) or [Image.new("RGB", (8, 8), "red")])

    def rendered() -> bool:
        """Whether render_before rendered (True) or reused (False) the saved images."""
        count = len(renders)
        validation.Validator(cfg, Dist(0, 1, 0, torch.device("cpu")), None, None, NullMetrics()).render_before(0)
        return len(renders) > count

    def replace(path: Path, data: bytes) -> None:
        time.sleep(0.01)  # a new modification time even on coarse clocks
        path.write_bytes(data)

    assert rendered() and not rendered()
    lora = tmp_path / "start.safetensors"
    lora.write_bytes(b"one")
    cfg.project.lora.init_from = str(lora)
    assert rendered() and not rendered()
    replace(lora, b"other")
    assert rendered() and not rendered()
    weights = next((model / "transformer").glob("*.safetensors"))
    replace(weights, weights.read_bytes())  # a re-downloaded or re-converted base
    assert rendered() and not rendered()
    replace(tmp_path / "ref.png", (tmp_path / "ref.png").read_bytes())
    assert rendered() and not rendered()
    vae = next((model / "vae").glob("*.safetensors"))
    replace(vae, vae.read_bytes())  # another VAE (or text encoder) in the same model directory
    assert rendered() and not rendered()
    cfg.project.lora.alpha = 2 * cfg.project.lora.alpha  # the same init_from file, loaded at another scale
    assert rendered() and not rendered()
    cfg.deepspeed = {"bf16": {"enabled": True}}
    assert rendered() and not rendered()
    cfg.project.train.fp8_base = True
    assert rendered() and not rendered()
    cfg.project.validation.every_steps = 7  # not what the images are made of: reused
    assert not rendered()


def test_before_images_say_why_they_are_rendered_again(tiny_edit, tmp_path, monkeypatch):
    """Saved 'before' images of another base are rendered again with a line naming what changed; a resumed LoRA run
    renders the base (adapters off), saves it as such and reuses it on its next resume, while a fresh run does not
    take those (its 'before' is base + lora.init_from)."""
    import shutil

    for name in ("a", "b"):
        shutil.copytree(tiny_edit / "model", tmp_path / name)
    edits = tmp_path / "val.jsonl"
    edits.write_text(f'{{"edit_image": "{tiny_edit}/data/0000_ref.png", "prompt": "make it red"}}\n')
    cfg = Config(ProjectConfig(), deepspeed={})
    cfg.project.model.path, cfg.project.output.dir = str(tmp_path / "a"), str(tmp_path / "out")
    cfg.project.validation.file = str(edits)
    lora = tmp_path / "start.safetensors"
    lora.write_bytes(b"one")
    cfg.project.lora.init_from = str(lora)
    events, run = before_images_harness(cfg, monkeypatch)

    def before(start_step: int) -> list:
        events.clear()
        run(start_step)
        return [e for e in events if not e.startswith("validation: rendering the")]

    assert before(0) == ["render"]
    cfg.project.model.path = str(tmp_path / "b")
    assert before(0) == [f"validation: the saved 'before' images in {tmp_path / 'out' / 'validation' / 'before'} "
                         "were rendered with other model, model files; rendering them again", "render"]
    lora.write_bytes(b"two")  # resumed with another init_from: base only, adapters off
    assert before(5)[-3:] == ["off", "render", "on"]
    assert any(e.endswith("from the base model, LoRA adapters off (a resumed run)") for e in events)
    assert before(5) == []  # reused by the next resume
    assert before(0)[-1] == "render"  # a fresh run wants base + init_from


def test_validation_from_the_cache_replays_recorded_conditioning(tiny_edit, tmp_path):
    """Training from the cache, the encoders record the validation conditioning before the transformer loads and
    leave; the renders replay it with a VAE alone and give the online run's 'before' images pixel for pixel."""
    data = tiny_edit / "data"
    edits = tmp_path / "validation.jsonl"
    edits.write_text("".join(json.dumps({"edit_image": f"{data}/000{i}_ref.png", "prompt": f"make it {c}"}) + "\n"
                             for i, c in enumerate(["red", "blue"])))
    common = {"qwen_edit.inference": TINY_INFERENCE, "qwen_edit.validation": {"file": str(edits)}}
    outs = {}
    for cache in ("off", "auto"):
        cfg = write_config(tmp_path / f"{cache}.json", **common, **{"qwen_edit.data.cache": cache})
        outs[cache] = tmp_path / cache
        proc = run_trainer(tiny_edit, outs[cache], config=cfg, extra=("--max_steps", "1"))
        check(proc)
        assert ("renders replay it with the VAE alone" in proc.stdout) == (cache == "auto")
    for name in ("000000.png", "000001.png"):
        a, b = (np.asarray(Image.open(out / "validation" / "before" / name)) for out in outs.values())
        assert np.array_equal(a, b), name


def test_render_peaks_are_measured_and_reported(monkeypatch):
    """On a GPU (torch.cuda's counters faked) every render's peak is measured, rank 0 logs it, the Validator keeps
    the largest, and render_peak_gb gives the largest over the ranks (a world of one here) for summary.json, while
    the run's logged peak is the one it would be without the measurement. Without a GPU or renders: None."""
    from conftest import FakeCudaCounter

    from train.runtime import probes as run_metrics

    monkeypatch.setattr(run_metrics, "_peak_floor", {})
    monkeypatch.setattr(run_metrics, "_reserved_floor", {})
    cuda = FakeCudaCounter()
    cuda.install(monkeypatch)
    messages = []
    v = validation.Validator.__new__(validation.Validator)
    v.d = SimpleNamespace(device=torch.device("cuda", 0))
    v.metrics = SimpleNamespace(message=messages.append)
    v.peak_bytes = None
    v.encoders_lock = contextlib.nullcontext()
    transients = iter([3 * 10**9, 5 * 10**9, 2 * 10**9])

    def render(label):
        n = next(transients)
        cuda.allocate(n)
        cuda.free(n)
        return ["image"]

    monkeypatch.setattr(v, "_render", render)
    cuda.allocate(10**9)  # the model
    cuda.allocate(4 * 10**9)
    cuda.free(4 * 10**9)  # a step peaking at 5 GB
    assert [v.render() for _ in range(3)] == [["image"]] * 3
    assert v.peak_bytes == 6 * 10**9  # 1 GB kept + the largest transient
    assert messages[0] == ("validation: the render peaked at 4.00 GB of GPU memory on rank 0 "
                           "(torch.cuda.max_memory_allocated while it ran)") and len(messages) == 3
    assert validation.render_peak_gb(v) == 6.0
    assert run_metrics.peak_memory_gb(torch.device("cuda", 0)) == 6.0  # what it would be without the meter
    assert validation.render_peak_gb(None) is None
    v.peak_bytes = None  # renders on a CPU measure nothing
    assert validation.render_peak_gb(v) is None
