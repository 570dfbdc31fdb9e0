"""train/model/qwen_image21/lora_keys.py: the LoRA targets are every linear layer of a 2.1 block; the ComfyUI layout
(gate and up fused into img_mlp.gate_up) merges into the same effective weights as the trained split LoRA, and back;
QwenImage21Pipeline.load_lora_weights loads the trainer's diffusers-layout export, which changes its output."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
from peft import LoraConfig

from train.model import family
from train.model.qwen_image21 import lora_keys as K
from train.model.qwen_image21.tiny import build_transformer
from train.runtime.exports import lora_state_dict, write_diffusers_lora

RANK, ALPHA = 4, 6.0


def with_random_lora(transformer, targets=K.DEFAULT_TARGETS, seed: int = 0):
    """A peft adapter on `targets` with random A and B (B starts at zero otherwise)."""
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return transformer


def effective_weights(transformer) -> dict[str, torch.Tensor]:
    """Every LoRA layer's base weight plus its scaled update (peft's own delta), by module name."""
    out = {}
    for name, module in transformer.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in module.lora_A:
            out[name] = module.base_layer.weight.detach() + module.get_delta_weight("default")
    return out


def comfyui_merge(base: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ComfyUI's LoRA loader makes of `state` on a model whose weights are `base` (its names, `.weight`): W +
    alpha / rank * B @ A, the rank read off lora_A."""
    merged = dict(base)
    for key in state:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            lora_a, lora_b = state[key], state[module + ".lora_B.weight"]
            scale = state[module + ".alpha"].item() / lora_a.shape[0]
            merged[module + ".weight"] = base[module + ".weight"] + scale * lora_b @ lora_a
    return merged


def comfyui_base(transformer) -> dict[str, torch.Tensor]:
    """The base weights in ComfyUI's checkpoint layout (gate rows, then up rows, fused)."""
    state = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            state[f"{K.COMFYUI_PREFIX}{name.removesuffix('.base_layer')}.weight"] = module.weight.detach()
    for key in [k for k in state if k.endswith(".img_mlp.gate_layer.weight")]:
        up = key.replace(".gate_layer.", ".proj.")
        state[key.replace(".gate_layer.", ".gate_up.")] = torch.cat([state.pop(key), state.pop(up)])
    return state


def test_targets_are_every_linear_layer_of_a_block():
    block = build_transformer().transformer_blocks[0]
    linears = {name for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == set(K.DEFAULT_TARGETS)


@pytest.mark.parametrize("targets", [K.DEFAULT_TARGETS, ("attn.to_q", "img_mlp.proj")], ids=["all", "up_only"])
def test_comfyui_layout_merges_to_the_trained_weights(targets):
    """ComfyUI's merge of the fused export equals the trained (peft) effective weights: attention as is, gate and up
    as the two halves of gate_up (diffusers' own converter splits them back); split_comfyui inverts the fusion."""
    torch.manual_seed(0)
    transformer = with_random_lora(build_transformer(), targets)
    trained = effective_weights(transformer)
    state = K.comfyui_state_dict(lora_state_dict(transformer), ALPHA, RANK)
    fused_keys = [k for k in state if ".gate_up." in k]
    assert fused_keys and all(k.startswith(K.COMFYUI_PREFIX) for k in state)
    assert not any(".gate_layer." in k or ".img_mlp.proj." in k for k in state)
    if "img_mlp.gate_layer" in targets:
        fused_a = state[f"{K.COMFYUI_PREFIX}transformer_blocks.0.{K.FUSED}.lora_A.weight"]
        assert fused_a.shape[0] == 2 * RANK
    base = comfyui_base(transformer)
    merged = comfyui_merge(base, state)
    split = convert_qwen_image21_transformer_checkpoint_to_diffusers({"model." + k: v for k, v in merged.items()})
    for name, weight in trained.items():
        torch.testing.assert_close(split[name + ".weight"], weight, rtol=1e-5, atol=1e-6, msg=name)
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed == {k.replace(".lora_A.", ".") for k in state if k.endswith(".lora_A.weight")}

    back = K.split_comfyui(state)
    split_base = convert_qwen_image21_transformer_checkpoint_to_diffusers({"model." + k: v for k, v in base.items()})
    remerged = comfyui_merge({K.COMFYUI_PREFIX + k: v for k, v in split_base.items()}, back)
    for name, weight in trained.items():
        torch.testing.assert_close(remerged[K.COMFYUI_PREFIX + name + ".weight"], weight, rtol=1e-5, atol=1e-6)


def test_pipeline_loads_diffusers_export_and_it_changes_the_output(tiny_21, tmp_path):
    def load():
        pipe = QwenImage21Pipeline.from_pretrained(tiny_21)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sample(pipe):
        return pipe(
            prompt="make the circle blue",
            num_inference_steps=2,
            output_resolution=64,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).images

    trained_pipe = load()
    base = sample(trained_pipe)
    with_random_lora(trained_pipe.transformer)
    trained = sample(trained_pipe)
    keys = family.family_named("qwen_image21").lora  # written by the family's pipeline class
    write_diffusers_lora(lora_state_dict(trained_pipe.transformer), tmp_path, ALPHA, RANK, keys=keys)

    pipe = load()
    pipe.load_lora_weights(tmp_path)
    loaded = sample(pipe)
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert (loaded - base).abs().max() > 1e-3
