"""qwen_edit.train.deepcompile: the config's checks and DeepSpeed section, the memory plan's fixed settings, and the
frozen weights held as buffers (DeepCompile's precondition, checked with a recording dynamo backend on the CPU).

DeepCompile itself needs a CUDA GPU (DeepSpeed builds its op for CUDA only): tests/ says what the GPU run measures.
"""

from __future__ import annotations

import pytest
import torch
from conftest import write_config

from train.config import Config, ConfigError, LoraConfig, ProjectConfig, TrainConfig, load_config, parse_args
from train.model import family, prepare
from train.model.qwen_image.tiny import build_transformer
from train.model.qwen_image21.tiny import build_transformer as build_21
from train.plan import keys
from train.plan.choice import OFFLOAD_KEY
from train.plan.predict import Choice
from train.runtime import engine

KEY = "qwen_edit.train.deepcompile"


def _load(tiny, tmp_path, has_gpu: bool, **changes) -> Config:
    cfg = write_config(tmp_path / "c.json", **changes)
    args = [
        "--ds_config",
        str(cfg),
        "--model",
        str(tiny / "model"),
        "--data",
        str(tiny / "data"),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    return load_config(parse_args(args), 1, has_gpu)


def _problems(tiny, tmp_path, has_gpu: bool, **changes) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load(tiny, tmp_path, has_gpu, **changes)
    return info.value.problems


def test_deepcompile_fills_deepspeeds_compile_section(tiny_edit, tmp_path):
    """On a GPU the key becomes compile.deepcompile; off, the section has no compile key."""
    on = _load(tiny_edit, tmp_path, True, **{KEY: True})
    assert on.deepspeed["compile"] == {"deepcompile": True} and on.project.train.deepcompile
    assert "compile" not in _load(tiny_edit, tmp_path, True).deepspeed


def test_deepcompile_is_refused_where_it_cannot_run(tiny_edit, tmp_path):
    """Each refusal names the key, the reason and the fix, before anything loads."""
    (cpu,) = _problems(tiny_edit, tmp_path, False, **{KEY: True})
    assert cpu.startswith(f"{KEY}: this machine has no CUDA GPU") and "set deepcompile to false" in cpu
    (stage,) = _problems(tiny_edit, tmp_path, True, **{KEY: True, "zero_optimization.stage": 0})
    assert "zero_optimization.stage is 0; DeepCompile runs with stage 1 or 2" in stage
    found = _problems(
        tiny_edit,
        tmp_path,
        True,
        **{
            KEY: True,
            "qwen_edit.train.compile": True,
            "qwen_edit.train.gradient_checkpointing": True,
            "qwen_edit.train.offload_blocks": 1,
            "zero_optimization.offload_optimizer": {"device": "cpu"},
        },
    )
    assert len(found) == 4 and all(p.startswith(f"{KEY}: ") for p in found), found
    assert any("train.compile is true" in p for p in found) and any("offload_blocks is 1" in p for p in found)
    assert any("set kept_attention_blocks to 0" in p for p in found)
    assert any("offload_optimizer moves the optimizer to the host" in p for p in found)
    kept_off = {KEY: True, "qwen_edit.train.gradient_checkpointing": True, "qwen_edit.train.kept_attention_blocks": 0}
    assert _load(tiny_edit, tmp_path, True, **kept_off).project.train.gradient_checkpointing
    (by_hand,) = _problems(tiny_edit, tmp_path, True, **{"compile": {"deepcompile": True}})
    assert by_hand.startswith("compile.deepcompile: DeepCompile is switched by qwen_edit.train.deepcompile")
    # the resolved config written next to a run holds both, equal: it loads again
    assert _load(tiny_edit, tmp_path, True, **{KEY: True, "compile": {"deepcompile": True}}).project.train.deepcompile


def test_the_plan_leaves_out_what_deepcompile_cannot_run():
    """With DeepCompile the plan's candidates keep every block on the GPU without kept attention and the optimizer
    on the GPU, and it does not compile the blocks (the engine compiles the whole model)."""
    cfg = Config(ProjectConfig(train=TrainConfig(deepcompile=True)), {"zero_optimization": {"stage": 2}})
    fixed = keys.fixed_settings(cfg)
    assert fixed == {"train.offload_blocks": 0, "train.kept_attention_blocks": 0, OFFLOAD_KEY: False}
    keys.apply(cfg, Choice(True, False, 0, 0, True), 60)
    assert not cfg.project.train.compile and cfg.project.train.fp8_base
    plain = Config(ProjectConfig(), {"zero_optimization": {"stage": 2}})
    assert keys.fixed_settings(plain) == {}
    keys.apply(plain, Choice(True, False, 0, 0, True), 60)
    assert plain.project.train.compile


def test_frozen_weights_become_buffers_dynamo_sees_only_trainable_parameters():
    """After frozen_to_buffers a compiled graph's parameter inputs are the trainable ones only (what DeepCompile's
    ZeRO-1/2 backend asserts), the model computes the same, and the state dict holds no frozen weight."""
    torch.manual_seed(0)
    model = build_transformer()
    prepare.prepare_for_training(
        model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]), False, False
    )
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    x = {
        "hidden_states": torch.randn(1, 8, model.config.in_channels),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": torch.randn(1, 4, model.config.joint_attention_dim),
        "img_shapes": [[(1, 2, 4)]],
        "return_dict": False,
    }
    before = model(**x)[0]
    assert engine.frozen_to_buffers(model) == len(frozen) > 0
    assert {n: p for n, p in model.named_parameters()} == trainable
    assert not set(frozen) & set(model.state_dict()) and set(trainable) <= set(model.state_dict())
    torch.testing.assert_close(model(**x)[0], before, rtol=0, atol=0)

    seen = []

    def recording(gm, inputs):
        seen.extend(v for v in inputs if isinstance(v, torch.nn.Parameter))
        return gm.forward

    torch._dynamo.reset()
    block = model.transformer_blocks[0]
    compiled = torch.compile(block, backend=recording)
    temb = torch.randn(1, block.img_mod[1].in_features)
    compiled(torch.randn(1, 8, 64), torch.randn(1, 4, 64), None, temb)
    assert seen and all(p.requires_grad for p in seen)
    assert {id(p) for p in seen} <= {id(p) for p in trainable.values()}


def test_build_engine_compiles_the_whole_module_after_moving_the_frozen_weights(capsys):
    """engine.deepcompile: the frozen weights become buffers first, then DeepSpeed's engine.compile() runs once (on a
    stand-in engine: DeepCompile's own backend needs CUDA), and rank 0 says so."""
    model = build_transformer()
    prepare.prepare_for_training(
        model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"]), False, False
    )
    calls = []

    class Engine:
        module, global_rank = model, 0

        def compile(self):
            calls.append([n for n, p in self.module.named_parameters() if not p.requires_grad])

    engine.deepcompile(Engine())
    assert calls == [[]]  # compiled once, with no frozen parameter left
    assert "DeepCompile: the engine compiles the whole transformer" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("name", ["qwen_image", "qwen_image21"])
def test_after_freeze_unreached_every_trainable_weight_gets_a_gradient(name, mode):
    """DeepCompile's precondition: once prepare.freeze_unreached has run, one forward and backward give every
    trainable weight a gradient, and the output is unchanged. The Qwen-Image MMDiT has weights without one before
    (its last block's text stream after the attention); Qwen-Image-2.1's single stream has none."""
    fam = family.family_named(name)
    torch.manual_seed(0)
    model = (build_transformer() if name == "qwen_image" else build_21(num_layers=2)).float()
    lora = LoraConfig(rank=4, alpha=4.0, target_modules=list(fam.lora.targets))
    prepare.prepare_for_training(model, mode, lora, False, False)
    with torch.no_grad():  # LoRA B starts at zero; a value makes every LoRA weight's gradient matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    b = fam.synthetic_batch(model, 1, (4, 4), [(4, 4)], 6, torch.device("cpu"), torch.float32)

    def step():
        model.zero_grad(set_to_none=True)
        out = fam.target_prediction(model(**fam.transformer_inputs(b, b.x0, torch.tensor([0.4]), torch.float32)), b)
        out.square().mean().backward()
        return out.detach(), [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]

    before, missing = step()
    frozen = prepare.freeze_unreached(model)
    after, none_now = step()
    assert none_now == []
    assert frozen == len(missing) and (frozen > 0) == (name == "qwen_image"), missing
    torch.testing.assert_close(after, before, rtol=0, atol=0)
