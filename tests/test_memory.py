"""The memory plan (train/model/memory.py): counted sizes, the planner's decisions over budgets and workloads, the
config keys it respects. The measurement itself needs a GPU; these use figures of its shape."""

from __future__ import annotations

import pytest

from train.config import LoraConfig
from train.model import memory
from train.model.tiny import make_tiny, write_full_size_configs

GB = memory.GB


@pytest.fixture(scope="module")
def full_sizes(tmp_path_factory):
    """Sizes of the released transformer (counted on the meta device) with the default LoRA r64."""
    out = make_tiny(tmp_path_factory.mktemp("full"), "edit_plus", num_samples=2, size=64)
    write_full_size_configs(out / "model")
    return memory.count_sizes(out / "model", LoraConfig().target_modules, 64)


def measured(tokens: int) -> memory.Measured:
    """Block figures of the shape the GPU measurement gives, scaled linearly with the micro-batch's tokens
    (at 12.5k tokens: 1.5 GB kept per plain block, its two input streams per checkpointed one)."""
    scale = tokens / 12_500
    return memory.Measured(act_bytes=1.5 * GB * scale, ckpt_bytes=tokens * 3072 * 2 * 2, transient_bytes=5 * GB * scale,
                           fwd_s=0.0075 * scale, fwd_bwd_s=0.0235 * scale, h2d_bytes_per_s=25e9)


def test_counted_sizes_are_the_released_model(full_sizes):
    s = full_sizes
    total = s.num_blocks * s.block_params + s.other_params
    assert s.num_blocks == 60 and abs(total - 20.43e9) < 0.01e9  # DESIGN.md: 20.43 B parameters
    assert s.block_fp8_params / s.block_params > 0.99  # the converted linears are nearly all of a block
    assert s.block_token_params / s.block_fp8_params == pytest.approx(2 / 3, abs=0.01)  # mod linears are 1/3
    # LoRA r64 on the 12 default projections: r * (in + out) per linear per block
    per_block = 64 * (8 * (3072 + 3072) + 2 * (3072 + 12288) + 2 * (12288 + 3072))
    assert s.lora_params == 60 * per_block


@pytest.mark.parametrize("tokens, budgets", [(8_448, (141, 80, 48, 24)), (12_544, (141, 80, 48))])
def test_plan_over_budgets(full_sizes, tokens, budgets):
    """Fits each budget; less memory never buys a faster step; the biggest card keeps every block plain and
    resident, 24 GB offloads. (With these figures 12.5k tokens need 23.5 GB at the least: the LoRA optimizer
    state, 8.5 GB at r64, stays on the GPU.)"""
    m = measured(tokens)
    previous = None
    for budget in budgets:
        margin = memory.margin_bytes(0, budget * GB)
        c, p = memory.choose(full_sizes, m, budget * GB, margin, {}, fp8_ok=True, online=False)
        assert p.peak_bytes <= budget * GB - margin
        assert c.fp8_base and c.offloaded <= c.checkpointed
        if previous is not None:
            assert p.step_s >= previous[1].step_s
            assert c.checkpointed >= previous[0].checkpointed
        previous = (c, p)
        if budget == 141:
            assert c.offloaded == 0 and c.checkpointed < 20
        if budget <= 24:
            assert c.offloaded > 0 and c.checkpointed == 60
    # the prediction is the formula: a plain resident block costs A, a checkpointed one S, and checkpointing at
    # all costs one block's recomputation A
    none, one, two = (memory.predict(full_sizes, m, memory.Choice(True, False, n, 0, True)) for n in (0, 1, 2))
    assert one.peak_bytes - none.peak_bytes == pytest.approx(m.ckpt_bytes)
    assert one.peak_bytes - two.peak_bytes == pytest.approx(m.act_bytes - m.ckpt_bytes)
    assert two.step_s - one.step_s == pytest.approx(m.fwd_s)


def test_explicit_keys_win_and_online_encoders_count(full_sizes):
    m = memory.Measured(**{**measured(12_544).__dict__, "encode_bytes": 4 * GB})
    fixed = {"train.fp8_base": False, "train.gradient_checkpointing": True}
    c, _ = memory.choose(full_sizes, m, 141 * GB, 0, fixed, fp8_ok=True, online=False)
    assert not c.fp8_base and c.checkpointed >= 1
    # online: the 16.6 GB VL model shares the GPU; the plan prefers it while it fits, else trains from the cache
    sizes = memory.Sizes(**{**full_sizes.__dict__, "encoder_bytes": int(16.6 * GB)})
    c141, _ = memory.choose(sizes, m, 141 * GB, 8 * GB, {}, fp8_ok=True, online=True)
    assert not c141.cached
    c48, _ = memory.choose(sizes, m, 48 * GB, 3.9 * GB, {}, fp8_ok=True, online=True)
    assert c48.cached
    pinned, _ = memory.choose(sizes, m, 48 * GB, 3.9 * GB, {"data.cache": "off"}, fp8_ok=True, online=True)
    assert not pinned.cached and pinned.offloaded > 0  # data.cache set to "off" in the config: offload instead
    with pytest.raises(memory.PlanError, match="nothing fits"):
        memory.choose(sizes, m, 24 * GB, 2.7 * GB, {"data.cache": "off"}, fp8_ok=True, online=True)


def test_budget_below_the_minimum_names_the_numbers(full_sizes):
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, measured(12_544), 6 * GB, 1.8 * GB, {}, fp8_ok=True, online=False)
    text = str(e.value)
    assert "6.0 GB" in text and "needs" in text and "qwen_edit.data.area" in text
    # without fp8 matmuls (an older GPU) the smallest plan is bf16 and offloaded
    c, _ = memory.choose(full_sizes, measured(8_448), 24 * GB, 2.7 * GB, {}, fp8_ok=False, online=False)
    assert not c.fp8_base and c.offloaded > 0


def test_settings_realise_the_choice():
    assert memory.settings(memory.Choice(True, True, 60, 10, True), 60) == {
        "train.fp8_base": True, "train.fp8_transposed": True, "train.gradient_checkpointing": True,
        "train.checkpoint_blocks": 0, "train.offload_blocks": 10}
    assert memory.settings(memory.Choice(False, False, 0, 0, False), 60)["train.gradient_checkpointing"] is False
    assert memory.settings(memory.Choice(True, False, 24, 0, False), 60)["train.checkpoint_blocks"] == 24


def test_largest_bucket_and_text_bound():
    keys = [((128, 128), (128, 128)), ((128, 128), (128, 128), (128, 128)), ((64, 64), (64, 64))]
    w = memory.largest_bucket(keys, 2, 700)
    assert w.image_tokens == 3 * 64 * 64 and w.target_hw == (128, 128) and w.batch == 2
    assert memory.text_tokens_bound("edit_plus", 2, 1024 * 1024, 384 * 384) == 320 + 2 * 188
    assert memory.text_tokens_bound("edit", 1, 1024 * 1024, 384 * 384) == 320 + 1337


def test_oom_advice_names_each_phases_settings():
    step = memory.oom_advice("step", 1)
    assert "gradient_checkpointing = true" in step and "offload_blocks" in step and "micro_batch" not in step
    assert "zero_optimization.offload_optimizer" in step
    assert "train_micro_batch_size_per_gpu = 1" in memory.oom_advice("step", 2)
    assert "fp8_base" in memory.oom_advice("load", 1) and "data.cache" in memory.oom_advice("load", 1)
    assert "data.cache \"auto\"" in memory.oom_advice("encode", 1)
    assert "inference.area" in memory.oom_advice("validation", 4)
    assert "micro_batch" not in memory.oom_advice("validation", 4)
    assert memory.OutOfMemory("x").without_traceback


def test_inference_offload_follows_the_budget():
    """train.infer's placement: everything on the GPU, whole components in turn, or layer by layer."""
    parts = {"transformer": int(40.9 * GB), "text encoder and VAE": int(16.9 * GB)}
    assert memory.inference_offload(parts, 141 * GB, 8.6 * GB) == "none"
    assert memory.inference_offload(parts, 60 * GB, 4.5 * GB) == "model"
    assert memory.inference_offload(parts, 48 * GB, 3.9 * GB) == "sequential"  # 40.9 GB + 6 GB + margin > 48
    assert memory.inference_offload(parts, 24 * GB, 2.7 * GB) == "sequential"


def test_explicit_keys_of_a_config(tmp_path):
    from train import config

    path = tmp_path / "c.json"
    path.write_text('{"qwen_edit": {"inference": {"cpu_offload": "none"}, "memory": {"budget_gb": 24}}}')
    assert config.explicit_keys(path) == {"inference.cpu_offload", "memory.budget_gb"}
    assert config.explicit_keys(None) == set()


def test_optimizer_offload_is_the_last_resort(full_sizes):
    """At 16 GB only DeepSpeed's optimizer offload fits 8.4k tokens (the LoRA r64 state, 6.8 GB, is what does not):
    it is chosen, its predicted peak is the same setting's without it minus 12 bytes per LoRA parameter, and the
    host step is charged; at 24 GB a setting without it fits, and it is not chosen."""
    m = measured(8_448)
    margin = memory.margin_bytes(0, 16 * GB)
    c, p = memory.choose(full_sizes, m, 16 * GB, margin, {}, fp8_ok=True, online=False)
    assert c.offload_optimizer and p.peak_bytes <= 16 * GB - margin
    on_gpu = memory.predict(full_sizes, m, memory.Choice(c.fp8_base, c.fp8_transposed, c.checkpointed, c.offloaded,
                                                         c.cached))
    lowered = full_sizes.lora_params * (memory.LORA_STATE_BYTES - memory.LORA_OFFLOADED_STATE_BYTES)
    assert on_gpu.peak_bytes - p.peak_bytes == pytest.approx(lowered)
    assert lowered == pytest.approx(5.1 * GB, rel=0.01)
    assert p.step_s == on_gpu.step_s and on_gpu.optimizer_s == 0
    assert p.optimizer_s == pytest.approx(full_sizes.lora_params * (30 / 10e9 + 4 / 25e9))  # ~1.34 s
    assert "optimizer state in host memory" in memory.describe(c, 60)
    # nothing without it fits 16 GB: with the offload ruled out the plan refuses
    with pytest.raises(memory.PlanError):
        memory.choose(full_sizes, m, 16 * GB, margin, {memory.OFFLOAD_KEY: False}, fp8_ok=True, online=False)
    c24, _ = memory.choose(full_sizes, m, 24 * GB, memory.margin_bytes(0, 24 * GB), {}, fp8_ok=True, online=False)
    assert not c24.offload_optimizer and c24.offloaded > 0  # block offloading first: it costs less time


def test_offload_key_of_the_deepspeed_config_is_left_alone(full_sizes):
    """zero_optimization.offload_optimizer in the config pins the plan either way (and is counted); apply() writes
    the offload into the DeepSpeed section only when the config does not set it, as DeepSpeed reads it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from train.config import Config, ProjectConfig

    m = measured(8_448)
    pinned, p = memory.choose(full_sizes, m, 141 * GB, 8.55 * GB, {memory.OFFLOAD_KEY: True}, fp8_ok=True,
                              online=False)
    free, q = memory.choose(full_sizes, m, 141 * GB, 8.55 * GB, {}, fp8_ok=True, online=False)
    assert pinned.offload_optimizer and not free.offload_optimizer and p.peak_bytes < q.peak_bytes
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, m, 16 * GB, 2.3 * GB, {memory.OFFLOAD_KEY: False}, fp8_ok=True, online=False)
    assert "offload_optimizer" not in str(e.value)  # the user turned it off: no advice to turn it on

    def config(zero: dict) -> Config:
        ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        return Config(project=ProjectConfig(), deepspeed=ds)

    cfg = config({"stage": 2})
    assert memory.OFFLOAD_KEY not in memory.fixed_settings(cfg)
    memory.apply(cfg, memory.Choice(True, True, 60, 60, True, offload_optimizer=True), 60)
    assert cfg.deepspeed["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                   "pin_memory": True}}
    assert DeepSpeedConfig(cfg.deepspeed).zero_config.offload_optimizer.device == "cpu"
    assert cfg.project.train.offload_blocks == 60 and cfg.project.train.fp8_base
    memory.apply(on := config({"stage": 2}), memory.Choice(True, True, 60, 0, True), 60)
    assert "offload_optimizer" not in on.deepspeed["zero_optimization"]
    for zero, offloaded in (({"stage": 2, "offload_optimizer": {"device": "none"}}, False),
                            ({"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, True),
                            ({"stage": 2, "cpu_offload": True}, True)):  # DeepSpeed's deprecated spelling
        cfg = config(zero)
        assert memory.fixed_settings(cfg)[memory.OFFLOAD_KEY] is offloaded
        memory.apply(cfg, memory.Choice(True, True, 60, 60, True, offload_optimizer=True), 60)
        assert cfg.deepspeed["zero_optimization"] == zero


def test_optimizer_offload_needs_adam_zero_and_host_memory(full_sizes):
    """An optimizer DeepSpeed cannot step on the host (not Adam/AdamW), ZeRO stage 0 or a host without the room
    rule the offload out: the plan refuses as before, saying that the offload would fit and why it cannot be used."""
    ds = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    assert memory.offload_blocker(ds, full_sizes, 64 * GB) is None
    assert memory.offload_blocker({**ds, "optimizer": {"type": "Adam"}}, full_sizes, 64 * GB) is None
    lion = memory.offload_blocker({**ds, "optimizer": {"type": "Lion"}}, full_sizes, 64 * GB)
    assert 'optimizer.type "Lion"' in lion and "AdamW" in lion
    assert "stage is 0" in memory.offload_blocker({"optimizer": {"type": "AdamW"}}, full_sizes, 64 * GB)
    host = memory.offload_blocker(ds, full_sizes, 4 * GB)  # 425 M parameters x 18 bytes: 7.6 GB
    assert "7.6 GB of host memory" in host and "4.0 GB" in host
    assert memory.offload_blocker(ds, full_sizes, 4 * GB, ranks_per_node=1, world_size=2) is None  # half each
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, measured(8_448), 16 * GB, 2.3 * GB, {}, fp8_ok=True, online=False,
                      offload_blocker=lion)
    text = str(e.value)
    assert "nothing fits the memory budget: 16.0 GB" in text and "needs 18.6 GB" in text  # the best without it
    assert "optimizer offload (zero_optimization.offload_optimizer) the run would fit" in text
    assert "needs 13.5 GB, of 13.7 GB" in text and 'optimizer.type "Lion"' in text
    with pytest.raises(memory.PlanError) as e:  # too small even with the offload: said so
        memory.choose(full_sizes, measured(8_448), 12 * GB, 2.1 * GB, {}, fp8_ok=True, online=False,
                      offload_blocker=lion)
    assert "would still not fit" in str(e.value)
