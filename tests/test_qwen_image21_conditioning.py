"""train/model/qwen_image21 conditioning against diffusers' QwenImage21Pipeline on the tiny 2.1 checkpoint.

For the same prompts and images, the trainer's functions must build EXACTLY what the pipeline passes to its
transformer at the first step (recorded by hooks on `pipe.transformer`): prompt embeddings, their padding mask, the
image-slot mask, img_shapes, the references' latents (before the target's), the timestep; and the transformer
called with the trainer's inputs must return the pipeline's prediction for the target. The trainer's side uses only
train.model.qwen_image21 functions and the pipeline's frozen networks and processor. float32 on CPU, same calls on
the same batches: the comparisons are torch.equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21 import pipeline_qwenimage21
from PIL import Image

from train.model.qwen_image21 import conditioning as C
from train.model.qwen_image21 import sequence as S
from train.trainer import objective

RECORDED = (
    "hidden_states",
    "timestep",
    "encoder_hidden_states",
    "encoder_hidden_states_mask",
    "img_shapes",
    "img_mask",
)
PROMPTS = ["make the circle blue", "paint the square of picture 1 in the colour of picture 2, a green square"]


def noise_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Random pixels; RGBA gets a random alpha channel, so compositing on white changes the VL copy."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def pipe(tiny_21):
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(pipe, prompts: list[str], images: list[Image.Image] | None, resolution: int) -> dict:
    """The pipeline's first transformer call (keyword inputs, its output under "output") and the scheduler's first
    sigma, for two steps at output_resolution `resolution` (KV cache on, as by default)."""
    calls = []

    def record(module, args, kwargs):
        calls.append({k: kwargs[k] for k in RECORDED})

    def record_output(module, args, kwargs, output):  # returns None: the output stays the pipeline's
        calls[-1].setdefault("output", output[0])

    handles = [
        pipe.transformer.register_forward_pre_hook(record, with_kwargs=True),
        pipe.transformer.register_forward_hook(record_output, with_kwargs=True),
    ]
    try:
        pipe(
            prompt=prompts,
            image=images,
            num_inference_steps=2,
            output_resolution=resolution,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == 2, f"expected two transformer calls (2 steps, no CFG), got {len(calls)}"
    return {**calls[0], "sigma": pipe.scheduler.sigmas[0]}


def trainer_conditioning(pipe, prompts: list[str], rows: list[list[Image.Image]], area: int):
    """The conditioning of a micro-batch built by the trainer's functions only (each row its own images)."""
    prepared = [[C.prepare_image(im, area) for im in images] for images in rows]
    vl_images = [[vl for vl, _ in row] for row in prepared]
    slots = [torch.stack([row[k][1] for row in prepared]) for k in range(len(rows[0]))]
    embeds, mask, image_slots = C.encode_prompts(pipe.text_encoder, pipe.processor, prompts, vl_images)
    tokens, shapes = C.encode_references(pipe.vae, slots, len(prompts))
    return C.Conditioning(embeds, mask, image_slots, tokens, shapes)


def assert_same(name: str, ours, theirs) -> None:
    if ours is None or theirs is None:
        assert ours is None and theirs is None, f"{name}: trainer {ours!r} vs pipeline {theirs!r}"
        return
    assert ours.shape == theirs.shape, f"{name}: shape {tuple(ours.shape)} vs pipeline {tuple(theirs.shape)}"
    assert ours.dtype == theirs.dtype, f"{name}: dtype {ours.dtype} vs pipeline {theirs.dtype}"
    assert torch.equal(ours, theirs), f"{name}: max |diff| {(ours.float() - theirs.float()).abs().max().item():.3g}"


def assert_matches_pipeline(pipe, cond: C.Conditioning, recorded: dict, target_hw) -> torch.Tensor:
    """Every input equal, the trainer's sequence (noisy target = the pipeline's own noise) equal, the prediction of
    the target equal; returns the trainer's transformer inputs."""
    num_references = cond.reference_tokens.shape[1]
    noisy = recorded["hidden_states"][:, num_references:]
    assert noisy.shape[1] == target_hw[0] * target_hw[1]
    assert_same("references' latents", cond.reference_tokens, recorded["hidden_states"][:, :num_references])
    assert torch.allclose(recorded["timestep"], recorded["sigma"].expand(len(noisy)), atol=1e-6), (
        "the pipeline's timestep is not its sigma (scheduler t / 1000)"
    )
    kwargs = S.transformer_inputs(cond, noisy, target_hw, recorded["timestep"])
    assert set(kwargs) == set(RECORDED) | {"return_dict"}
    for key in ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "img_mask"):
        assert_same(key, kwargs[key], recorded[key])
    assert kwargs["img_shapes"] == recorded["img_shapes"]
    S.check_layout(cond, target_hw)
    with torch.no_grad():
        output = pipe.transformer(**kwargs)[0]
    assert_same("target prediction", S.target_prediction(output, target_hw), recorded["output"][:, -noisy.shape[1] :])
    return kwargs


def test_two_references_rgba_batch_of_two_prompts_matches_pipeline(pipe):
    """Two prompts of different lengths (padding, a mask) and two references of different sizes, the first RGBA
    with a random alpha: VL copies on white, 4-channel VAE pixels, slots in order, the target (sized from the last
    reference) after them; encode_prompt gives the same embeds, mask and slots."""
    images = [noise_image(96, 48, seed=1, mode="RGBA"), noise_image(64, 64, seed=2)]
    recorded = run_pipeline(pipe, PROMPTS, images, resolution=96)
    area = 96 * 96
    cond = trainer_conditioning(pipe, PROMPTS, [images, images], area)
    assert cond.prompt_mask is not None and not bool(cond.prompt_mask.all()), "padding not exercised"
    assert cond.reference_shapes == [(1, 4, 8), (1, 6, 6)]
    target_hw = (96 // C.PIXELS_PER_TOKEN, 96 // C.PIXELS_PER_TOKEN)
    assert S.layout_key(images, images[-1], area) == ((4, 8), (6, 6), target_hw)
    assert_matches_pipeline(pipe, cond, recorded, target_hw)

    embeds, mask, slots = pipe.encode_prompt(PROMPTS, image=[C.prepare_image(im, area)[0] for im in images])
    assert_same("encode_prompt embeds", cond.prompt_embeds, embeds)
    assert_same("encode_prompt mask", cond.prompt_mask, mask)
    assert_same("encode_prompt slots", cond.image_slots, slots)


def test_one_reference_one_prompt_has_no_mask_and_matches_pipeline(pipe):
    image = noise_image(64, 96, seed=3)
    recorded = run_pipeline(pipe, PROMPTS[:1], [image], resolution=64)
    cond = trainer_conditioning(pipe, PROMPTS[:1], [[image]], 64 * 64)
    assert cond.prompt_mask is None
    width, height = C.dimensions(image.size, 64 * 64)
    assert_matches_pipeline(pipe, cond, recorded, (height // C.PIXELS_PER_TOKEN, width // C.PIXELS_PER_TOKEN))


def test_text_to_image_batch_matches_pipeline(pipe):
    """Rows without references: the text-to-image template, no slots but the target's, no reference tokens."""
    recorded = run_pipeline(pipe, PROMPTS, None, resolution=64)
    cond = trainer_conditioning(pipe, PROMPTS, [[], []], 64 * 64)
    assert cond.reference_tokens.shape == (2, 0, pipe.vae.config.z_dim) and not bool(cond.image_slots.any())
    assert cond.prompt_mask is not None
    assert_matches_pipeline(pipe, cond, recorded, (4, 4))


def test_rgba_copies(pipe):
    """The VL copy of an RGBA image is composited on white (not its RGB channels), the VAE reads all 4 channels;
    an RGB image becomes opaque RGBA."""
    rgba = noise_image(64, 64, seed=4, mode="RGBA")
    vl, pixels = C.prepare_image(rgba, 64 * 64)
    assert vl.mode == "RGB" and not np.array_equal(np.asarray(vl), np.asarray(rgba.convert("RGB")))
    alpha = torch.from_numpy(np.asarray(rgba)[..., 3] / 127.5 - 1).float()
    assert pixels.shape == (4, 64, 64) and torch.allclose(pixels[3], alpha, atol=1e-6)
    rgb = noise_image(64, 64, seed=5)
    vl, pixels = C.prepare_image(rgb, 64 * 64)
    assert np.array_equal(np.asarray(vl), np.asarray(rgb)) and bool((pixels[3] == 1).all())


def test_prefix_is_clean_and_only_target_tokens_carry_loss(pipe):
    """With the trainer's inputs (noisy target from x0, noise, s), the text and reference positions of the output
    do not depend on s or on the target (modulated at t = 0, block-causal); the target's do. The flow loss on the
    target's prediction sends no gradient to any other position of the output."""
    images = [noise_image(64, 64, seed=6)]
    cond = trainer_conditioning(pipe, PROMPTS[:1], [images], 64 * 64)
    target_hw = (4, 4)
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 1, 16, pipe.vae.config.z_dim, generator=generator)

    def output(sigma: float, noise_BLC: torch.Tensor) -> torch.Tensor:
        s = torch.tensor([sigma])
        kwargs = S.transformer_inputs(cond, objective.noisy_input(x0, noise_BLC, s), target_hw, s)
        return pipe.transformer(**kwargs)[0]

    with torch.no_grad():
        base, later, other = output(0.3, noise), output(0.8, noise), output(0.3, -noise)
    num_target = target_hw[0] * target_hw[1]
    prefix = slice(0, base.shape[1] - num_target)
    assert torch.equal(base[:, prefix], later[:, prefix]) and torch.equal(base[:, prefix], other[:, prefix])
    assert (base[:, -num_target:] - later[:, -num_target:]).abs().max() > 1e-4

    out = output(0.3, noise).detach().requires_grad_(True)
    loss = objective.flow_loss(S.target_prediction(out, target_hw), objective.velocity_target(x0, noise), torch.ones(1))
    loss.backward()
    assert bool((out.grad[:, prefix] == 0).all()) and bool((out.grad[:, -num_target:] != 0).all())


def test_rows_of_one_layout_share_a_micro_batch(pipe):
    """Different images of the same sizes and different prompts: one layout key, the same slot positions batched
    as alone; another reference size is another key and other slot positions."""
    area = 64 * 64
    row_a = [noise_image(64, 64, seed=7), noise_image(96, 48, seed=8, mode="RGBA")]
    row_b = [noise_image(64, 64, seed=9, mode="RGBA"), noise_image(96, 48, seed=10)]
    target = noise_image(64, 64, seed=11)
    assert S.layout_key(row_a, target, area) == S.layout_key([im.size for im in row_b], target.size, area)
    batched = trainer_conditioning(pipe, PROMPTS, [row_a, row_b], area)
    S.check_layout(batched, (4, 4))
    alone = trainer_conditioning(pipe, PROMPTS[1:], [row_b], area)
    assert torch.equal(batched.image_slots[1], alone.image_slots[0])
    row_c = [noise_image(64, 64, seed=12), noise_image(64, 64, seed=13)]
    assert S.layout_key(row_c, target, area) != S.layout_key(row_a, target, area)
    other = trainer_conditioning(pipe, PROMPTS[:1], [row_c], area)
    length = min(other.image_slots.shape[1], alone.image_slots.shape[1])
    assert not torch.equal(other.image_slots[0, :length], alone.image_slots[0, :length])


def test_templates_sizes_and_packing_are_the_pipelines(pipe):
    assert C.T2I_TEMPLATE == pipe.prompt_template_t2i
    assert C.prompt_text("x", 1) == pipe.prompt_template_ti2i.format("x")
    assert C.prompt_text("", 0) == pipe.prompt_template_t2i.format(" ")
    assert C.drop_index(pipe.processor) == pipe._drop_idx and C.image_token_id(pipe.processor) == pipe._img_token_id
    for size in [(1024, 1024), (1920, 1080), (700, 1300), (96, 48)]:
        assert C.dimensions(size) == pipeline_qwenimage21.calculate_dimensions(1024 * 1024, size[0] / size[1])[:2]
    latents = torch.randn(2, 16, 1, 4, 6)
    tokens = C.pack(latents)
    assert torch.equal(tokens, QwenImage21Pipeline._pack_latents(latents, 2, 16, 4, 6))
    assert torch.equal(C.unpack(tokens, 4, 6), QwenImage21Pipeline._unpack_latents(tokens, 64, 96, 16))


def test_slot_mismatch_names_sizes_the_vl_processor_would_resize(pipe):
    """Sizes within the processor's pixel limits make one slot per 32x32 pixels; below its floor it upscales (more
    slots than latents), and the row cannot be built."""
    assert C.slot_mismatch(pipe.processor, (96, 64)) is None
    floor = pipe.processor.image_processor.size["shortest_edge"]
    try:
        pipe.processor.image_processor.size["shortest_edge"] = 128 * 128
        assert C.slot_mismatch(pipe.processor, (64, 64)) == (16, 4)
    finally:
        pipe.processor.image_processor.size["shortest_edge"] = floor


def test_the_family_record_encodes_a_batch_as_these_functions_do(pipe):
    """The family record's encode_batch on collated rows (prompts, VL copies, reference slots, target pixels) gives
    the conditioning the functions above build and the target's latents; its transformer inputs are sequence.py's
    and the prediction has the target's shape; the per-sample parts join back to the batch."""
    import json

    from train.model import family
    from train.model.interface import Encoders

    fam, area = family.family_named("qwen_image21"), 64 * 64
    rows = [[noise_image(64, 64, seed=14), noise_image(96, 48, seed=15, mode="RGBA")],
            [noise_image(64, 64, seed=16, mode="RGBA"), noise_image(96, 48, seed=17)]]
    prepared = [[C.prepare_image(im, area) for im in row] for row in rows]
    target = torch.stack([C.prepare_image(noise_image(64, 64, seed=18 + i), area)[1] for i in range(2)])
    batch = {"prompts": PROMPTS, "vl_images": [[vl for vl, _ in row] for row in prepared], "target": target,
             "reference_pixels": [torch.stack([row[k][1] for row in prepared]) for k in range(2)]}
    b = fam.encode_batch(batch, Encoders(pipe.text_encoder, pipe.processor, pipe.vae), "qwen_image_21")
    expected = trainer_conditioning(pipe, PROMPTS, rows, area)
    for name in ("prompt_embeds", "prompt_mask", "image_slots", "reference_tokens"):
        assert_same(name, getattr(b.cond, name), getattr(expected, name))
    assert b.target_hw == (4, 4) and torch.equal(b.x0, C.pack(C.encode_latents(pipe.vae, target)).float())
    sigmas, noisy = torch.tensor([0.3, 0.7]), torch.randn_like(b.x0)
    kwargs = fam.transformer_inputs(b, noisy, sigmas, torch.float32)
    reference = S.transformer_inputs(expected, noisy, b.target_hw, sigmas, torch.float32)
    assert kwargs.keys() == reference.keys() and kwargs["img_shapes"] == reference["img_shapes"]
    for key in ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "img_mask"):
        assert_same(key, kwargs[key], reference[key])
    with torch.no_grad():
        assert fam.target_prediction(pipe.transformer(**kwargs), b).shape == b.x0.shape
    parts = b.cond.samples()
    assert [m["prompt_tokens"] for m, _ in parts] == b.cond.prompt_mask.sum(dim=1).tolist()
    back = fam.join_conditioning([(json.loads(json.dumps(m)), t) for m, t in parts])  # metadata as JSON keeps it
    for name in ("prompt_embeds", "prompt_mask", "image_slots", "reference_tokens"):
        assert_same(name, getattr(back, name), getattr(b.cond, name))
    assert back.reference_shapes == b.cond.reference_shapes and back.num_text_tokens == b.cond.num_text_tokens
