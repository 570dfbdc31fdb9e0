"""train/model/qwen_image/conditioning.py against diffusers' edit pipelines, on the tiny random checkpoints of
train/make_tiny.

For the same images and prompts, the trainer's prompt embeds, prompt mask, packed reference latents and img_shapes
must EQUAL what QwenImageEditPipeline (v1) and QwenImageEditPlusPipeline (2509) pass to their transformer. The
pipeline side is recorded by a forward pre-hook on `pipe.transformer` at the first step of a real pipeline call; the
trainer side is rebuilt only from qwen_image.conditioning functions (sharing the pipeline's frozen networks and
processor, never its prompt/latent helpers). Everything runs in float32 on CPU and both sides make the same calls on
the same batches, so the comparisons are exact (torch.equal), not approximate.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from PIL import Image

from train.model.qwen_image import batches
from train.model.qwen_image import conditioning as C
from train.model.qwen_image.tiny import make_tiny

AREA = 128 * 128  # target / VAE area the pipelines are shrunk to (instead of 1024^2)
CONDITION_AREA = 96 * 96  # 2509's VL copies (instead of 384^2); 96^2 keeps a 96x64 image non-square (128x64)
RECORDED = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "img_shapes", "timestep")


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def load_pipeline(root):
    pipe = DiffusionPipeline.from_pretrained(root / "model")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory):
    # size 128: the dataset images are already at AREA (see test_edit_v1_batch_with_padding_matches_pipeline)
    return make_tiny(tmp_path_factory.mktemp("tiny_edit"), variant="edit", num_samples=4, size=128)


@pytest.fixture(scope="module")
def tiny_edit_plus(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_edit_plus"), variant="edit_plus", num_samples=4, size=64)


@pytest.fixture(scope="module")
def tiny_edit_plus_2511(tmp_path_factory):
    """The 2509 checkpoint above (same seed: same weights) with zero_cond_t, as Qwen-Image-Edit-2511."""
    return make_tiny(tmp_path_factory.mktemp("tiny_2511"), variant="edit_plus_2511", num_samples=4, size=64)


@pytest.fixture(scope="module")
def edit_pipe(tiny_edit):
    return load_pipeline(tiny_edit)


@pytest.fixture(scope="module")
def edit_plus_pipe(tiny_edit_plus):
    return load_pipeline(tiny_edit_plus)


def run_pipeline(pipe, images, prompt) -> dict:
    """The real pipeline at the small areas; returns the keyword inputs of its first transformer call (and its
    output, under "output").

    Two steps, not one: with a single step the scheduler's shift_terminal stretch divides 0 by 0 (NaN timestep).
    """
    calls = []

    def record(module, args, kwargs):
        calls.append({k: kwargs.get(k) for k in RECORDED})

    def record_output(module, args, kwargs, output):
        calls[-1].setdefault("output", output[0])

    handles = [pipe.transformer.register_forward_pre_hook(record, with_kwargs=True),
               pipe.transformer.register_forward_hook(record_output, with_kwargs=True)]
    try:
        with C.pipeline_areas(AREA, CONDITION_AREA):
            pipe(image=images, prompt=prompt, true_cfg_scale=1.0, num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == 2, f"expected two transformer calls (2 steps, no CFG), got {len(calls)}"
    assert torch.isfinite(calls[0]["timestep"]).all(), calls[0]["timestep"]
    return calls[0]


def target_latent_hw(size_image: Image.Image) -> tuple[int, int]:
    """Latent (h, w) of the generated target: the pipelines size it from a reference (v1 the first, 2509 the last)."""
    width, height = C.dimensions(AREA, size_image)
    return height // C.PIXELS_PER_LATENT, width // C.PIXELS_PER_LATENT


def trainer_inputs(pipe, samples: list[list[Image.Image]], prompts: list[str], variant: str, target_hw) -> dict:
    """The same transformer inputs built by the trainer's functions only (per-sample references, batched)."""
    per_sample = [C.reference_inputs(images, variant, area=AREA, condition_area=CONDITION_AREA) for images in samples]
    vl_images = [vl for vl, _ in per_sample]
    slots = [torch.stack([pixels[i] for _, pixels in per_sample]) for i in range(len(samples[0]))]
    processor = getattr(pipe, "processor", pipe.tokenizer)  # text-to-image pipelines have a tokenizer only
    embeds, mask = C.encode_prompts(pipe.text_encoder, processor, prompts, vl_images, variant)
    tokens, shapes = C.encode_references(pipe.vae, slots, len(prompts))
    return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask, "reference_tokens": tokens,
            "img_shapes": C.img_shapes(target_hw, shapes, len(prompts))}


def assert_same(name: str, ours, theirs) -> None:
    if ours is None or theirs is None:
        assert ours is None and theirs is None, f"{name}: trainer {ours!r} vs pipeline {theirs!r}"
        return
    assert ours.shape == theirs.shape, f"{name}: shape {tuple(ours.shape)} vs pipeline {tuple(theirs.shape)}"
    assert ours.dtype == theirs.dtype, f"{name}: dtype {ours.dtype} vs pipeline {theirs.dtype}"
    diff = (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
    assert torch.equal(ours, theirs), f"{name}: not bit-equal to the pipeline's (max abs diff {diff:.3g})"


def assert_matches_pipeline(ours: dict, recorded: dict, target_hw) -> None:
    """Prompt embeds, mask, img_shapes and the reference tail of hidden_states all equal the pipeline's."""
    assert ours["img_shapes"] == recorded["img_shapes"], (
        f"img_shapes {ours['img_shapes']} vs pipeline {recorded['img_shapes']}")
    assert_same("encoder_hidden_states", ours["encoder_hidden_states"], recorded["encoder_hidden_states"])
    assert_same("encoder_hidden_states_mask", ours["encoder_hidden_states_mask"],
                recorded["encoder_hidden_states_mask"])
    hidden = recorded["hidden_states"]  # cat([noisy target tokens, reference tokens], dim=1)
    num_target = (target_hw[0] // 2) * (target_hw[1] // 2)
    refs = ours["reference_tokens"]
    assert hidden.shape[1] == num_target + refs.shape[1], (
        f"pipeline sequence {hidden.shape[1]} != {num_target} target + {refs.shape[1]} reference tokens")
    assert_same("reference tokens", refs, hidden[:, num_target:])
    assert recorded["timestep"].shape == (hidden.shape[0],)


def test_edit_v1_single_reference_matches_pipeline(edit_pipe):
    """v1, one non-square reference (96x64): embeds, mask (None), reference tokens and img_shapes are equal."""
    assert isinstance(edit_pipe, QwenImageEditPipeline)
    image, prompt = noise_image(96, 64, seed=0), "make the circle red"
    recorded = run_pipeline(edit_pipe, image, prompt)
    hw = target_latent_hw(image)
    ours = trainer_inputs(edit_pipe, [[image]], [prompt], "edit", hw)
    assert ours["encoder_hidden_states_mask"] is None
    assert_matches_pipeline(ours, recorded, hw)


def test_edit_v1_batch_with_padding_matches_pipeline(edit_pipe, tiny_edit):
    """v1, batch of 2 dataset references with prompts of different lengths: the padded embeds and the 0/1 mask
    equal the pipeline's (whole-batch call and its encode_prompt), as do the batched reference tokens.

    The references are already AREA-sized: given a LIST of PIL images, v1's __call__ hands them to the VL model
    un-resized (VaeImageProcessor.resize passes lists through; only the VAE copies are resized), unlike its
    single-image path, which the trainer follows per sample. At AREA size both readings coincide.
    """
    rows = [json.loads(line) for line in (tiny_edit / "data" / "metadata.jsonl").read_text().splitlines()[:2]]
    images = [Image.open(tiny_edit / "data" / row["edit_image"]).convert("RGB") for row in rows]
    assert all(C.dimensions(AREA, im) == im.size for im in images), [im.size for im in images]
    prompts = ["make the circle red", "paint the square of picture 1 in the colour of picture 2, keep the background"]
    recorded = run_pipeline(edit_pipe, images, prompts)
    hw = target_latent_hw(images[0])
    ours = trainer_inputs(edit_pipe, [[im] for im in images], prompts, "edit", hw)
    mask = ours["encoder_hidden_states_mask"]
    assert mask is not None and not bool(mask.all()) and bool(mask[:, 0].all()), f"padding not exercised: {mask}"
    assert_matches_pipeline(ours, recorded, hw)

    embeds, pipe_mask = edit_pipe.encode_prompt(prompts, image=images, device=torch.device("cpu"))
    assert_same("encode_prompt embeds", ours["encoder_hidden_states"], embeds)
    assert_same("encode_prompt mask", mask, pipe_mask)


def test_edit_plus_two_references_of_different_sizes_match_pipeline(edit_plus_pipe):
    """2509, references 96x64 and 64x64 (different aspect ratios, VAE and VL copies): "Picture i" prompt embeds,
    mask, both packed references in order, and img_shapes (target sized from the LAST reference) are equal."""
    assert isinstance(edit_plus_pipe, QwenImageEditPlusPipeline)
    images = [noise_image(96, 64, seed=1), noise_image(64, 64, seed=2)]
    prompt = "paint the circle of picture 1 in the colour of picture 2"
    recorded = run_pipeline(edit_plus_pipe, images, prompt)
    hw = target_latent_hw(images[-1])
    ours = trainer_inputs(edit_plus_pipe, [images], [prompt], "edit_plus", hw)
    assert len(recorded["img_shapes"][0]) == 3 and recorded["img_shapes"][0][1] != recorded["img_shapes"][0][2]
    assert_matches_pipeline(ours, recorded, hw)


def test_edit_2511_inputs_and_output_match_pipeline(tiny_edit_plus_2511, edit_plus_pipe):
    """2511 (QwenImageEditPlusPipeline, transformer zero_cond_t): the trainer's conditioning equals the pipeline's,
    and the transformer called with the trainer's inputs (loop.noisy_inputs' layout: noisy target then the
    references; img_shapes from qwen_image.conditioning) returns the pipeline's own prediction. The 2509 weights (the
    same tiny weights without zero_cond_t) predict something else for the same inputs, so the test sees the key."""
    from train.data import sources
    from train.model import family, loading
    from train.model.qwen_image import components
    from train.trainer import loop

    pipe = load_pipeline(tiny_edit_plus_2511)
    assert isinstance(pipe, QwenImageEditPlusPipeline) and pipe.transformer.config.zero_cond_t
    assert components.detect_variant(tiny_edit_plus_2511 / "model") == "edit_plus_2511"
    images = [noise_image(96, 64, seed=1), noise_image(64, 64, seed=2)]
    prompt = "paint the circle of picture 1 in the colour of picture 2"
    recorded = run_pipeline(pipe, images, prompt)
    hw = target_latent_hw(images[-1])
    ours = trainer_inputs(pipe, [images], [prompt], "edit_plus_2511", hw)
    assert_matches_pipeline(ours, recorded, hw)

    num_target = (hw[0] // 2) * (hw[1] // 2)
    noisy = recorded["hidden_states"][:, :num_target]  # the pipeline's own noise: loop draws its own
    cond = batches.Conditioning(ours["encoder_hidden_states"], ours["encoder_hidden_states_mask"],
                                ours["reference_tokens"], ours["img_shapes"][0][1:])
    kwargs = {"hidden_states": torch.cat([noisy, cond.reference_tokens], dim=1), "timestep": recorded["timestep"],
              "encoder_hidden_states": cond.prompt_embeds, "encoder_hidden_states_mask": cond.prompt_mask,
              "img_shapes": C.img_shapes(hw, cond.reference_shapes, 1), "return_dict": False}
    layout, _, _ = loop.noisy_inputs(sources.Batch(noisy.float(), hw, cond), _tiny_train_config(), torch.Generator(),
                                     loading.scheduler_config(tiny_edit_plus_2511 / "model"), torch.float32,
                                     family.family_named("qwen_image"))
    assert layout.keys() == kwargs.keys() and layout["img_shapes"] == kwargs["img_shapes"]
    assert torch.equal(layout["hidden_states"][:, num_target:], kwargs["hidden_states"][:, num_target:])
    with torch.no_grad():
        prediction = pipe.transformer(**kwargs)[0]
        plain_2509 = edit_plus_pipe.transformer(**kwargs)[0]
    assert_same("2511 prediction", prediction, recorded["output"])
    assert (prediction - plain_2509).abs().max().item() > 1e-3, "zero_cond_t changed nothing"


@pytest.fixture(scope="module")
def tiny_t2i(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_t2i"), variant="t2i", num_samples=4, size=64)


def text_to_image_pipeline(name: str, request):
    """QwenImagePipeline of the tiny Qwen-Image, or one built from the tiny edit model's components (how a
    no-reference sample of an edit model is encoded and sampled)."""
    if name == "t2i":
        return load_pipeline(request.getfixturevalue("tiny_t2i"))
    edit = request.getfixturevalue("edit_pipe")
    pipe = QwenImagePipeline(scheduler=edit.scheduler, vae=edit.vae, text_encoder=edit.text_encoder,
                             tokenizer=edit.tokenizer, transformer=edit.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("model, variant", [("t2i", "t2i"), ("edit", "edit")], ids=["qwen_image", "edit_model"])
def test_text_to_image_batch_matches_qwen_image_pipeline(model, variant, request):
    """Rows without a reference (Qwen-Image's own rows, or no-reference rows trained on an edit model): a batch of two
    prompts of different lengths gives QwenImagePipeline's padded embeds, 0/1 mask, img_shapes (the target alone)
    and a sequence of target tokens only; its encode_prompt gives the same embeds and mask."""
    pipe = text_to_image_pipeline(model, request)
    prompts = ["a red circle on grey", "a green square on grey, small, in the top left corner of the picture"]
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({k: kwargs.get(k) for k in RECORDED}), with_kwargs=True)
    try:
        pipe(prompt=prompts, height=64, width=96, true_cfg_scale=1.0, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    hw = (64 // C.PIXELS_PER_LATENT, 96 // C.PIXELS_PER_LATENT)
    ours = trainer_inputs(pipe, [[], []], prompts, variant, hw)
    assert ours["reference_tokens"].shape == (2, 0, 64) and ours["img_shapes"] == [[(1, 4, 6)]] * 2
    mask = ours["encoder_hidden_states_mask"]
    assert mask is not None and not bool(mask.all()), f"padding not exercised: {mask}"
    assert_matches_pipeline(ours, calls[0], hw)
    embeds, pipe_mask = pipe.encode_prompt(prompts, device=torch.device("cpu"), max_sequence_length=512)
    assert_same("encode_prompt embeds", ours["encoder_hidden_states"], embeds)
    assert_same("encode_prompt mask", mask, pipe_mask)


def test_text_to_image_template_and_limits_are_qwen_image_pipelines(tiny_t2i):
    pipe = load_pipeline(tiny_t2i)
    assert isinstance(pipe, QwenImagePipeline)
    assert C.T2I_TEMPLATE == pipe.prompt_template_encode and C.T2I_DROP_IDX == pipe.prompt_template_encode_start_idx
    assert C.T2I_TOKENIZER_MAX_LENGTH == pipe.tokenizer_max_length
    assert C.T2I_MAX_SEQUENCE_LENGTH == inspect.signature(pipe.__call__).parameters["max_sequence_length"].default


def _tiny_train_config():
    from train.config import TrainConfig

    return TrainConfig()


def test_templates_and_drop_index_match_pipelines(edit_pipe, edit_plus_pipe):
    """The trainer's prompt templates and dropped prefix length are the pipelines' own."""
    assert C.PROMPT_TEMPLATES["edit"] == edit_pipe.prompt_template_encode
    assert C.PROMPT_TEMPLATES["edit_plus"] == edit_plus_pipe.prompt_template_encode
    assert C.DROP_IDX == edit_pipe.prompt_template_encode_start_idx == edit_plus_pipe.prompt_template_encode_start_idx


def test_pipeline_areas_scales_and_restores_sizing():
    """Inside the block the pipelines' 1 MP / 384^2 sizing becomes AREA / CONDITION_AREA; afterwards it is restored."""
    originals = (pipeline_qwenimage_edit.calculate_dimensions, pipeline_qwenimage_edit_plus.calculate_dimensions)
    with C.pipeline_areas(AREA, CONDITION_AREA):
        assert pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, 1.0)[:2] == (128, 128)
        assert pipeline_qwenimage_edit_plus.calculate_dimensions(1024 * 1024, 1.5) == (160, 96)
        assert pipeline_qwenimage_edit_plus.calculate_dimensions(384 * 384, 1.0) == (96, 96)
    restored = (pipeline_qwenimage_edit.calculate_dimensions, pipeline_qwenimage_edit_plus.calculate_dimensions)
    assert restored == originals
    assert pipeline_qwenimage_edit_plus.calculate_dimensions(1024 * 1024, 1.0) == (1024, 1024)


def test_pack_matches_pipeline_and_unpack_inverts_it():
    """pack equals the pipelines' static _pack_latents; unpack equals _unpack_latents and inverts pack exactly."""
    latents = torch.randn(2, 16, 1, 6, 10, generator=torch.Generator().manual_seed(0))
    tokens = C.pack(latents)
    assert tokens.shape == (2, 3 * 5, 64)
    assert torch.equal(tokens, QwenImageEditPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(tokens, QwenImageEditPlusPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(C.unpack(tokens, 6, 10), latents)
    assert torch.equal(C.unpack(tokens, 6, 10),
                       QwenImageEditPipeline._unpack_latents(tokens, 6 * 8, 10 * 8, C.PIXELS_PER_LATENT))
