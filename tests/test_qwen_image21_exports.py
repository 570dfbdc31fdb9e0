"""Exports of Qwen-Image-2.1 runs through `python -m train.export`, from real checkpoints of tiny runs: the diffusers
LoRA loads with QwenImage21Pipeline.load_lora_weights and changes its output, the ComfyUI layout (gate and up fused
into img_mlp.gate_up) merges into the same weights, and a full fine-tune is a transformer directory that
from_pretrained loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_trainer, write_config
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from PIL import Image
from safetensors.torch import load_file
from test_train import check

from train import export
from train.model import placement
from train.model.qwen_image21 import lora_keys
from train.runtime.exports import COMFYUI_WEIGHT_NAME, LORA_WEIGHT_NAME

STEPS = 3
RANK, ALPHA = 4, 8.0  # alpha != rank: the diffusers layout folds the scale into B, ComfyUI's keeps it as alpha


def run_21(tiny: Path, out: Path, **changes) -> Path:
    """STEPS steps on the tiny 2.1 model in one process, the family's default LoRA targets (target_modules null)."""
    cfg = write_config(
        out.parent / f"{out.name}.json",
        **{"qwen_edit.lora": {"rank": RANK, "alpha": ALPHA, "target_modules": None}, **changes},
    )
    check(run_trainer(tiny, out, config=cfg, extra=("--max_steps", str(STEPS))))
    return out / f"global_step{STEPS}"


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_21_recolour, tmp_path_factory) -> Path:
    """A LoRA run at a high learning rate from the first step, so that three steps move the render."""
    fast = {"optimizer.params.lr": 0.05, "scheduler.params.warmup_num_steps": 1}
    return run_21(tiny_21_recolour, tmp_path_factory.mktemp("lora21") / "run", **fast)


def render(pipe, reference: Image.Image) -> np.ndarray:
    out = pipe(
        prompt="make the circle red",
        image=[reference],
        num_inference_steps=2,
        output_resolution=128,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    return out.images[0]


@pytest.mark.slow
def test_lora_export_loads_in_the_pipeline_and_changes_it(lora_checkpoint, tiny_21_recolour, tmp_path):
    """The CLI export equals the end-of-training export; load_lora_weights takes every one of its layers (7 a
    block) and the render changes."""
    assert export.main(["--checkpoint", str(lora_checkpoint), "--out", str(tmp_path)]) == 0
    exported = load_file(tmp_path / LORA_WEIGHT_NAME)
    trained = load_file(lora_checkpoint.parent / "export" / LORA_WEIGHT_NAME)
    assert exported.keys() == trained.keys()
    assert all((exported[k] - trained[k]).abs().max() <= 1e-6 for k in exported)
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_recolour / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    reference = Image.open(tiny_21_recolour / "data" / "0000_ref.png")
    base = render(pipe, reference)
    pipe.load_lora_weights(tmp_path, weight_name=LORA_WEIGHT_NAME)
    layers = [n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A") and m.lora_A]
    assert (
        len(layers) == len(exported) // 2 == len(lora_keys.DEFAULT_TARGETS) * len(pipe.transformer.transformer_blocks)
    )
    assert np.abs(render(pipe, reference) - base).max() > 1e-3


def deltas(state: dict[str, torch.Tensor], prefix: str, scaled: bool) -> dict[str, torch.Tensor]:
    """{module: the update B A its LoRA adds} of a LoRA file (times alpha / rank, lora_A's rows, when `scaled`)."""
    out = {}
    for key in state:
        if key.startswith(prefix) and key.endswith(".lora_A.weight"):
            module = key.removeprefix(prefix).removesuffix(".lora_A.weight")
            a, b = state[key], state[f"{prefix}{module}.lora_B.weight"]
            scale = state[f"{prefix}{module}.alpha"].item() / a.shape[0] if scaled else 1.0
            out[module] = scale * b.double() @ a.double()
    return out


@pytest.mark.slow
def test_comfyui_export_merges_to_the_diffusers_exports_weights(lora_checkpoint, tmp_path):
    """--format comfyui: `diffusion_model.` keys with alpha, each block's gate and up LoRAs fused into one
    img_mlp.gate_up LoRA of rank 2r (alpha 2 alpha); its update's gate rows and up rows are the split LoRAs'
    updates, and every other module's update is the diffusers export's."""
    for fmt in ("diffusers", "comfyui"):
        assert export.main(["--checkpoint", str(lora_checkpoint), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
    split = deltas(load_file(tmp_path / "diffusers" / LORA_WEIGHT_NAME), "transformer.", scaled=False)
    comfy_file = load_file(tmp_path / "comfyui" / COMFYUI_WEIGHT_NAME)
    fused = deltas(comfy_file, lora_keys.COMFYUI_PREFIX, scaled=True)
    gate_up = [m for m in fused if m.endswith(lora_keys.FUSED)]
    assert gate_up and not any(m.endswith(lora_keys.FUSED_PARTS) for m in fused)
    assert comfy_file[f"diffusion_model.{gate_up[0]}.lora_A.weight"].shape[0] == 2 * RANK
    assert comfy_file[f"diffusion_model.{gate_up[0]}.alpha"].item() == 2 * ALPHA
    for module, update in fused.items():
        if module.endswith(lora_keys.FUSED):
            block = module.removesuffix(lora_keys.FUSED)
            parts = [split.pop(block + part) for part in lora_keys.FUSED_PARTS]
            assert torch.allclose(update, torch.cat(parts), atol=1e-9), module
        else:
            assert torch.allclose(update, split.pop(module), atol=1e-9), module
    assert not split, sorted(split)[:4]


@pytest.mark.slow
def test_comfyui_export_renders_as_the_diffusers_export_through_train_infers_loader(
    lora_checkpoint, tiny_21_recolour, tmp_path
):
    """train.infer --lora with the ComfyUI file: its fused gate_up LoRAs are split back before diffusers' loader
    (which would drop them), and the render equals the diffusers export's."""
    renders = {}
    for fmt, name in (("diffusers", LORA_WEIGHT_NAME), ("comfyui", COMFYUI_WEIGHT_NAME)):
        assert export.main(["--checkpoint", str(lora_checkpoint), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
        pipe = QwenImage21Pipeline.from_pretrained(tiny_21_recolour / "model", local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        placement.load_loras(pipe, [(tmp_path / fmt / name, 1.0)])
        lora_modules = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A") and m.lora_A}
        assert any(n.endswith("img_mlp.gate_layer") for n in lora_modules), fmt
        renders[fmt] = render(pipe, Image.open(tiny_21_recolour / "data" / "0000_ref.png"))
    assert np.abs(renders["comfyui"] - renders["diffusers"]).max() < 1e-4


@pytest.mark.slow
def test_full_export_is_a_transformer_directory_from_pretrained_loads(tiny_21_recolour, tmp_path):
    """A full fine-tune exports DIR/transformer/, a QwenImage21Transformer2DModel with the trained weights that
    the pipeline takes in place of the base's."""
    checkpoint = run_21(tiny_21_recolour, tmp_path / "run", **{"qwen_edit.train.mode": "full"})
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 0
    loaded = QwenImage21Transformer2DModel.from_pretrained(tmp_path / "out" / "transformer")
    trained = QwenImage21Transformer2DModel.from_pretrained(checkpoint.parent / "export" / "transformer")
    base = QwenImage21Transformer2DModel.from_pretrained(tiny_21_recolour / "model" / "transformer")
    for name, tensor in loaded.state_dict().items():
        assert (tensor - trained.state_dict()[name]).abs().max() <= 1e-6, name
    assert max((t - base.state_dict()[n]).abs().max() for n, t in loaded.state_dict().items()) > 1e-4
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_recolour / "model", transformer=loaded, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert np.isfinite(render(pipe, Image.open(tiny_21_recolour / "data" / "0000_ref.png"))).all()
