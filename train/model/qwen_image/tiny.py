"""A tiny random Qwen-Image-Edit checkpoint and a synthetic edit dataset, built offline (the command
train/make_tiny.py, the tests and the demo use it).

make_tiny(DIR) writes DIR/model (the diffusers layout of Qwen/Qwen-Image-Edit, -2509 or -2511: model_index.json,
transformer/, vae/, text_encoder/, tokenizer/, processor/, scheduler/; of Qwen/Qwen-Image for t2i: no processor/) and
DIR/data (images + metadata.jsonl).
Nothing is downloaded: the tokenizer is a byte-level BPE trained here on the prompt templates, and
every network is randomly initialised from a fixed seed, so the demo and the tests load them through
exactly the `from_pretrained` and dataset paths that real weights and data take.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from train.model.interface import TINY_INFO
from train.model.tiny_tokenizer import build_tokenizer, special_token_ids

# Scheduler settings of the released Qwen-Image family (dynamic shift: about 2.0 at 1024^2).
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("circle", "square")
TEXT_DIM = 32  # hidden size of the tiny Qwen2.5-VL = joint_attention_dim of the tiny transformer


def build_processor(tokenizer, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280):
    """Qwen2VLProcessor with the released image-processor settings (14 px patches, 2x2 merge)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    return Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )


def build_text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = special_token_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=len(tokenizer),
            rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_DIM,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


VAE_KINDS = ("random", "pooling")


def build_vae(kind: str = "random"):
    """The tiny VAE: random weights, or ("pooling") weights set so that it is an 8x8 average-pooling autoencoder
    (see pooling_weights), whose decoded images show what the latents hold."""
    from diffusers import AutoencoderKLQwenImage

    # 8x spatial downsampling and 16 latent channels, as in the released VAE, at a small width.
    vae = AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    ).eval()
    if kind == "pooling":
        pooling_weights(vae)
    return vae


_LIFT, _SIGNAL = 100.0, 0.02  # a constant channel's value; the size of the signal entering each SiLU


def _copy_channels(conv, num_channels: int, scale: float = 1.0) -> None:
    """Make `conv` copy input channel k to output channel k (k < num_channels) through its current-frame centre
    tap (a causal conv's current frame is its last time tap), times `scale`; everything else zero."""
    import torch.nn as nn

    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    w = conv.weight
    tap = tuple(size - 1 if w.dim() == 5 and i == 0 else size // 2 for i, size in enumerate(w.shape[2:]))
    for k in range(min(num_channels, w.shape[0], w.shape[1])):
        w[(k, k, *tap)] = scale


@torch.no_grad()
def pooling_weights(vae) -> None:
    """Set the tiny AutoencoderKLQwenImage's weights so that it encodes an image into its 8x8 block means (RGB in
    latent channels 0-2, the other 13 zero, posterior variance ~0) and decodes by nearest upsampling, errors
    ~1e-3: a stand-in whose decoded images mean something, built in the released class and layout without any
    training. Every residual branch and attention output is zeroed (the blocks become their shortcuts, which copy
    channels), downsampling convs average 2x2, upsampling convs copy. The two RMS-norm + SiLU heads are made
    near-linear: a constant channel of value _LIFT makes the norm ~constant, and the norm's gain shrinks the signal
    to ~_SIGNAL, where silu(y) ~ y / 2; the following conv scales it back."""
    import torch.nn as nn
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qvae

    for m in vae.modules():
        if isinstance(m, qvae.QwenImageResidualBlock):
            nn.init.zeros_(m.conv2.weight)
            nn.init.zeros_(m.conv2.bias)
            if not isinstance(m.conv_shortcut, nn.Identity):
                _copy_channels(m.conv_shortcut, 4)
        elif isinstance(m, qvae.QwenImageAttentionBlock):
            nn.init.zeros_(m.proj.weight)
            nn.init.zeros_(m.proj.bias)
        elif isinstance(m, qvae.QwenImageResample) and m.mode.startswith("down"):
            conv = m.resample[1]  # after a (0, 1, 0, 1) zero pad, stride 2: taps (0..1, 0..1) are one 2x2 block
            nn.init.zeros_(conv.weight)
            nn.init.zeros_(conv.bias)
            for k in range(4):
                conv.weight[k, k, :2, :2] = 0.25
        elif isinstance(m, qvae.QwenImageResample) and m.mode.startswith("up"):
            _copy_channels(m.resample[1], 4)  # after the nearest upsampling
    z_dim = vae.config.z_dim
    for coder in (vae.encoder, vae.decoder):
        _copy_channels(coder.conv_in, 3)
        coder.conv_in.bias[3] = _LIFT
        coder.norm_out.gamma.fill_(_SIGNAL * _LIFT / coder.norm_out.gamma.shape[0] ** 0.5)
        _copy_channels(coder.conv_out, 3, scale=2.0 / _SIGNAL)
    vae.encoder.conv_out.bias[z_dim:] = -20.0  # log-variance: the posterior is its mean
    _copy_channels(vae.quant_conv, 2 * z_dim)
    _copy_channels(vae.post_quant_conv, z_dim)


# The tiny transformer's attention heads: "tests" (width 4 x 16 = 64; the tests and benchmarks depend on it) and
# "demo" (width 4 x 32 = 128), whose RoPE gives the latent rows and columns 12 dims each instead of 4: with 4,
# only one rotation frequency (1 rad per token) tells positions apart, so a token 6 positions away looks like
# the same one, and the tests' size pre-trained to copy its reference (train/trainer/pretrain.py) drew noisy
# copies with ghosts of the shape, 23 of 255 from the reference on the demo's rows; the demo's size copies
# cleanly, 7 of 255.
TRANSFORMER_SIZES = {
    "tests": dict(attention_head_dim=16, axes_dims_rope=(8, 4, 4)),
    "demo": dict(attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
}


def build_transformer(zero_cond_t: bool = False, num_layers: int = 2, size: str = "tests"):
    """The tiny transformer (TRANSFORMER_SIZES[size]); zero_cond_t=True is Qwen-Image-Edit-2511's config
    (references modulated at t=0)."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=num_layers, num_attention_heads=4,
        joint_attention_dim=TEXT_DIM, guidance_embeds=False, zero_cond_t=zero_cond_t, **TRANSFORMER_SIZES[size],
    )


def set_latent_statistics(vae, images: list[Image.Image]) -> None:
    """Give the random VAE per-channel latents_mean/std measured on `images`, as the real VAE's are."""
    import numpy as np

    # Statistics of flat synthetic scenes barely depend on the resolution; cap it so that --size 1024 fits in memory.
    images = [im if max(im.size) <= 256 else im.resize((256, 256)) for im in images]
    batch = torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
                         for im in images])
    with torch.no_grad():
        z = vae.encode(batch[:, :, None]).latent_dist.mode()  # B C 1 h w
    vae.register_to_config(
        latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3).tolist()
    )


def draw_scene(shape: str, colour: str, xy: tuple[int, int], size: int, background: tuple[int, int, int]) -> Image:
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    r = size // 5
    box = (xy[0] - r, xy[1] - r, xy[0] + r, xy[1] + r)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return image


def make_dataset(out: Path, variant: str, num_samples: int, size: int, seed: int = 0) -> list[Image.Image]:
    """Recolour edits: the target is the reference with its shape in the colour the prompt names.

    Edit (v1): one reference, prompt "make the circle red". Edit-2509 and -2511: a second reference is a swatch
    of the new colour and the prompt refers to it ("Picture 2"), so the model must read both references.
    Text-to-image (t2i): no reference; the prompt describes the target ("a red circle on grey").
    Returns the images written (for the VAE statistics).
    """
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows, images = [], []
    names = list(COLOURS)
    for i in range(num_samples):
        shape = rng.choice(SHAPES)
        old, new = rng.sample(names, 2)
        grey = rng.randint(150, 240)
        xy = (rng.randint(size // 4, 3 * size // 4), rng.randint(size // 4, 3 * size // 4))
        reference = draw_scene(shape, old, xy, size, (grey, grey, grey))
        target = draw_scene(shape, new, xy, size, (grey, grey, grey))
        target.save(out / f"{i:04d}_target.png")
        if variant == "t2i":
            rows.append({"image": f"{i:04d}_target.png", "prompt": f"a {new} {shape} on grey"})
            images.append(target)
            continue
        reference.save(out / f"{i:04d}_ref.png")
        row = {"image": f"{i:04d}_target.png", "edit_image": f"{i:04d}_ref.png", "prompt": f"make the {shape} {new}"}
        images += [reference, target]
        if variant in ("edit_plus", "edit_plus_2511"):
            Image.new("RGB", (size // 2, size // 2), COLOURS[new]).save(out / f"{i:04d}_swatch.png")
            row["edit_image"] = [f"{i:04d}_ref.png", f"{i:04d}_swatch.png"]
            row["prompt"] = f"paint the {shape} of picture 1 in the colour of picture 2"
        rows.append(row)
    with open(out / "metadata.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return images


VARIANTS = ("edit", "edit_plus", "edit_plus_2511", "t2i")


def make_tiny(out: str | Path, variant: str = "edit", num_samples: int = 32, size: int = 128, seed: int = 0,
              vae: str = "random", transformer: str = "tests") -> Path:
    """Write OUT/model and OUT/data; returns OUT. `vae`: see build_vae (the demo uses "pooling"); `transformer`:
    a TRANSFORMER_SIZES key (the demo uses "demo")."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from train.model.qwen_image.conditioning import PIPELINE_CLASSES

    if variant not in VARIANTS:
        raise ValueError(f"--variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if vae not in VAE_KINDS:
        raise ValueError(f"--vae must be one of {', '.join(VAE_KINDS)}, got {vae!r}")
    if transformer not in TRANSFORMER_SIZES:
        raise ValueError(f"--transformer must be one of {', '.join(TRANSFORMER_SIZES)}, got {transformer!r}")
    out = Path(out)
    images = make_dataset(out / "data", variant, num_samples, size, seed)
    template_words = ("Describe the key features of the input image (color, shape, size, texture, objects, "
                      "background), then explain how the user's text instruction should alter or modify the image. "
                      "Generate a new image that meets the user's requirements while maintaining consistency with "
                      "the original input where appropriate. system user assistant Picture 1: 2: 3:")
    corpus = [template_words] + [f"make the {s} {c} paint the {s} of picture 1 in the colour of picture 2"
                                 for s in SHAPES for c in COLOURS]
    if variant == "t2i":  # QwenImagePipeline's template (the edit models' tokenizers stay as they were)
        corpus[0] = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                     "relationships of the objects and background: system user assistant on grey")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(corpus * 4)
    autoencoder = build_vae(vae)
    set_latent_statistics(autoencoder, images[:16])
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=autoencoder,
                      text_encoder=build_text_encoder(tokenizer), tokenizer=tokenizer,
                      transformer=build_transformer(zero_cond_t=variant == "edit_plus_2511", size=transformer))
    if variant != "t2i":  # Qwen-Image (text-to-image) ships no processor
        components["processor"] = build_processor(tokenizer)
    pipeline = getattr(diffusers, PIPELINE_CLASSES[variant])(**components)
    pipeline.save_pretrained(out / "model")
    info = {"variant": variant, "vae": vae, "transformer": transformer}
    (out / "model" / TINY_INFO).write_text(json.dumps(info) + "\n")
    return out


def write_full_size_configs(model_dir: str | Path, num_layers: int | None = None) -> None:
    """Turn a tiny model directory into a weightless one with the released architectures' configs: the Qwen-Image
    transformer and Qwen2.5-VL-7B (archs.py, with the tiny tokenizer's token ids) and the default VAE; the
    processor gets the released image limits. Loading it needs QWEN_EDIT_RANDOM_INIT=1 (components.py builds
    each model at random init on the device): for measuring the real trainer on full-size shapes without 58 GB of
    weights. `num_layers` (None = the released 60) keeps the released width with that many blocks, for the deepest
    full fine-tune a budget fits (docs/performance.md)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2Tokenizer

    from train.model.qwen_image.archs import FULL_ARCH, VL_PIXELS, VL_TEXT, VL_VISION

    model_dir = Path(model_dir)
    for sub in ("transformer", "text_encoder", "vae"):
        for f in (model_dir / sub).glob("*.safetensors*"):
            f.unlink()
    with torch.device("meta"):
        zero_cond_t = QwenImageTransformer2DModel.load_config(model_dir / "transformer").get("zero_cond_t", False)
        arch = {**FULL_ARCH, "num_layers": num_layers or FULL_ARCH["num_layers"]}
        QwenImageTransformer2DModel(**arch, zero_cond_t=zero_cond_t).save_config(model_dir / "transformer")
        AutoencoderKLQwenImage().save_config(model_dir / "vae")
    tokenizer = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer")
    ids = special_token_ids(tokenizer)
    Qwen2_5_VLConfig(
        text_config={**VL_TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        vision_config=VL_VISION, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    ).save_pretrained(model_dir / "text_encoder")
    build_processor(tokenizer, **VL_PIXELS).save_pretrained(model_dir / "processor")
