"""The run's plan around the choice (train/plan/run_plan.py, train/plan/keys.py): the config keys that realise a
choice, the keys a config fixes (its own and DeepSpeed's optimizer offload), the choice written back into the free
keys, and torch's allocator settings."""

from __future__ import annotations

import pytest
from plan_helpers import measured, plan
from recorded_plans import RELEASED

from train.config import Config, ProjectConfig
from train.plan.choice import OFFLOAD_KEY
from train.plan.explain import PlanError, describe
from train.plan.keys import apply, config_values, fixed_settings
from train.plan.predict import Choice
from train.plan.run_plan import ALLOC_CONF_ENVS, expandable_segments
from train.plan.sizes import GB


def test_settings_realise_the_choice():
    assert config_values(Choice(True, True, 60, 10, True, kept_attention=40), 60) == {
        "train.fp8_base": True,
        "train.fp8_transposed": True,
        "train.gradient_checkpointing": True,
        "train.checkpoint_blocks": 0,
        "train.offload_blocks": 10,
        "train.kept_attention_blocks": 40,
    }
    assert config_values(Choice(False, False, 0, 0, False), 60)["train.gradient_checkpointing"] is False
    assert config_values(Choice(True, False, 24, 0, False), 60)["train.checkpoint_blocks"] == 24


def test_explicit_keys_of_a_config(tmp_path):
    from train import config

    path = tmp_path / "c.json"
    path.write_text('{"qwen_edit": {"inference": {"cpu_offload": "none"}, "memory": {"budget_gb": 24}}}')
    assert config.explicit_keys(path) == {"inference.cpu_offload", "memory.budget_gb"}
    assert config.explicit_keys(None) == set()


def test_offload_key_of_the_deepspeed_config_is_left_alone():
    """zero_optimization.offload_optimizer in the config pins the plan either way (and is counted); apply() writes
    the offload into the DeepSpeed section only when the config does not set it, as DeepSpeed reads it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    m = measured(8_448)
    pinned, p = plan(RELEASED, m, 141 * GB, 8.55 * GB, {OFFLOAD_KEY: True}, fp8_ok=True, online=False)
    free, q = plan(RELEASED, m, 141 * GB, 8.55 * GB, {}, fp8_ok=True, online=False)
    assert pinned.offload_optimizer and not free.offload_optimizer and p.peak_bytes < q.peak_bytes
    with pytest.raises(PlanError) as e:
        plan(RELEASED, m, 16 * GB, 2.3 * GB, {OFFLOAD_KEY: False}, fp8_ok=True, online=False)
    assert "offload_optimizer" not in str(e.value)  # the user turned it off: no advice to turn it on

    def config(zero: dict) -> Config:
        ds = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        }
        return Config(project=ProjectConfig(), deepspeed=ds)

    cfg = config({"stage": 2})
    assert OFFLOAD_KEY not in fixed_settings(cfg)
    apply(cfg, Choice(True, True, 60, 60, True, offload_optimizer=True), 60)
    assert cfg.deepspeed["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert DeepSpeedConfig(cfg.deepspeed).zero_config.offload_optimizer.device == "cpu"
    assert cfg.project.train.offload_blocks == 60 and cfg.project.train.fp8_base
    apply(on := config({"stage": 2}), Choice(True, True, 60, 0, True), 60)
    assert "offload_optimizer" not in on.deepspeed["zero_optimization"]
    for zero, offloaded in (
        ({"stage": 2, "offload_optimizer": {"device": "none"}}, False),
        ({"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, True),
        ({"stage": 2, "cpu_offload": True}, True),
    ):  # DeepSpeed's deprecated spelling
        cfg = config(zero)
        assert fixed_settings(cfg)[OFFLOAD_KEY] is offloaded
        apply(cfg, Choice(True, True, 60, 60, True, offload_optimizer=True), 60)
        assert cfg.deepspeed["zero_optimization"] == zero


def test_vae_tiling_is_planned_unless_the_config_sets_it():
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    cfg = Config(project=ProjectConfig(), deepspeed=ds)
    apply(cfg, Choice(True, True, 0, 0, True, vae_tiling=True), 60)
    assert cfg.project.inference.vae_tiling is True
    pinned = Config(project=ProjectConfig(), deepspeed=ds, explicit=frozenset({"inference.vae_tiling"}))
    assert fixed_settings(pinned)["inference.vae_tiling"] is False
    apply(pinned, Choice(True, True, 0, 0, True, vae_tiling=True), 60)
    assert pinned.project.inference.vae_tiling is False
    off = Config(project=ProjectConfig(), deepspeed=ds)
    apply(off, Choice(True, True, 0, 0, True), 60)  # validation off: left as it is
    assert off.project.inference.vae_tiling is False and "tiled" not in describe(Choice(True, True, 0, 0, True), 60)


def test_fast_accumulation_comes_with_the_planned_fp8_base_unless_the_config_sets_it():
    """apply() turns train.fp8_fast_accum on with an fp8 base (docs/perf_notes.md), leaves a bf16 base's
    off, and keeps the key where the config sets it, either way."""
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    fp8, bf16 = Choice(True, True, 0, 0, True), Choice(False, False, 0, 0, True)
    planned = Config(project=ProjectConfig(), deepspeed=ds)
    apply(planned, fp8, 60)
    assert planned.project.train.fp8_base and planned.project.train.fp8_fast_accum
    plain = Config(project=ProjectConfig(), deepspeed=ds)
    apply(plain, bf16, 60)
    assert not plain.project.train.fp8_base and not plain.project.train.fp8_fast_accum
    exact = Config(project=ProjectConfig(), deepspeed=ds, explicit=frozenset({"train.fp8_fast_accum"}))
    apply(exact, fp8, 60)
    assert exact.project.train.fp8_base and not exact.project.train.fp8_fast_accum


def test_expandable_segments_on_every_cuda_run_the_plan_makes(monkeypatch):
    """The plan switches torch's allocator to expandable segments and empties its cache on CUDA, whether or not its
    choice offloads; not off CUDA, nor when the user set torch's allocator settings (either variable)."""
    import torch

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    for env in ALLOC_CONF_ENVS:
        monkeypatch.delenv(env, raising=False)
    cuda = torch.device("cuda", 0)
    assert expandable_segments(torch.device("cpu")) == "" and calls == []
    assert "expandable segments on" in expandable_segments(cuda)
    assert calls == ["expandable_segments:True", "emptied"]
    for env in ALLOC_CONF_ENVS:
        monkeypatch.setenv(env, "max_split_size_mb:512")
        assert expandable_segments(cuda) == ""
        monkeypatch.delenv(env)
    assert len(calls) == 2
