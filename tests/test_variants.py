"""The model family: variant detection (model_index.json + transformer config), the installed diffusers' support of
the checkpoint's config, and Qwen-Image-Edit-2511 (zero_cond_t) through the trainer's transformer paths.

The 2511 tests compare each training path with diffusers' own forward of the same zero_cond_t transformer (tiny,
fp32, CPU); test_conditioning.py checks its inputs against QwenImageEditPlusPipeline, test_model_parallel.py its
decoder cut, test_rope.py / test_fp8.py the real-pair RoPE and the fp8 base with zero_cond_t as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from conftest import transformer_inputs

from train.config import LoraConfig
from train.model import family, loading, prepare, renders
from train.model.qwen_image import components, pipelines, vae_frames
from train.model.qwen_image.tiny import build_transformer


def model_dir(tmp: Path, pipeline: str, **transformer_config) -> Path:
    """The two files variant detection reads: model_index.json and transformer/config.json."""
    (tmp / "transformer").mkdir(parents=True)
    (tmp / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    config = {"_class_name": "QwenImageTransformer2DModel", "_diffusers_version": "0.36.0", "num_layers": 2,
              **transformer_config}
    (tmp / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp


@pytest.mark.parametrize("pipeline, config, variant", [
    ("QwenImageEditPipeline", {}, "edit"),
    ("QwenImageEditPlusPipeline", {}, "edit_plus"),
    ("QwenImageEditPlusPipeline", {"zero_cond_t": False}, "edit_plus"),
    ("QwenImageEditPlusPipeline", {"zero_cond_t": True}, "edit_plus_2511"),
    ("QwenImagePipeline", {}, "t2i"),
])
def test_variant_from_pipeline_and_transformer_config(tmp_path, pipeline, config, variant):
    """Each variant is detected, and naming it explicitly is accepted."""
    folder = model_dir(tmp_path, pipeline, **config)
    assert components.detect_variant(folder) == variant
    assert components.detect_variant(folder, variant) == variant


def test_explicit_variant_that_contradicts_the_files_names_both(tmp_path):
    folder = model_dir(tmp_path, "QwenImageEditPlusPipeline", zero_cond_t=True)
    with pytest.raises(components.ModelError,
                       match="variant is 'edit_plus' but .* is 'edit_plus_2511'.*zero_cond_t: true"):
        components.detect_variant(folder, "edit_plus")
    with pytest.raises(components.ModelError, match="variant is 't2i' but .* is 'edit_plus_2511'"):
        components.detect_variant(folder, "t2i")


def test_unknown_pipeline_needs_an_explicit_variant_that_fits_the_transformer(tmp_path):
    folder = model_dir(tmp_path, "MyQwenEditPipeline", zero_cond_t=True)
    with pytest.raises(components.ModelError, match="'MyQwenEditPipeline', not one of .*set qwen_edit.model.variant"):
        components.detect_variant(folder)
    assert components.detect_variant(folder, "edit_plus_2511") == "edit_plus_2511"
    with pytest.raises(components.ModelError, match="variant is 'edit_plus' but .* is 'edit_plus_2511'"):
        components.detect_variant(folder, "edit_plus")


def test_zero_cond_t_outside_the_plus_pipeline_is_refused(tmp_path):
    folder = model_dir(tmp_path, "QwenImageEditPipeline", zero_cond_t=True)
    with pytest.raises(components.ModelError, match="zero_cond_t, which only Qwen-Image-Edit-2511"):
        components.detect_variant(folder)


def test_config_key_the_installed_diffusers_would_drop_is_an_error(tmp_path):
    """A key QwenImageTransformer2DModel.__init__ does not take (what an older diffusers does to zero_cond_t) stops
    with the key, the installed version and the version that wrote the config; a released key no diffusers uses
    (pooled_projection_dim) passes."""
    folder = model_dir(tmp_path, "QwenImageEditPlusPipeline", zero_cond_t=True, pooled_projection_dim=768,
                       future_modulation=True, _diffusers_version="0.99.0")
    with pytest.raises(components.ModelError) as e:
        components.detect_variant(folder)
    message = str(e.value)
    assert "future_modulation=true" in message and "pooled_projection_dim" not in message
    assert f"installed diffusers {diffusers.__version__}" in message and "diffusers>=0.99.0" in message
    config = json.loads((folder / "transformer" / "config.json").read_text())
    del config["future_modulation"]
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    assert components.detect_variant(folder) == "edit_plus_2511"


def test_trainer_stops_on_an_unsupported_config_key(tiny_2511, tmp_path, capsys):
    """train/main.py: the same check before any process group or model, exit status 2 and the message."""
    import shutil

    from train import main as trainer

    model = tmp_path / "model"
    shutil.copytree(tiny_2511 / "model", model)  # with its weights: a directory without them stops earlier
    config = json.loads((model / "transformer" / "config.json").read_text())
    (model / "transformer" / "config.json").write_text(json.dumps({**config, "future_modulation": True}))
    code = trainer.main(["--ds_config", "ds_configs/tiny_cpu.json", "--model", str(model), "--data",
                         str(tiny_2511 / "data"), "--output_dir", str(tmp_path / "out")])
    assert code == 2
    assert "future_modulation=true" in capsys.readouterr().err


# --- Qwen-Image-Edit-2511 through the training paths ---------------------------------------------------------------


def _lora_transformer(zero_cond_t: bool, **options):
    """The tiny transformer (fixed seed) with LoRA on the attention and MLP projections, B initialised non-zero so
    gradients reach every factor, prepared by prepare.prepare_for_training with `options`."""
    torch.manual_seed(0)
    model = build_transformer(zero_cond_t)
    lora = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_v", "img_mlp.net.2", "txt_mlp.net.2"])
    settings = dict(gradient_checkpointing=False, compile_blocks=False, real_rope=False) | options
    prepare.prepare_for_training(model, "lora", lora, **settings)
    for i, (name, p) in enumerate(model.named_parameters()):
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(i))
    return model.train()


def _loss_and_lora_grads(model) -> tuple[float, torch.Tensor, float]:
    """(loss, LoRA gradients, scale): loss = mean(out * w) for a fixed random w, which weighs every output alike;
    scale = mean(|out * w|), what its rounding errors are relative to (the loss itself may be near 0)."""
    g = torch.Generator().manual_seed(3)
    inputs = transformer_inputs(model, h=4, w=6, text_tokens=5, generator=g)
    out = model(**inputs)[0]
    weighted = out * torch.randn(out.shape, generator=g)
    loss = weighted.mean()
    loss.backward()
    # (the last block's text-stream MLP feeds nothing the output sees: no gradient, counted as zero)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters() if "lora_" in n]
    return loss.item(), torch.cat([g.flatten() for g in grads]), weighted.abs().mean().item()


def test_2511_transformer_differs_from_2509_with_the_same_weights():
    """What the tests below compare is the zero_cond_t model: the same weights without it predict otherwise."""
    outputs = []
    for zero_cond_t in (True, False):
        model = _lora_transformer(zero_cond_t)
        with torch.no_grad():
            outputs.append(model(**transformer_inputs(model, h=4, w=6, text_tokens=5,
                                                      generator=torch.Generator().manual_seed(3)))[0])
    assert (outputs[0] - outputs[1]).abs().max().item() > 5e-3 * outputs[1].abs().max().item()  # 2% measured


@pytest.mark.parametrize("options, tol", [
    ({"real_rope": True}, 1e-5),
    ({"gradient_checkpointing": True}, 1e-6),
    ({"gradient_checkpointing": True, "checkpoint_blocks": 1}, 1e-6),
    ({"compile_blocks": True, "real_rope": True}, 1e-4),  # inductor fuses kernels, which round differently
], ids=["real_rope", "checkpointing", "checkpoint_blocks", "compile"])
def test_2511_training_paths_equal_diffusers_forward(options, tol):
    """Loss and LoRA gradients of the zero_cond_t transformer with each speed option equal those of diffusers' plain
    forward of the same model (the fp8 base, which changes the model itself, is compared within e4m3's rounding by
    test_fp8.py::test_lora_learns_through_fp8_base[True])."""
    ref_loss, ref_grads, scale = _loss_and_lora_grads(_lora_transformer(True))
    loss, grads, _ = _loss_and_lora_grads(_lora_transformer(True, **options))
    assert abs(loss - ref_loss) <= tol * scale
    assert (grads - ref_grads).abs().max().item() <= tol * ref_grads.abs().max().item()


@pytest.mark.parametrize("tiny_name, variant, num_refs", [("tiny_2511", "edit_plus_2511", 2), ("tiny_t2i", "t2i", 0)])
def test_cache_trains_like_online_encoding(tiny_name, variant, num_refs, request, tmp_path):
    """data.cache with 2511 and with Qwen-Image (no references: an empty reference sequence is cached): the cached
    micro-batch equals the online one, and so does the flow-matching loss of the transformer on it
    (loop.forward_loss, the same noise; 2511: the zero_cond_t transformer)."""
    from test_cache import WORLD_OF_ONE, copy_tiny, data_of, load_cfg

    from train.data import cache_reader, latent_cache, pairs, sources
    from train.trainer import loop

    cfg = load_cfg(copy_tiny(request.getfixturevalue(tiny_name), tmp_path, num_rows=3), tmp_path)
    assert data_of(cfg)[0] == variant
    _, rows, dataset = data_of(cfg)
    index = latent_cache.ensure(cfg, WORLD_OF_ONE, variant, rows, dataset, rebuild_stale=True)
    assert index["variant"] == variant
    encoders = components.load_encoders(cfg.project.model.path, torch.float32, torch.device("cpu"))
    transformer = loading.load_transformer(cfg.project.model, torch.float32)
    assert transformer.config.zero_cond_t == (variant == "edit_plus_2511")
    scheduler = loading.scheduler_config(cfg.project.model.path)
    cached = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    online = sources.encode_batch(pairs.collate([dataset[0]]), encoders, variant)
    got = cache_reader.to_batch(cache_reader.collate([cached[0]]), torch.device("cpu"))
    assert len(got.cond.reference_shapes) == num_refs
    assert got.cond.reference_tokens.shape[1] == sum(h * w for _, h, w in got.cond.reference_shapes)
    losses = [loop.forward_loss(transformer, b, cfg.project.train, torch.Generator().manual_seed(5), scheduler,
                                torch.float32, family.family_named("qwen_image")) for b in (online, got)]
    assert torch.equal(losses[0], losses[1])


def _plain_pipeline_images(model: Path, edits: list[dict], inf) -> list[np.ndarray]:
    """diffusers' QwenImageEditPlusPipeline straight from the directory, called as the pipeline's docs show."""
    from PIL import Image

    from train.model.qwen_image import conditioning

    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # the VAE's 2D path, as ours runs by default (model.vae_2d_frames): the images are then bit-equal; that path
    # equals diffusers' own within 1e-5 (tests/test_vae_frames.py), which can move a pixel by one level
    vae_frames.apply(pipe.vae)
    assert pipe.transformer.config.zero_cond_t
    images = []
    for edit in edits:
        with conditioning.pipeline_areas(inf.area, inf.condition_area):
            out = pipe(image=[Image.open(p).convert("RGB") for p in edit["edit_image"]], prompt=edit["prompt"],
                       negative_prompt=inf.negative_prompt, true_cfg_scale=inf.true_cfg_scale,
                       num_inference_steps=inf.num_inference_steps,
                       generator=torch.Generator("cpu").manual_seed(edit["seed"])).images[0]
        images.append(np.asarray(out))
    return images


def _edits(tiny: Path, folder: Path) -> tuple[Path, list[dict]]:
    data = tiny / "data"
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()[:2]]
    edits = [{"edit_image": [str(data / r) for r in row["edit_image"]], "prompt": row["prompt"], "seed": 11 + i}
             for i, row in enumerate(rows)]
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in edits))
    return path, edits


def test_2511_validation_and_infer_render_what_the_pipeline_renders(tiny_2511, tmp_path):
    """Validation (the pipeline built around the run's own transformer and encoders) and train.infer's pipeline
    (pipelines.load_pipeline + pipelines.edit, what every row runs) render the images diffusers'
    QwenImageEditPlusPipeline renders from the 2511 directory, with guidance (negative prompt) on."""
    from test_validation import TINY_INFERENCE

    from train import config
    from train.config import Config, ProjectConfig
    from train.runtime.engine import Dist
    from train.runtime.record import NullMetrics
    from train.trainer import validation

    edits_file, edits = _edits(tiny_2511, tmp_path)
    cfg = Config(ProjectConfig(), deepspeed={})
    p = cfg.project
    p.model.path, p.output.dir, p.validation.file = str(tiny_2511 / "model"), str(tmp_path / "out"), str(edits_file)
    p.inference = config.InferenceConfig(**{**TINY_INFERENCE, "true_cfg_scale": 2.0})
    expected = _plain_pipeline_images(tiny_2511 / "model", edits, p.inference)
    assert not np.array_equal(expected[0], expected[1])

    d = Dist(0, 1, 0, torch.device("cpu"))
    transformer = loading.load_transformer(p.model, torch.float32)
    encoders = components.load_encoders(p.model.path, torch.float32, d.device)
    rendered = validation.Validator(cfg, d, transformer, encoders, NullMetrics()).render()
    pipe = pipelines.load_pipeline(p.model.path, torch.float32)
    assert isinstance(pipe, diffusers.QwenImageEditPlusPipeline) and pipe.transformer.config.zero_cond_t
    requests, problems = renders.read_requests(edits_file)
    assert not problems
    inferred = [pipelines.edit(pipe, "edit_plus_2511", renders.open_references(r), r.prompt, r.seed, p.inference)
                for r in requests]
    for want, got_validation, got_infer in zip(expected, rendered, inferred, strict=True):
        assert np.array_equal(np.asarray(got_validation), want)
        assert np.array_equal(np.asarray(got_infer), want)


@pytest.mark.parametrize("tiny_name", ["tiny_t2i", "tiny_edit"])
def test_infer_without_references_renders_qwen_image_pipeline(tiny_name, request):
    """train.infer's path for a row without edit_image (pipelines.edit with no images): QwenImagePipeline, the model's
    own (Qwen-Image) or around an edit model's modules, square at pipelines.area; the same image as calling that
    pipeline directly."""
    from test_validation import TINY_INFERENCE

    from train import config

    tiny = request.getfixturevalue(tiny_name)
    inf = config.InferenceConfig(**{**TINY_INFERENCE, "true_cfg_scale": 2.0})
    pipe = pipelines.load_pipeline(tiny / "model", torch.float32)
    variant = components.detect_variant(tiny / "model")
    got = pipelines.edit(pipe, variant, [], "a red circle on grey", 5, inf)
    assert got.size == (128, 128)
    loaded = diffusers.DiffusionPipeline.from_pretrained(tiny / "model", dtype=torch.float32)
    vae_frames.apply(loaded.vae)  # as ours (see _plain_pipeline_images)
    direct = loaded if tiny_name == "tiny_t2i" else diffusers.QwenImagePipeline(
        **{k: v for k, v in loaded.components.items() if k != "processor"})
    direct.set_progress_bar_config(disable=True)
    want = direct(prompt="a red circle on grey", negative_prompt=inf.negative_prompt, true_cfg_scale=2.0, height=128,
                  width=128, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert renders.check_request(renders.EditRequest(0, 1, [Path("a.png")], "p", 0, "x"), "t2i").startswith(
        "has edit_image but the t2i variant")
