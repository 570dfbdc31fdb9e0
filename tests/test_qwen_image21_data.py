"""Qwen-Image-2.1's rows through the trainer's data path on the tiny 2.1 checkpoint and dataset (in-process, CPU
fp32): train.make_tiny's rows, the pre-flight's refusals of bad 2.1 rows, the sampler's buckets as the family's slot
layouts, RGBA kept, the cache equal to online encoding, and a training step's loss equal to the loss of the
pipeline's own transformer call."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from train.config import TrainConfig
from train.data import cache_reader, latent_cache, pairs, sources
from train.data.rows import BadRowsError, read_rows
from train.model import family, loading
from train.model.interface import Encoders
from train.model.qwen_image21 import sequence
from train.model.qwen_image21.variant import VARIANT
from train.runtime import engine
from train.trainer import loop, objective

AREA = 128 * 128  # ds_configs/tiny_cpu.json's data.area: the tiny dataset's 128 px images keep their size
WORLD_OF_ONE = engine.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FAM = family.family_named("qwen_image21")


def preflight(data: Path, model: Path, area: int = AREA, **kwargs) -> list[pairs.Row]:
    return pairs.preflight(
        data, VARIANT, "stop", area=area, condition_area=64 * 64, tokens=FAM.prompt_tokenizer(model), **kwargs
    )


def copy_data(tiny: Path, to: Path, extra_rows: list[dict] = ()) -> Path:
    """The tiny dataset copied to `to`/data with `extra_rows` appended."""
    shutil.copytree(tiny / "data", to / "data")
    with open(to / "data" / "metadata.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in extra_rows)
    return to / "data"


def test_make_tiny_writes_rows_of_every_kind(tiny_21_edits):
    """Rows without a reference, with one and with two; RGBA files whose alpha is 0 around the shape and 255 on it;
    every row passes the pre-flight."""
    data = tiny_21_edits / "data"
    rows, problems = read_rows(data)
    assert not problems and Counter(len(r.references) for r in rows) == {0: 4, 1: 8, 2: 4}
    rgba = [p for p in sorted(data.glob("*.png")) if Image.open(p).mode == "RGBA"]
    assert len(rgba) == 16  # the two-reference rows' scenes and the RGBA one-reference rows, targets included
    assert all(Image.open(p).getchannel("A").getextrema() == (0, 255) for p in rgba)
    assert len(preflight(data, tiny_21_edits / "model")) == len(rows)


def test_the_preflight_names_bad_2_1_rows(tiny_21_edits, tmp_path):
    """More than 10 references, an RGBA file whose alpha is 0 everywhere, and (at an area whose references the VL
    processor resizes) references whose image slots would not match their latents: each named with its row, its
    file and the fix, before training."""
    transparent = Image.open(tiny_21_edits / "data" / "0002_ref.png").copy()
    transparent.putalpha(0)
    data = copy_data(
        tiny_21_edits,
        tmp_path,
        [
            {"image": "0001_target.png", "edit_image": ["0001_ref.png"] * 11, "prompt": "eleven"},
            {"image": "0002_target.png", "edit_image": "transparent.png", "prompt": "nothing shows"},
        ],
    )
    transparent.save(data / "transparent.png")
    with pytest.raises(BadRowsError) as e:
        preflight(data, tiny_21_edits / "model")
    report = str(e.value).splitlines()
    assert (
        "row 17 (0001_target.png): 11 edit images but the qwen_image_21 variant takes at most 10; keep at most 10 "
        "in 'edit_image' or remove the row" in report
    )
    assert (
        "row 18 (transparent.png): its alpha channel is 0 everywhere (fully transparent: nothing of it shows); "
        "re-export it with its alpha channel, or without one (opaque) or remove the row"
    ) in report
    assert len([line for line in report if line.startswith("row ")]) == 2, report

    # at 2 MP a 128 px reference is sized 1440 x 1440, past the tiny processor's longest_edge of 1024 x 1024 px
    shutil.rmtree(data)
    data = copy_data(tiny_21_edits, tmp_path)
    with pytest.raises(BadRowsError) as e:
        preflight(data, tiny_21_edits / "model", area=2 * 1024 * 1024)
    named = [line for line in str(e.value).splitlines() if line.startswith("row ")]
    assert len(named) == 16, named  # every reference of the 12 rows with references: 8 + 2 x 4
    assert named[0] == (
        "row 2 (0001_ref.png): 128x128 px is resized to 1440x1440, which the VL processor (pixel "
        "limits 1024-1048576) turns into 1024 image slots where the latents need 2025; change "
        "data.area so that references land within those limits, or resize the image"
    )


def test_the_sampler_buckets_by_the_slot_layout(tiny_21_edits, tmp_path):
    """The dataset's bucket key of each row is the family's layout key (sequence.layout_key, the target moved first);
    a layout with fewer rows than the micro-batch is named with the fix when bucket_fill is off."""
    data = copy_data(tiny_21_edits, tmp_path, [{"image": "wide.png", "edit_image": "0001_ref.png", "prompt": "wide"}])
    Image.new("RGB", (256, 128), "white").save(data / "wide.png")
    rows = preflight(data, tiny_21_edits / "model")
    dataset = pairs.EditDataset(data, rows, VARIANT, AREA, 64 * 64)
    keys = dataset.bucket_keys()
    for row, key in zip(rows, keys, strict=True):
        sizes = [Image.open(data / name).size for name in (row.target, *row.references)]
        layout = sequence.layout_key(sizes[1:], sizes[0], AREA)
        assert key == (layout[-1], *layout[:-1])
    assert len(set(keys)) == 4  # no reference, one, two (the swatch is sized as the scene), and the wide target
    loader = pairs.build_loader(dataset, 2, 0, 1, 0, 0, False, True, bucket_fill=False)
    summary = pairs.sampling_summary(loader.batch_sampler, rows)
    assert (
        "sampling: 1 row(s) are never drawn: their shape bucket has fewer rows than a micro-batch of 2: row 17 "
        "(wide.png). To train them, set qwen_edit.data.bucket_fill = true"
    ) in summary


def test_the_dataset_keeps_alpha(tiny_21_edits):
    """An RGBA row reaches the VAE with its alpha (the file's, scaled to [-1, 1]) and the VL model composited on
    white; an RGB row is opaque."""
    data = tiny_21_edits / "data"
    rows = preflight(data, tiny_21_edits / "model")
    dataset = pairs.EditDataset(data, rows, VARIANT, AREA, 64 * 64)
    rgba = dataset[3]  # row 4: one RGBA reference
    alpha = np.asarray(Image.open(data / rows[3].references[0]).getchannel("A"), dtype=np.float32)
    pixels = rgba["reference_pixels"][0]
    assert pixels.shape == (4, 128, 128) and torch.allclose(pixels[3], torch.from_numpy(alpha / 127.5 - 1))
    vl = np.asarray(rgba["vl_images"][0])
    assert vl.shape == (128, 128, 3) and (vl[alpha == 0] == 255).all()
    assert rgba["target"].shape == (4, 128, 128) and rgba["target"][3].min() == -1
    assert bool((dataset[1]["reference_pixels"][0][3] == 1).all())


@pytest.fixture(scope="module")
def pipe(tiny_21):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_call(pipe, prompt: str, references: list[Image.Image]) -> dict:
    """The keyword arguments of the pipeline's first transformer call (one step, no KV cache)."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        pipe(
            prompt=prompt,
            image=references,
            num_inference_steps=1,
            output_resolution=128,
            output_type="latent",
            use_kv_cache=False,
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        handle.remove()
    return calls[0]


def test_a_training_step_s_loss_is_the_loss_of_the_pipelines_transformer_call(tiny_21_edits, pipe):
    """The two-reference RGBA row: the loop's forward_loss equals the flow loss computed from the pipeline's own
    transformer call (its prompt embeddings, masks, img_shapes and reference latents, from the same files) with
    the training step's noisy target and noise level, the clean target encoded by the pipeline's VAE code."""
    data = tiny_21_edits / "data"
    rows = preflight(data, tiny_21_edits / "model")
    row = rows[2]
    assert len(row.references) == 2 and Image.open(data / row.references[0]).mode == "RGBA"
    dataset = pairs.EditDataset(data, [row], VARIANT, AREA, 64 * 64)
    b = FAM.encode_batch(pairs.collate([dataset[0]]), Encoders(pipe.text_encoder, pipe.processor, pipe.vae), VARIANT)
    t, schedule = TrainConfig(seed=0), loading.scheduler_config(tiny_21_edits / "model")
    with torch.no_grad():
        loss = loop.forward_loss(pipe.transformer, b, t, torch.Generator().manual_seed(7), schedule, torch.float32, FAM)
    _, noise, sigmas = loop.noisy_inputs(b, t, torch.Generator().manual_seed(7), schedule, torch.float32, FAM)

    kwargs = pipeline_call(pipe, row.prompt, [Image.open(data / name) for name in row.references])
    target = pipe.image_processor.preprocess(Image.open(data / row.target), 128, 128).unsqueeze(2)
    x0 = pipe._pack_latents(pipe._encode_vae_image(target, None), 1, 16, 8, 8)
    assert torch.equal(b.x0, x0)
    num_refs = kwargs["hidden_states"].shape[1] - x0.shape[1]
    kwargs.update(
        hidden_states=torch.cat([kwargs["hidden_states"][:, :num_refs], objective.noisy_input(x0, noise, sigmas)], 1),
        timestep=sigmas,
    )
    with torch.no_grad():
        prediction = pipe.transformer(**kwargs)[0][:, -x0.shape[1] :]
    assert torch.equal(loss, ((prediction - (noise - x0)) ** 2).mean())


def test_cached_samples_equal_online_encoding(tiny_21_edits, tmp_path):
    """The cache (prompt embeddings with their image-slot mask, reference and target latents) gives every sample
    exactly as the online encoders do, and a micro-batch of two prompts of different lengths padded alike."""
    from conftest import write_config

    from train import config

    cfg_path = write_config(
        tmp_path / "cfg.json", **{"qwen_edit.data.num_workers": 0, "qwen_edit.lora.target_modules": None}
    )
    longer = {"image": "0001_target.png", "edit_image": "0001_ref.png", "prompt": "make it green, keep the rest"}
    data = copy_data(tiny_21_edits, tmp_path, [longer])
    args = config.parse_args(
        [
            "--ds_config",
            str(cfg_path),
            "--model",
            str(tiny_21_edits / "model"),
            "--data",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    cfg = config.load_config(args, 1, has_gpu=False)
    rows = preflight(data, tiny_21_edits / "model")
    rows = rows[:4] + rows[-1:]  # a t2i row, 1 reference, 2, RGBA; the longer prompt
    dataset = pairs.EditDataset(data, rows, VARIANT, AREA, 64 * 64)
    index = latent_cache.ensure(cfg, WORLD_OF_ONE, VARIANT, rows, dataset, rebuild_stale=True)
    cached = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    assert cached.bucket_keys() == dataset.bucket_keys()
    encoders = FAM.load_encoders(tiny_21_edits / "model", torch.float32, torch.device("cpu"))
    for group in ([0], [1], [2], [3], [1, 4]):  # the last: two prompts of one layout, the second longer
        online = sources.encode_batch(pairs.collate([dataset[i] for i in group]), encoders, VARIANT)
        got = cache_reader.to_batch(cache_reader.collate([cached[i] for i in group]), torch.device("cpu"))
        assert got.target_hw == online.target_hw and got.cond.reference_shapes == online.cond.reference_shapes
        for name in ("prompt_embeds", "prompt_mask", "image_slots", "reference_tokens"):
            a, b = getattr(got.cond, name), getattr(online.cond, name)
            assert (a is None and b is None) or torch.allclose(a, b, atol=5e-5), name  # batch of 2 rounds apart
        assert torch.equal(got.x0, online.x0)
    assert got.cond.prompt_mask is not None and got.cond.image_slots.dtype == torch.bool


def test_streamed_qwen3_vl_encodes_the_same(tiny_21_edits):
    """Qwen3-VL streamed from host memory block by block (loading.stream_from_host, as the cache build uses it where
    the encoder does not fit the budget) gives exactly the resident encoder's embeddings and image slots."""
    data, model = tiny_21_edits / "data", tiny_21_edits / "model"
    rows = preflight(data, model)[:3]
    dataset = pairs.EditDataset(data, rows, VARIANT, AREA, 64 * 64)
    cpu = torch.device("cpu")
    resident = FAM.load_encoders(model, torch.float32, cpu)
    streamed = FAM.load_encoders(model, torch.float32, cpu, stream_text_encoder=True)
    vision, text = streamed.text_encoder.stream_offloaders
    assert len(text.blocks) == len(streamed.text_encoder.model.language_model.layers)
    for i in (0, 2):  # no reference, two
        raw = pairs.collate([dataset[i]])
        a, b = (sources.encode_batch(raw, e, VARIANT).cond for e in (resident, streamed))
        assert torch.equal(a.prompt_embeds, b.prompt_embeds) and torch.equal(a.image_slots, b.image_slots)
    assert vision.fetches == len(vision.blocks) and text.fetches == 2 * len(text.blocks)


def test_text_positions_and_the_rotary_room(tiny_21_edits, pipe):
    """text_positions counts the prompt embeddings that are not image slots, as encode_prompts makes them; a prompt
    longer than the frame positions QwenImage21Rope has left next to its references is named with both numbers."""
    from train.model.qwen_image21 import conditioning, samples

    prompt, image = "paint the circle of picture 1 in the colour of picture 2", Image.new("RGB", (128, 128))
    embeds, _, slots = conditioning.encode_prompts(pipe.text_encoder, pipe.processor, [prompt], [[image, image]])
    assert samples.text_positions(pipe.processor, prompt, 2) == embeds.shape[1] - int(slots.sum())
    sizes = [(128, 128), (128, 128), (256, 128)]  # the target; references of 8 x 8 and 6 x 12 latents: 8 + 12 positions
    assert samples.prompt_overflow(pipe.processor, prompt, VARIANT, sizes, AREA, 0) is None
    long = " ".join(["colour"] * 8200)
    length, room = samples.prompt_overflow(pipe.processor, long, VARIANT, sizes, AREA, 0)
    assert room == samples.ROPE_POSITIONS - 1 - (8 + 12) and length == samples.text_positions(pipe.processor, long, 2)
