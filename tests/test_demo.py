"""The embedded demo (train/demo.py) without its training run: the work directory it reuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from train import demo


def test_demo_rebuilds_a_model_of_another_variant(tiny_edit, tmp_path, capsys):
    """`demo --variant edit_plus` over a v1 demo_out clears model/, data/ and run/ (so make_tiny builds a 2509 model)
    and says so; the same variant keeps them. A model that is not the demo's (random VAE, the tests' transformer,
    a base not pre-trained) is rebuilt too."""
    work = tmp_path / "demo_out"
    demo_info = {"variant": "edit", "vae": "pooling", "transformer": "demo", "pretrained": {"steps": 300}}

    def fill(**changes) -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(tiny_edit / "model", work / "model")
        info = {k: v for k, v in {**demo_info, **changes}.items() if v is not None}
        (work / "model" / "tiny.json").write_text(json.dumps(info))
        for name in ("data", "run"):
            (work / name).mkdir()
            (work / name / "kept.txt").write_text("x")

    fill()
    demo.prepare_workdir(work, "edit")
    assert all((work / name).exists() for name in ("model", "data", "run")) and capsys.readouterr().out == ""
    demo.prepare_workdir(work, "edit_plus")
    assert not any((work / name).exists() for name in ("model", "data", "run"))
    assert f"{work / 'model'} holds a tiny 'edit' model, not 'edit_plus': rebuilding" in capsys.readouterr().out
    for changes, said in [({"vae": "random"}, "a 'random' tiny VAE"),  # a demo_out from before the VAE averaged
                          ({"transformer": None}, "the tests' tiny transformer"),  # from before the demo's width
                          ({"pretrained": None}, "a base that was not pre-trained")]:
        fill(**changes)
        demo.prepare_workdir(work, "edit")
        assert not (work / "model").exists() and f"holds {said}: rebuilding" in capsys.readouterr().out


def test_demo_keeps_its_qwen_image21_model_and_rebuilds_another(tiny_21, tiny_edit, tmp_path, capsys):
    """A demo_out of the 2.1 demo (its random tiny model, with tiny.json) is kept for --variant qwen_image_21 and
    rebuilt for --variant edit; an MMDiT demo's model is rebuilt for --variant qwen_image_21."""
    work = tmp_path / "demo_out"
    shutil.copytree(tiny_21, work / "model")
    (work / "model" / "tiny.json").write_text(json.dumps({"variant": "qwen_image_21", "vae": "random"}))
    demo.prepare_workdir(work, "qwen_image_21")
    assert (work / "model").exists() and capsys.readouterr().out == ""
    demo.prepare_workdir(work, "edit")
    assert not (work / "model").exists() and "holds a tiny 'qwen_image_21' model, not 'edit'" in capsys.readouterr().out
    shutil.copytree(tiny_edit / "model", work / "model")
    (work / "model" / "tiny.json").write_text(json.dumps({"variant": "edit", "vae": "pooling", "transformer": "demo"}))
    demo.prepare_workdir(work, "qwen_image_21")
    assert not (work / "model").exists() and "holds a tiny 'edit' model, not 'qwen_image_21'" in capsys.readouterr().out


@pytest.mark.slow
def test_qwen_image21_demo_runs_end_to_end(tmp_path, monkeypatch, capfd):
    """--variant qwen_image_21 (a few steps): the tiny 2.1 model and the edits built, said to be random, LoRA
    training on 2 processes, the export, and the before/after PNG with its figures."""
    from conftest import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    work = tmp_path / "demo_out"
    demo.main(["--workdir", str(work), "--variant", "qwen_image_21", "--max_steps", "3"])
    out = capfd.readouterr().out
    assert "qwen_image_21: the tiny base stays random" in out and "step 3/3" in out
    assert (work / "run" / "export" / "pytorch_lora_weights.safetensors").is_file()
    assert f"wrote {work / 'before_after.png'}" in out and "  new scenes: reference (unedited)" in out
    assert json.loads((work / "model" / "tiny.json").read_text())["variant"] == "qwen_image_21"


def test_demo_never_deletes_a_model_make_tiny_did_not_write(tiny_edit, tmp_path, capsys):
    """demo_out/model without tiny.json (say, real weights copied there) stops the demo with exit 2 and a line
    naming --workdir; the folder is left as it was."""
    work = tmp_path / "demo_out"
    shutil.copytree(tiny_edit / "model", work / "model")
    (work / "model" / "tiny.json").unlink()
    with pytest.raises(SystemExit) as stop:
        demo.main(["--workdir", str(work), "--variant", "edit_plus"])
    assert stop.value.code == 2 and (work / "model" / "model_index.json").is_file()
    err = capsys.readouterr().err
    assert err.startswith(f"error: {work / 'model'} holds a model that train.make_tiny did not write") and \
        "pass --workdir" in err


def test_pretrained_base_copies_its_reference(tmp_path, capsys):
    """train/trainer/pretrain.py: a short pre-training on identity edits (the demo's base, shortened: 120 steps on
    16 scenes, ~15 s) makes the demo-size tiny transformer copy its reference through the released pipeline: much
    nearer the reference than the random base, and nearer the reference than the edit's target (the base does not
    know the recolouring); the checkpoint stays in the diffusers layout and tiny.json says what it learnt."""
    from diffusers import DiffusionPipeline

    from train.model.qwen_image.tiny import make_tiny
    from train.trainer.pretrain import Pretraining, pretrain

    make_tiny(tmp_path, "edit", num_samples=2, vae="pooling", transformer="demo")
    rows, references, targets = demo.read_rows(tmp_path / "data", 2)

    def distances() -> tuple[float, float]:
        pipe = DiffusionPipeline.from_pretrained(tmp_path / "model", local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        outs = demo.edit_all(pipe, "edit", rows, references, 128 * 128, 64 * 64, steps=10)
        return demo.distance(outs, [r[0] for r in references]), demo.distance(outs, targets)

    random_to_reference, _ = distances()
    losses = pretrain(tmp_path / "model", "edit", 128 * 128, 64 * 64, Pretraining(steps=120, scenes=16))
    to_reference, to_target = distances()
    assert to_reference < 0.5 * random_to_reference, (to_reference, random_to_reference)  # measured 11.2 vs 46.2
    assert to_reference < to_target, (to_reference, to_target)  # 11.2 vs 20.2
    assert losses[-1] < 0.5 * losses[0]
    info = json.loads((tmp_path / "model" / "tiny.json").read_text())
    assert info["pretrained"]["steps"] == 120 and info["pretrained"]["on"].startswith("identity edits")
    out = capsys.readouterr().out  # the phase shows it is moving: a line every 10 s, and its last
    assert "pre-training: 100%|" in out and "120/120 [" in out and "loss=" in out, out[-2000:]


def test_make_tiny_demo_builds_the_demos_base(tmp_path, monkeypatch):
    """`make_tiny --demo` is the demo's base in one flag (pooling VAE, the demo's transformer, pre-trained for
    Pretraining's steps), so that a LoRA trained on one's own data starts from a base that copies its reference;
    for t2i, which has no reference to copy, the same model without pre-training."""
    from train import make_tiny

    built, trained = [], []
    monkeypatch.setattr(make_tiny.tiny, "make_tiny", lambda out, variant, n, size, seed, vae, transformer:
                        built.append((variant, vae, transformer)) or Path(out))
    monkeypatch.setattr(make_tiny, "pretrain", lambda model, variant, area, condition_area, p:
                        trained.append((variant, p.steps)) or [1.0] * 20)
    make_tiny.main(["--out", str(tmp_path), "--demo"])
    make_tiny.main(["--out", str(tmp_path), "--demo", "--variant", "t2i"])
    assert built == [("edit", "pooling", "demo"), ("t2i", "pooling", "demo")]
    assert trained == [("edit", make_tiny.Pretraining().steps)]


def test_pretrain_without_settings_uses_the_demos(tmp_path, monkeypatch):
    """pretrain(..., p=None) trains with Pretraining()'s defaults (the demo's 300 steps on 64 scenes); its refusals
    name the fix. The scenes, encoding and fitting are stubbed: only the defaults' path is under test."""
    from train.model.qwen_image.tiny import make_tiny
    from train.trainer import pretrain as pre

    seen = {}
    monkeypatch.setattr(pre, "identity_rows", lambda d, v, n, side, seed: seen.update(scenes=n, seed=seed) or [])
    monkeypatch.setattr(pre, "encode_identity", lambda *a: None)
    monkeypatch.setattr(pre, "fit", lambda t, data, p, sched: seen.update(steps=p.steps) or [1.0, 0.5])
    with pytest.raises(ValueError, match="no reference to copy"):
        pre.pretrain(tmp_path, "t2i", 128 * 128, 64 * 64)
    with pytest.raises(ValueError, match="at least 10"):
        pre.pretrain(tmp_path, "edit", 128 * 128, 64 * 64, pre.Pretraining(steps=5))
    make_tiny(tmp_path, "edit", num_samples=2)
    assert pre.pretrain(tmp_path / "model", "edit", 128 * 128, 64 * 64) == [1.0, 0.5]
    assert seen == {"scenes": 64, "seed": 1, "steps": 300}
    assert json.loads((tmp_path / "model" / "tiny.json").read_text())["pretrained"]["steps"] == 300


def test_make_tiny_refuses_pretraining_without_a_reference(tmp_path, capsys):
    """`make_tiny --pretrain_steps` on a text-to-image variant (nothing to copy), or below the minimum, is a usage
    error naming the option, before anything is built."""
    from train import make_tiny

    for args in (["--variant", "t2i", "--pretrain_steps", "300"], ["--pretrain_steps", "5"]):
        with pytest.raises(SystemExit):
            make_tiny.main(["--out", str(tmp_path / "out"), *args])
        assert "--pretrain_steps must be 0 or at least 10, and 0 for --variant t2i" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tiny_name", ["tiny_edit", "tiny_t2i", "tiny_21_recolour"])
def test_demo_grid_is_labelled_and_measured(tiny_name, request, tmp_path):
    """render(): reference | target | base model | base + LoRA under a header, a training row and a new scene (drawn
    with a seed nothing was trained on) each under its marked prompt, and for both groups each column's distance to
    the targets, whole image and edited pixels, beside the unedited reference's (a LoRA that changes the model changes
    them); text-to-image (t2i, through QwenImagePipeline): no reference column, no edited-pixel figure; Qwen-Image-2.1
    (QwenImage21Pipeline, RGBA renders shown over white) as the edits."""
    import numpy as np
    import torch
    from PIL import Image

    from train.config import LoraConfig, ModelConfig
    from train.model import family, loading, prepare
    from train.runtime import exports
    from train.trainer.grid import CAPTION

    tiny_edit = request.getfixturevalue(tiny_name)
    edit = tiny_name != "tiny_t2i"
    num_columns = 4 if edit else 3
    work = tmp_path / "demo_out"
    work.mkdir()
    for name in ("model", "data"):
        (work / name).symlink_to(tiny_edit / name)
    (work / "run").mkdir(parents=True)
    (work / "run" / "config.json").write_text(json.dumps({"qwen_edit": {"data": {"area": 128 * 128,
                                                                                  "condition_area": 64 * 64}}}))
    transformer = loading.load_transformer(ModelConfig(path=str(tiny_edit / "model")), torch.float32)
    prepare.add_lora(transformer, LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_out.0"]))
    torch.manual_seed(0)
    for name, p in transformer.named_parameters():
        if ".lora_B." in name:
            p.data.normal_(0, 0.5)  # a LoRA that moves the output (a fresh one is zero)
    exports.export_lora(transformer, work / "run" / "export", 4.0, 4, keys=family.transformer_family(transformer).lora)
    out, found = demo.render(work, num_rows=2, steps=2)
    grid = Image.open(out)
    cell = Image.open(tiny_edit / "data" / "0000_target.png").size[0]
    assert grid.size == (num_columns * cell, 16 + 2 * (CAPTION + cell))
    header = np.asarray(grid.convert("L"))[:16]
    assert all((header[:, j * cell:(j + 1) * cell] < 128).any() for j in range(num_columns)), "a column has no label"
    caption = np.asarray(grid.convert("L"))[16:16 + CAPTION]
    assert (caption < 128).any(), "no prompt above the first row"
    new = [json.loads(line) for line in (work / "new_scenes" / "metadata.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (tiny_edit / "data" / "metadata.jsonl").read_text().splitlines()]
    assert len(new) == 1 and Image.open(work / "new_scenes" / new[0]["image"]).size == (cell, cell)
    assert not any(np.array_equal(np.asarray(Image.open(work / "new_scenes" / new[0]["image"])),
                                  np.asarray(Image.open(tiny_edit / "data" / row["image"]))) for row in trained)
    models = ["base model", "base + exported LoRA"]
    assert list(found) == ["rows trained on", "new scenes"]
    for columns in found.values():
        assert list(columns) == (["reference (unedited)"] if edit else []) + models
        assert all(0 < whole < 255 for whole, _ in columns.values())
        assert columns["base model"] != columns["base + exported LoRA"]
        if edit:  # the unedited reference is off only where the edit changes pixels: more there than on average
            whole, edited = columns["reference (unedited)"]
            assert 0 < whole < edited
        else:
            assert all(edited is None for _, edited in columns.values())
    lines = demo.figures_lines(found)
    assert len(lines) == 3 and lines[2].startswith("  new scenes: ") and "base + exported LoRA" in lines[2]


def test_distance_counts_only_the_edited_pixels_when_asked():
    """distance() is the mean absolute pixel difference (0-255), over the mask's pixels alone when given; the
    edited pixels are those where the target differs from its reference."""
    from PIL import Image

    grey, target = Image.new("RGB", (4, 4), (100, 100, 100)), Image.new("RGB", (4, 4), (100, 100, 100))
    target.paste((160, 100, 40), (0, 0, 2, 2))  # 4 of 16 pixels edited, by 60 / 0 / 60 in R / G / B
    masks = demo.edited_pixels([[grey]], [target])
    assert masks[0].sum() == 4 and masks[0][:2, :2].all()
    assert demo.distance([grey], [target]) == 40 * 4 / 16  # 40 per edited pixel, 4 of 16 pixels
    assert demo.distance([grey], [target], masks) == 40.0 and demo.distance([target], [target], masks) == 0.0
    assert demo.edited_pixels([[]], [target]) is None  # a text-to-image row has no reference


def test_pooling_vae_decodes_what_it_encoded():
    """make_tiny's "pooling" VAE (the demo's): encoding gives the 8x8 block means in latent channels 0-2 (the rest
    zero, posterior variance ~0) and decoding upsamples them back, through the released AutoencoderKLQwenImage."""
    import torch
    import torch.nn.functional as F

    from train.model.qwen_image.tiny import build_vae

    x = torch.rand(2, 3, 1, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = build_vae("pooling")
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        decoded = vae.decode(posterior.mode()).sample
    means = F.avg_pool2d(x[:, :, 0], 8)
    assert (posterior.mode()[:, :3, 0] - means).abs().max() < 2e-3 and posterior.mode()[:, 3:].abs().max() == 0
    assert posterior.std.max() < 1e-4
    assert (decoded[:, :, 0] - F.interpolate(means, scale_factor=8, mode="nearest")).abs().max() < 5e-3


def test_demo_config_is_tiny_cpu_with_the_demo_changes(tmp_path):
    """The demo trains from a latent cache (a CPU step ~7x faster) on 8 rows per micro-batch, otherwise with the
    tests' tiny_cpu.json."""
    from conftest import TINY_CONFIG

    written = json.loads(demo.demo_config(tmp_path).read_text())
    base = json.loads(TINY_CONFIG.read_text())
    assert written["qwen_edit"]["data"] == {**base["qwen_edit"]["data"], **demo.DEMO_CHANGES["data"]}
    assert written["qwen_edit"]["data"]["cache"] == "auto"
    assert written["qwen_edit"]["lora"] == {**base["qwen_edit"]["lora"], "rank": 64, "alpha": 64}
    assert {k: v for k, v in written.items() if k != "qwen_edit"} == {
        **{k: v for k, v in base.items() if k != "qwen_edit"}, "train_micro_batch_size_per_gpu": 8}
    # Qwen-Image-2.1: its family's targets (null), online encoding (its family has no cache yet)
    written = json.loads(demo.demo_config(tmp_path, "qwen_image_21").read_text())
    assert written["qwen_edit"]["data"]["cache"] == "off" and written["qwen_edit"]["lora"]["target_modules"] is None
    assert written["qwen_edit"]["lora"]["rank"] == 64
