"""A tiny random Qwen-Image-2.1 checkpoint in the released diffusers layout and a synthetic dataset, built offline
(the command train/make_tiny.py --variant qwen_image_21 and the tests use them).

make_tiny(OUT) writes OUT/model (make_tiny_model) and OUT/data (make_dataset). make_tiny_model(DIR) writes DIR with
model_index.json (QwenImage21Pipeline), transformer/ (QwenImage21Transformer2DModel), vae/ (AutoencoderKLQwenImage21:
RGBA in and out, 16x), text_encoder/ (Qwen3VLForConditionalGeneration), processor/ (Qwen3VLProcessor with its
tokenizer and chat template) and scheduler/, through the pipeline's own save_pretrained, so
`QwenImage21Pipeline.from_pretrained(DIR)` loads it as it loads the released weights. Nothing is downloaded: the
tokenizer is a byte-level BPE trained here on the pipeline's templates, and every network is randomly initialised
from a fixed seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from train.model.interface import TINY_INFO
from train.model.qwen_image21.conditioning import SYSTEM_PROMPT
from train.model.qwen_image21.variant import VARIANT
from train.model.tiny_tokenizer import build_tokenizer, special_token_ids, vl_config_ids

TEXT_DIM = 32  # hidden size of the tiny Qwen3-VL = context_in_dim of the tiny transformer
LATENT_CHANNELS = 16  # the released VAE has 64; the tiny one fewer, the transformer reads them unpatched
# The processor's size limits keep every 32-px multiple from 32x32 up unresized, so each image slot stands for
# exactly 2x2 latent tokens at the tests' small sizes (the released processor's floor is far above them).
VL_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}
# Qwen3-VL's chat template as far as the pipeline uses it (a system turn, text and image parts), written here.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# The pipeline's scheduler settings (its calculate_shift defaults, dynamic shift on).
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    time_shift_type="exponential",
)
CORPUS = [
    f"{SYSTEM_PROMPT} system user assistant <image1> <image2> <image3> a red circle on grey",
    "make the circle blue, paint the square of picture 1 in the colour of picture 2, a green square",
]


def build_processor(tokenizer):
    """Qwen3VLProcessor: 16-px patches merged 2x2 (one slot per 32x32 pixels), Qwen3-VL's normalisation."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=VL_PIXELS, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


def build_text_encoder(tokenizer):
    """Qwen3-VL at a tiny width: 2 text layers (interleaved M-RoPE), a 2-block ViT with one deepstack layer."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = special_token_ids(tokenizer)
    config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=len(tokenizer),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=TEXT_DIM,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        **vl_config_ids(tokenizer),
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def build_transformer(num_layers: int = 2):
    """The tiny 2.1 transformer: width 4 x 16, RoPE dims (4, 6, 6) over (frame, height, width)."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=4,
        context_in_dim=TEXT_DIM,
        mlp_ratio=3,
        axes_dims_rope=(4, 6, 6),
        causal_condition=True,
    )


def build_vae():
    """The tiny RGBA VAE: four downsamplings (16x, as released) at width 8. Its latent statistics are set away from
    (0, 1), so that a missing normalisation would change the latents."""
    from diffusers import AutoencoderKLQwenImage21

    channels = torch.arange(LATENT_CHANNELS, dtype=torch.float64)
    return AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        in_channels=4,
        out_channels=4,
        latents_mean=(0.1 * channels - 0.5).tolist(),
        latents_std=(0.5 + channels / LATENT_CHANNELS).tolist(),
    ).eval()


def build_pipeline(seed: int = 0):
    """The tiny QwenImage21Pipeline, in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(CORPUS * 4)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=build_vae(),
        text_encoder=build_text_encoder(tokenizer),
        processor=build_processor(tokenizer),
        transformer=build_transformer(),
    )


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint to `out` (the released layout); returns `out`."""
    out = Path(out)
    build_pipeline(seed).save_pretrained(out)
    return out


COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square")
# The kinds of rows make_dataset cycles through: (references, whether the scene is RGBA on a transparent ground).
ROW_KINDS = ((0, False), (1, False), (2, True), (1, True))


def draw_scene(shape: str, colour: str, xy: tuple[int, int], size: int, ground: tuple[int, ...]) -> Image.Image:
    """A shape on a plain ground: RGB for a 3-value `ground`, RGBA for 4 values (alpha 0 = transparent)."""
    image = Image.new("RGBA" if len(ground) == 4 else "RGB", (size, size), ground)
    r = size // 5
    box = (xy[0] - r, xy[1] - r, xy[0] + r, xy[1] + r)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour] + (255,) * (len(ground) - 3))
    return image


def make_dataset(
    out: Path,
    variant: str = VARIANT,
    num_samples: int = 32,
    size: int = 128,
    seed: int = 0,
    references: int | None = None,
) -> list[Image.Image]:
    """Recolouring rows in the dataset format, cycling through ROW_KINDS: text-to-image ("a red circle on grey", no
    edit_image), one reference ("make the circle red"), two references (a scene and a swatch of the new colour:
    "paint the circle of picture 1 in the colour of picture 2") and one RGBA reference; the RGBA scenes and their
    targets show the shape on a transparent ground (a real alpha channel: 255 on the shape, 0 around it). With
    `references`, every row has that many instead (the scene, then swatches: the new colour's, then others; RGBA
    on every other row), for a benchmark of one slot layout. Returns the images written."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows, images = [], []
    for i in range(num_samples):
        num_refs, rgba = ROW_KINDS[i % len(ROW_KINDS)] if references is None else (references, i % 2 == 1)
        shape, (old, new) = rng.choice(SHAPES), rng.sample(list(COLOURS), 2)
        grey = rng.randint(150, 240)
        ground = (0, 0, 0, 0) if rgba else (grey, grey, grey)
        xy = (rng.randint(size // 4, 3 * size // 4), rng.randint(size // 4, 3 * size // 4))
        written = {f"{i:04d}_target.png": draw_scene(shape, new, xy, size, ground)}
        row = {"image": f"{i:04d}_target.png", "prompt": f"a {new} {shape} on grey"}
        if num_refs:
            written[f"{i:04d}_ref.png"] = draw_scene(shape, old, xy, size, ground)
            row.update(edit_image=f"{i:04d}_ref.png", prompt=f"make the {shape} {new}")
        if num_refs >= 2:
            others = [c for c in COLOURS if c != new]
            for k in range(num_refs - 1):
                colour = new if k == 0 else others[(k - 1) % len(others)]
                name = f"{i:04d}_swatch{'' if k == 0 else k + 1}.png"
                written[name] = Image.new("RGB", (size // 2, size // 2), COLOURS[colour])
            row.update(
                edit_image=list(written)[1:],
                prompt=f"paint the {shape} of picture 1 in the colour of picture 2",
            )
        for name, image in written.items():
            image.save(out / name)
        images += written.values()
        rows.append(row)
    with open(out / "metadata.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return images


def make_tiny(
    out: str | Path,
    variant: str = VARIANT,
    num_samples: int = 32,
    size: int = 128,
    seed: int = 0,
    references: int | None = None,
) -> Path:
    """Write OUT/model (the tiny checkpoint, with OUT/model/tiny.json) and OUT/data (make_dataset, `references` per
    row or the mix); returns OUT."""
    out = Path(out)
    make_dataset(out / "data", variant, num_samples, size, seed, references)
    make_tiny_model(out / "model", seed)
    (out / "model" / TINY_INFO).write_text(json.dumps({"variant": variant}) + "\n")
    return out


def write_full_size_configs(model_dir: str | Path, num_layers: int | None = None) -> None:
    """Turn a tiny model directory into a weightless one with the released architecture's configs (archs.py): the
    2.1 transformer, Qwen3-VL-8B (with the tiny tokenizer's token ids) and the RGBA VAE; the processor gets the
    released image limits. Loading it needs QWEN_EDIT_RANDOM_INIT=1 (each model is built at random init on the
    device). `num_layers` (None = the released 32) keeps the released width with that many blocks."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLProcessor

    from train.model.qwen_image21.archs import TRANSFORMER, VL_PIXELS, VL_TEXT, VL_VISION

    model_dir = Path(model_dir)
    for sub in ("transformer", "text_encoder", "vae"):
        for f in (model_dir / sub).glob("*.safetensors*"):
            f.unlink()
    with torch.device("meta"):
        arch = {**TRANSFORMER, "num_layers": num_layers or TRANSFORMER["num_layers"]}
        QwenImage21Transformer2DModel(**arch).save_config(model_dir / "transformer")
        AutoencoderKLQwenImage21().save_config(model_dir / "vae")
    processor = Qwen3VLProcessor.from_pretrained(model_dir / "processor")
    ids = special_token_ids(processor.tokenizer)
    Qwen3VLConfig(
        text_config={**VL_TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        vision_config=VL_VISION,
        tie_word_embeddings=False,
        **vl_config_ids(processor.tokenizer),
    ).save_pretrained(model_dir / "text_encoder")
    processor.image_processor.size = dict(VL_PIXELS)
    processor.save_pretrained(model_dir / "processor")
