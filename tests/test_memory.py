"""The memory plan (train/model/memory.py): counted sizes, the planner's decisions over budgets and workloads, the
config keys it respects. The measurement itself needs a GPU; these use figures of its shape."""

from __future__ import annotations

import dataclasses
import os
import queue as queues

import pytest

from train.config import Config, DataConfig, LoraConfig, ModelConfig, ProjectConfig, TrainConfig
from train.model import memory, offload
from train.model.qwen_image.tiny import make_tiny, write_full_size_configs

GB = memory.GB


@pytest.fixture(scope="module")
def full_model(tmp_path_factory):
    """A model directory with the released architectures' configs (no weights)."""
    out = make_tiny(tmp_path_factory.mktemp("full"), "edit_plus", num_samples=2, size=64)
    write_full_size_configs(out / "model")
    return out / "model"


@pytest.fixture(scope="module")
def v1_full_model(tmp_path_factory):
    """A Qwen-Image-Edit (v1) model directory with the released architectures' configs (no weights)."""
    out = make_tiny(tmp_path_factory.mktemp("v1"), "edit", num_samples=2, size=64)
    write_full_size_configs(out / "model")
    return out / "model"


@pytest.fixture(scope="module")
def full_sizes(full_model):
    """Sizes of the released transformer (counted on the meta device) with the default LoRA r64."""
    return memory.count_sizes(full_model, LoraConfig().target_modules, 64)


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
            assert c.offloaded > 0 and c.checkpointed >= 55
    # the prediction is the formula: a plain resident block costs A, a checkpointed one S (its recomputation
    # comes after the plain blocks' backward: test_a_recomputation_meets_only_the_checkpointed_inputs)
    none, one, two = (memory.predict(full_sizes, m, memory.Choice(True, False, n, 0, True)) for n in (0, 1, 2))
    assert none.peak_bytes - one.peak_bytes == pytest.approx(m.act_bytes - m.ckpt_bytes)
    assert one.peak_bytes - two.peak_bytes == pytest.approx(m.act_bytes - m.ckpt_bytes)
    assert two.step_s - one.step_s == pytest.approx(m.fwd_s)


def test_a_recomputation_meets_only_the_checkpointed_inputs(full_sizes):
    """The backward runs the last (plain) blocks first; the first N blocks recompute after those have freed their
    activations. So the activation peak is the larger of the two phases: with N of 60 checkpointed,
    (60 - N) A + N S + T while the plain blocks go back, N S + T_c while the checkpointed ones do (T_c measured
    with a recomputation in it). Summing them, as the plan did until 2026-12-02, over-predicted every partly
    checkpointed run on the H200 by about one block's activations (docs/performance.md, Memory)."""
    m = memory.Measured(**{**measured(12_544).__dict__, "ckpt_transient_bytes": 9 * GB})
    a, s, t, tc = m.act_bytes, m.ckpt_bytes, m.transient_bytes, 9 * GB
    for n in (1, 30, 59):
        assert memory.activation_bytes(full_sizes, m, n) == pytest.approx(max((60 - n) * a + n * s + t, n * s + tc))
        assert memory.activation_bytes(full_sizes, m, n) < (60 - n) * a + n * s + tc  # the old sum
    assert memory.activation_bytes(full_sizes, m, 60) == pytest.approx(60 * s + tc)  # only the second phase
    assert memory.activation_bytes(full_sizes, m, 0) == pytest.approx(60 * a + t)  # only the first
    # a recomputation larger than the plain blocks' activations decides the peak on its own
    big = memory.Measured(**{**m.__dict__, "ckpt_transient_bytes": 200 * GB})
    assert memory.activation_bytes(full_sizes, big, 30) == pytest.approx(30 * s + 200 * GB)


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


def test_encoding_ahead_adds_the_encode_transient_to_the_step(full_sizes, full_model):
    """data.encode_ahead: the next micro-batch encodes while this one trains, so the online peak is the step's plus
    the encode's transient E (both stream pools hold theirs); in turn the encode runs between the steps and only
    the larger of E and the activations counts. From the cache nothing encodes. run_sizes takes the key, online
    only."""
    e = 4 * GB
    m = memory.Measured(**{**measured(12_544).__dict__, "encode_bytes": e})
    in_turn = memory.Sizes(**{**full_sizes.__dict__, "encoder_bytes": int(16.6 * GB)})
    ahead = dataclasses.replace(in_turn, encode_ahead=True)
    for checkpointed, offloaded in ((0, 0), (30, 10), (60, 60)):  # activations above E in each
        online = memory.Choice(True, False, checkpointed, offloaded, False)
        grown = memory.predict(ahead, m, online).peak_bytes - memory.predict(in_turn, m, online).peak_bytes
        assert grown == pytest.approx(e)
        cached = dataclasses.replace(online, cached=True)
        assert memory.predict(ahead, m, cached).peak_bytes == memory.predict(in_turn, m, cached).peak_bytes
    # an encode larger than the step's activations: in turn it alone counts, ahead both do
    big = memory.Measured(**{**m.__dict__, "encode_bytes": 100 * GB})
    online = memory.Choice(True, False, 60, 60, False)
    acts = memory.activation_bytes(in_turn, big, 60)
    assert memory.predict(in_turn, big, online).peak_bytes == pytest.approx(
        memory.predict(in_turn, m, online).peak_bytes - acts + 100 * GB)
    assert memory.predict(ahead, big, online).peak_bytes == pytest.approx(
        memory.predict(ahead, m, online).peak_bytes + 96 * GB)
    # the plan pays for the overlap where memory is short: more blocks checkpointed, never fewer
    margin = memory.margin_bytes(0, 80 * GB)
    c_turn, _ = memory.choose(in_turn, m, 80 * GB, margin, {"data.cache": "off"}, fp8_ok=True, online=True)
    c_ahead, p_ahead = memory.choose(ahead, m, 80 * GB, margin, {"data.cache": "off"}, fp8_ok=True, online=True)
    assert c_ahead.checkpointed > c_turn.checkpointed and p_ahead.peak_bytes <= 80 * GB - margin

    def run(online: bool, key: bool) -> bool:
        project = ProjectConfig(model=ModelConfig(path=str(full_model)), data=DataConfig(encode_ahead=key))
        return memory.run_sizes(Config(project=project, deepspeed={}, world_size=1), online=online).encode_ahead

    assert run(True, True) and not run(True, False) and not run(False, True)


def test_budget_below_the_minimum_names_the_numbers(full_sizes):
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, measured(12_544), 6 * GB, 1.8 * GB, {}, fp8_ok=True, online=False)
    text = str(e.value)
    assert "6.0 GB" in text and "needs" in text and "qwen_edit.data.area" in text
    # without fp8 matmuls (an older GPU) the smallest plan is bf16 and offloaded
    c, _ = memory.choose(full_sizes, measured(8_448), 24 * GB, 2.7 * GB, {}, fp8_ok=False, online=False)
    assert not c.fp8_base and c.offloaded > 0


def test_settings_realise_the_choice():
    assert memory.settings(memory.Choice(True, True, 60, 10, True, kept_attention=40), 60) == {
        "train.fp8_base": True, "train.fp8_transposed": True, "train.gradient_checkpointing": True,
        "train.checkpoint_blocks": 0, "train.offload_blocks": 10, "train.kept_attention_blocks": 40}
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
    cache = memory.oom_advice("cache", 4)  # the build encodes one row at a time, so no micro-batch advice
    assert "python -m train.cache" in cache and "margin_gb" in cache and "micro_batch" not in cache
    assert "inference.area" in memory.oom_advice("validation", 4)
    assert "micro_batch" not in memory.oom_advice("validation", 4)
    assert memory.OutOfMemory("x").without_traceback


def test_the_step_advice_leaves_out_what_is_in_effect():
    """With the plan's settings known, the step's advice does not suggest what the run already does (its 16 GB
    choice checkpoints and offloads every block, in fp8, with DeepSpeed's optimizer offload); it says how many
    blocks are offloaded and points at the plan's margin. Without the plan, the keys to set by hand."""
    everything = memory.InEffect(True, 60, True, True, True, 0.0)
    step = memory.oom_advice("step", 1, everything)
    for already in ("gradient_checkpointing", "fp8_base", "offload_optimizer", "micro_batch"):
        assert already not in step, (already, step)
    assert "now 60" in step and "qwen_edit.memory.margin_gb (now automatic" in step and "data.area" in step
    by_hand = memory.oom_advice("step", 2, memory.InEffect(False, 0, False, False, False, 0.0))
    for lever in ("gradient_checkpointing = true", "fp8_base = true", "offload_optimizer", "memory.plan \"auto\"",
                  "train_micro_batch_size_per_gpu = 1"):
        assert lever in by_hand, (lever, by_hand)
    assert "margin_gb (now 3 GB)" in memory.oom_advice("step", 1, dataclasses.replace(everything, margin_gb=3.0))


def test_torch_oom_figures_are_shortened():
    """torch's own figures of a CUDA out-of-memory error (its message as torch 2.x words it) reach the run's
    message; an error without them adds nothing on a machine without CUDA."""
    e = RuntimeError("CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a total capacity of 139.72 GiB of "
                     "which 120.51 GiB is free. Including non-PyTorch memory, this process has 14.90 GiB memory in "
                     "use. Of the allocated memory 13.85 GiB is allocated by PyTorch, and 0.51 GiB is reserved by "
                     "PyTorch but unallocated. If reserved but unallocated memory is large ...")
    figures = memory.torch_oom_figures(e)
    assert figures.startswith(" (torch: tried to allocate 1.20 GiB; 13.85 GiB allocated and 0.51 GiB reserved but "
                              "free"), figures
    assert memory.torch_oom_figures(RuntimeError("CUDA out of memory (injected)")) == ""


def test_inference_placement_follows_the_budget(full_sizes, full_model):
    """train.infer's placement for the released 2509 (40.9 GB transformer, 16.6 GB Qwen2.5-VL): everything on the
    GPU; else the encoders first and the transformer's first blocks streamed, as few as the room allows (Qwen2.5-VL
    streamed too where it does not fit); else diffusers' layer-by-layer offload."""
    s = full_sizes
    parts = {"transformer": (s.num_blocks * s.block_params + s.other_params) * 2,
             "text encoder": memory.component_bytes(full_model, "text_encoder"),
             "VAE": memory.component_bytes(full_model, "vae")}
    block, streamed = s.block_params * 2, memory.streamed_vl_bytes(full_model)
    assert parts["text encoder"] / GB == pytest.approx(16.6, abs=0.1) and streamed / GB < 4

    def placed(budget_gb):
        budget = budget_gb * GB
        return memory.inference_placement(parts, block, s.num_blocks, budget, memory.margin_bytes(0, budget), streamed)

    assert placed(141) == memory.InferencePlacement("none")
    # 80 GB: 57.7 GB of models + 6 GB + 5.5 GB margin fit; 64 GB: the transformer alone fits after the encoders
    assert placed(80) == memory.InferencePlacement("none")
    assert placed(64) == memory.InferencePlacement("blocks", 0, False)
    # the rest of the transformer after the room: (room - embeddings and VAE - 2 slots) // 0.68 GB blocks resident
    for budget_gb in (48, 24, 16):
        room = budget_gb * GB - memory.margin_bytes(0, budget_gb * GB) - memory.INFERENCE_ACTIVATION_BYTES
        fixed = parts["transformer"] - s.num_blocks * block + parts["VAE"]
        resident = int((room - fixed - 2 * block) // block)
        assert placed(budget_gb) == memory.InferencePlacement("blocks", 60 - resident, budget_gb < 24 + 1), budget_gb
    assert [placed(b).offload_blocks for b in (48, 24, 16)] == [7, 40, 52]  # the figures README.md quotes
    assert placed(8) == memory.InferencePlacement("sequential")  # not even the streamed encoder fits with 6 GB
    # larger renders keep more room: 3 references at 2 MP are 32k tokens, 2.6x the measured shape's allowance
    assert memory.inference_tokens(2, 1024 * 1024) == 12_288 and memory.inference_allowance(12_288) == 6 * GB
    big = memory.inference_tokens(3, 2 * 1024 * 1024)
    assert memory.inference_allowance(big) == pytest.approx(6 * GB * big / 12_500)
    budget = 48 * GB
    wide = memory.inference_placement(parts, block, s.num_blocks, budget, memory.margin_bytes(0, budget), streamed,
                                      tokens=big)
    assert wide.offload_blocks - placed(48).offload_blocks == pytest.approx((memory.inference_allowance(big) - 6 * GB)
                                                                           / block, abs=1)
    # each process pins its own streamed copy: 40 blocks (27 GB) fit 48 GB of host memory once, not twice
    room = 48 * GB
    budget = 24 * GB
    args = (parts, block, s.num_blocks, budget, memory.margin_bytes(0, budget), streamed)
    assert memory.inference_placement(*args, memory.Host(room, 1)).offload_blocks == 40
    with pytest.raises(memory.PlanError, match=r"needs 54\.\d GB of pinned host memory on this node \(2 process"):
        memory.inference_placement(*args, memory.Host(room, 2))


def test_explicit_keys_of_a_config(tmp_path):
    from train import config

    path = tmp_path / "c.json"
    path.write_text('{"qwen_edit": {"inference": {"cpu_offload": "none"}, "memory": {"budget_gb": 24}}}')
    assert config.explicit_keys(path) == {"inference.cpu_offload", "memory.budget_gb"}
    assert config.explicit_keys(None) == set()


def test_optimizer_offload_is_the_last_resort(full_sizes):
    """At 16 GB only DeepSpeed's optimizer offload fits 8.4k tokens (the LoRA r64 state, 6.8 GB, is what does not):
    it is chosen, its predicted peak is the same setting's without it minus 14 bytes per LoRA parameter, and the
    host step is charged; at 24 GB a setting without it fits, and it is not chosen."""
    m = measured(8_448)
    margin = memory.margin_bytes(0, 16 * GB)
    c, p = memory.choose(full_sizes, m, 16 * GB, margin, {}, fp8_ok=True, online=False)
    assert c.offload_optimizer and p.peak_bytes <= 16 * GB - margin
    on_gpu = memory.predict(full_sizes, m, memory.Choice(c.fp8_base, c.fp8_transposed, c.checkpointed, c.offloaded,
                                                         c.cached))
    lowered = full_sizes.lora_params * (memory.state_bytes_per_param(False, 2, 1, False)
                                        - memory.state_bytes_per_param(False, 2, 1, True))
    assert on_gpu.peak_bytes - p.peak_bytes == pytest.approx(lowered)
    assert lowered == pytest.approx(5.95 * GB, rel=0.01)
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
    ds, roomy = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}, memory.Host(64 * GB)
    assert memory.offload_blocker(ds, full_sizes, roomy) is None
    assert memory.offload_blocker({**ds, "optimizer": {"type": "Adam"}}, full_sizes, roomy) is None
    lion = memory.offload_blocker({**ds, "optimizer": {"type": "Lion"}}, full_sizes, roomy)
    assert 'optimizer.type "Lion"' in lion and "AdamW" in lion
    assert "stage is 0" in memory.offload_blocker({"optimizer": {"type": "AdamW"}}, full_sizes, roomy)
    # 425 M parameters: 7.6 GB at 18 bytes, 8.8 GB as torch pins it (host_state_bytes), against 8 GB less its
    # margin (2 GB per process and 5%): 5.6 GB
    host = memory.offload_blocker(ds, full_sizes, memory.Host(8 * GB))
    assert "8.8 GB of host memory" in host and "8.0 GB is available, less a 2.4 GB margin" in host
    assert memory.offload_blocker(ds, full_sizes, memory.Host(8 * GB, 1, 2)) is None  # half each: 4.4 GB
    assert memory.offload_blocker(ds, full_sizes, memory.Host(8 * GB, 2, 2))  # both ranks on this node
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, measured(8_448), 16 * GB, 2.3 * GB, {}, fp8_ok=True, online=False,
                      offload_blocker=lion)
    text = str(e.value)
    assert "nothing fits the memory budget: 16.0 GB" in text and "needs 18.6 GB" in text  # the best without it
    assert "optimizer offload (zero_optimization.offload_optimizer) the run would fit" in text
    assert "needs 12.6 GB, of 13.7 GB" in text and 'optimizer.type "Lion"' in text
    with pytest.raises(memory.PlanError) as e:  # too small even with the offload: said so
        memory.choose(full_sizes, measured(8_448), 12 * GB, 2.1 * GB, {}, fp8_ok=True, online=False,
                      offload_blocker=lion)
    assert "would still not fit" in str(e.value)


def test_pinned_host_bytes_are_what_the_offloader_pins(tiny_plus):
    """moved_bytes is the size of an offloaded block's host buffer (train/model/offload.py), bf16-sized and fp8, up to
    the offloader's 256-byte alignment of each tensor."""
    import torch

    from train.model import offload, prepare

    lora = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"])
    s = memory.count_sizes(tiny_plus / "model", lora.target_modules, lora.rank)
    for fp8_base in (False, True):
        _, offloader = prepare.load_for_training(tiny_plus / "model", torch.float32, torch.device("cpu"), "lora",
                                                    lora, True, False, fp8_base, 0, False, offload_blocks=2)
        tensors = sum(len(layout.entries) for layout in offloader.layouts.values())
        expected = 2 * memory.moved_bytes(s, fp8_base, dtype_bytes=4)
        assert expected <= offloader.host_bytes <= expected + tensors * offload.ALIGN, fp8_base


def test_offloaded_blocks_count_against_the_host(full_sizes):
    """Every process pins its own offloaded blocks: P x K x a block's fp8 matrices (0.34 GB) per node, plus the
    offloaded optimizer's partitions. A host that cannot hold the plan's choice gets a plan with fewer offloaded
    blocks (a slower step, never more offload than fits); when no setting that fits the GPU fits the host, the
    refusal has the host's figures and what to change."""
    m = measured(8_448)
    budget = 24 * GB
    margin = memory.margin_bytes(0, budget)
    free, p_free = memory.choose(full_sizes, m, budget, margin, {}, fp8_ok=True, online=False)
    assert free.offloaded > 40 and not free.offload_optimizer
    block = memory.moved_bytes(full_sizes, True)
    assert block == pytest.approx(0.34 * GB, rel=0.01) and memory.moved_bytes(full_sizes, False) == 2 * block
    one = memory.Host(64 * GB, ranks_per_node=1, world_size=1)
    assert memory.host_bytes(full_sizes, free, one) == free.offloaded * block
    eight = memory.Host(500 * GB, ranks_per_node=8, world_size=8)
    assert memory.host_bytes(full_sizes, free, eight) == 8 * free.offloaded * block
    both = memory.Choice(True, False, 60, 10, True, offload_optimizer=True)
    state = 8 * memory.host_state_bytes(full_sizes.lora_params, 8)  # split over the world, all of it on one node
    assert memory.host_bytes(full_sizes, both, eight) == pytest.approx(8 * 10 * block + state)
    assert eight.margin_bytes == pytest.approx(8 * 2 * GB + 25 * GB) and memory.Host().margin_bytes == 0
    # a roomy host changes nothing
    assert memory.choose(full_sizes, m, budget, margin, {}, True, False, host=eight) == (free, p_free)
    # eight processes on a host whose room (125 GB) is short of their 8 x 52 blocks (141 GB): another candidate,
    # fewer blocks each beside the optimizer's offloaded state (8.8 GB on the node), a slower step
    short = memory.Host((125 * GB + 16 * GB) / 0.95, ranks_per_node=8, world_size=8)
    assert short.room_bytes == pytest.approx(125 * GB)
    c, p = memory.choose(full_sizes, m, budget, margin, {}, True, False, host=short)
    assert 0 < c.offloaded < free.offloaded and c.offload_optimizer and p.peak_bytes <= budget - margin
    assert p.step_s + p.optimizer_s > p_free.step_s
    assert memory.host_bytes(full_sizes, c, short) <= short.room_bytes < memory.host_bytes(full_sizes, free, short)
    # eight processes on 100 GB: nothing that fits the GPU fits the host
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, m, budget, margin, {}, True, False, host=memory.Host(100 * GB, 8, 8))
    text = str(e.value)
    assert text.startswith("nothing fits this node's host memory: only settings that pin host memory fit the GPU "
                           "budget (24.0 GB")
    assert "8 training process(es) on this node x 35 offloaded blocks x 0.34 GB (fp8 weights)" in text
    assert "+ 8.8 GB of DeepSpeed's offloaded optimizer state" in text  # the least host memory of those: with it
    assert "100.0 GB is available, less a 21.0 GB margin" in text
    for fix in ("deepspeed --num_gpus", "qwen_edit.memory.budget_gb", 'data.cache "auto"', "data.num_workers"):
        assert fix in text, fix
    assert "offload_blocks = " not in text  # not set in the config: nothing to unpin
    # a budget where nothing needs offloading never asks the host
    c80, _ = memory.choose(full_sizes, m, 80 * GB, memory.margin_bytes(0, 80 * GB), {}, True, False,
                           host=memory.Host(1 * GB, 8, 8))
    assert c80.offloaded == 0 and not c80.offload_optimizer


def test_an_explicit_offload_count_that_the_host_cannot_hold_names_the_key(full_sizes, full_model):
    """train.offload_blocks set in the config: with the plan, a refusal that names the key; with memory.plan off
    (the config as written), check_offload_host stops the run before loading, naming it; a count that fits passes."""
    from train.config import Config, ProjectConfig

    m = measured(8_448)
    host = memory.Host(64 * GB, ranks_per_node=4, world_size=4)
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full_sizes, m, 24 * GB, 2.7 * GB, {"train.offload_blocks": 60}, True, False, host=host)
    text = str(e.value)
    assert "x 60 offloaded blocks" in text and "qwen_edit.train.offload_blocks = 60 is set in the config" in text

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    cfg = Config(project=ProjectConfig(), deepspeed=ds, explicit=frozenset({"train.offload_blocks"}))
    cfg.project.model.path = str(full_model)
    cfg.project.train.offload_blocks, cfg.project.train.fp8_base = 40, True
    with pytest.raises(memory.PlanError) as e:
        memory.check_offload_host(cfg, host)  # 4 x 40 x 0.34 GB = 54.4 GB of 64 - 11.2
    text = str(e.value)
    assert text.startswith("qwen_edit.train.offload_blocks = 40 does not fit this node's host memory")
    assert "54.4 GB of pinned host memory (4 training process(es) on this node x 40 offloaded blocks" in text
    assert "deepspeed --num_gpus" in text
    cfg.project.train.offload_blocks = 20
    memory.check_offload_host(cfg, host)  # 27.2 GB: fits
    cfg.deepspeed["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # + 7.6 GB of optimizer state
    memory.check_offload_host(cfg, host)
    with pytest.raises(memory.PlanError, match="offloaded optimizer state"):
        memory.check_offload_host(cfg, memory.Host(40 * GB, 4, 4))
    cfg.project.train.offload_blocks = 0
    memory.check_offload_host(cfg, memory.Host(0, 8, 8))  # nothing offloaded: nothing to check


def test_node_host_is_the_smallest_any_rank_sees(monkeypatch):
    monkeypatch.setattr(memory, "_host_available", lambda: 123 * GB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(offload, "shm_free_bytes", lambda: 30 * GB)
    assert memory.node_host(8) == memory.Host(123 * GB, 4, 8, 30 * GB)


# ---------------------------------------------------------------- validation renders


def with_render(m: memory.Measured, forward: float, vae: float, vae_tiled: float) -> memory.Measured:
    return memory.Measured(**{**m.__dict__, "render_forward_bytes": forward, "render_vae_bytes": vae,
                              "render_vae_tiled_bytes": vae_tiled})


@pytest.fixture(scope="module")
def render_sizes(full_sizes):
    """The released transformer with the VAE's 127 M parameters counted (a render from the cache loads it)."""
    return memory.Sizes(**{**full_sizes.__dict__, "vae_bytes": int(0.254 * GB)})


def test_a_render_that_fits_changes_nothing(render_sizes):
    """Validation off: no tiling is planned (settings() has no inference.vae_tiling). A render that fits every
    budget: the same training settings as without it, decoded untiled."""
    for tokens, budget in ((8_448, 141), (8_448, 24), (12_544, 80), (12_544, 48)):
        margin = memory.margin_bytes(0, budget * GB)
        off, p_off = memory.choose(render_sizes, measured(tokens), budget * GB, margin, {}, fp8_ok=True, online=False)
        assert off.vae_tiling is None and p_off.render_peak_bytes == 0
        assert "inference.vae_tiling" not in memory.settings(off, 60)
        on, p_on = memory.choose(render_sizes, with_render(measured(tokens), 0.5 * GB, 0.8 * GB, 0.3 * GB),
                                 budget * GB, margin, {}, fp8_ok=True, online=False)
        assert on == memory.Choice(**{**off.__dict__, "vae_tiling": False})
        assert p_on.peak_bytes == p_off.peak_bytes and p_on.step_s == p_off.step_s
        assert 0 < p_on.render_peak_bytes < p_on.peak_bytes
        assert memory.settings(on, 60)["inference.vae_tiling"] is False


def test_the_render_peak_enters_the_choice(render_sizes):
    """At 24 GB the step fits, but an untiled 1 MP decode does not: the plan tiles the decode and keeps the step;
    with inference.vae_tiling fixed false it pays with the step (more blocks offloaded) instead, and says so."""
    budget, tokens = 24 * GB, 8_448
    margin = memory.margin_bytes(0, budget)
    room = budget - margin
    step_only, p0 = memory.choose(render_sizes, measured(tokens), budget, margin, {}, fp8_ok=True, online=False)
    # what the step's choice keeps on the GPU during a render, with the VAE: the untiled decode gets 0.5 GB too much
    kept = memory.predict(render_sizes, with_render(measured(tokens), 0, 0, 0),
                          memory.Choice(**{**step_only.__dict__, "vae_tiling": False})).render_peak_bytes
    m = with_render(measured(tokens), 1.2 * GB, room - kept + 0.5 * GB, 0.9 * GB)
    c, p = memory.choose(render_sizes, m, budget, margin, {}, fp8_ok=True, online=False)
    assert c == memory.Choice(**{**step_only.__dict__, "vae_tiling": True})
    assert p.step_s == p0.step_s and p.render_peak_bytes <= room and p.peak_bytes <= room
    note = memory.render_note(render_sizes, m, c, p, budget, margin, {}, fp8_ok=True, online=False)
    assert "inference.vae_tiling = true, which the plan chose" in note and "untiled it would need" in note
    assert memory.settings(c, 60)["inference.vae_tiling"] is True and "decode tiled" in memory.describe(c, 60)

    fixed = {"inference.vae_tiling": False}
    c2, p2 = memory.choose(render_sizes, m, budget, margin, fixed, fp8_ok=True, online=False)
    assert c2.vae_tiling is False and p2.fit_bytes <= room
    assert p2.step_s > p0.step_s and (c2.offloaded > step_only.offloaded or not c2.fp8_transposed)
    note = memory.render_note(render_sizes, m, c2, p2, budget, margin, fixed, fp8_ok=True, online=False)
    assert "the renders set this plan" in note and "set false in the config" in note
    assert "inference.vae_tiling = true" in note and "inference.area" in note  # the keys that lower a render

    # when only the renders cannot fit, the refusal says so and names their keys
    huge = with_render(measured(tokens), 1.2 * GB, float("inf"), room)
    with pytest.raises(memory.PlanError) as e:
        memory.choose(render_sizes, huge, budget, margin, {}, fp8_ok=True, online=False)
    text = str(e.value)
    assert "with validation renders" in text and "the training step fits" in text
    assert "inference.vae_tiling = true" in text and "validation.file" in text


def test_a_render_counts_what_it_loads(render_sizes):
    """From the cache a render loads the VAE beside the model; online the encoders are there already (the VAE is
    among them). The forward and the decode do not coexist: the larger of the two counts."""
    m = with_render(measured(8_448), 2 * GB, 3 * GB, 1 * GB)
    s = memory.Sizes(**{**render_sizes.__dict__, "encoder_bytes": int(16.6 * GB)})

    def render(cached: bool, tiled: bool, mm=m) -> float:
        return memory.predict(s, mm, memory.Choice(True, True, 60, 40, cached, vae_tiling=tiled)).render_peak_bytes

    assert render(False, False) - render(True, False) == pytest.approx(16.6 * GB - 0.254 * GB)
    assert render(True, False) - render(True, True) == pytest.approx(1 * GB)  # tiled: the forward's 2 GB counts
    more = with_render(measured(8_448), 2 * GB, 5 * GB, 1 * GB)
    assert render(True, False, more) - render(True, False) == pytest.approx(2 * GB)


def test_render_workload_is_the_pipelines_sizes():
    """Target sized from the last reference, every reference at inference.area, batch 1."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    w = memory.render_workload([[(1024, 1024), (1024, 1024)], [(512, 512)]], "edit_plus", 1024 * 1024, 384 * 384)
    assert w == memory.Workload(1, 3 * 64 * 64, (128, 128), 320 + 2 * 188)
    wide = memory.render_workload([[(1024, 1024), (2000, 1000)]], "edit_plus", 1024 * 1024, 384 * 384)
    width, height = calculate_dimensions(1024 * 1024, 2.0)  # the pipeline's own sizing: 1440 x 736 px
    assert wide.target_hw == (height // 8, width // 8) == (92, 180)
    assert wide.image_tokens == 2 * (height // 16) * (width // 16) + 64 * 64
    t2i = memory.render_workload([[]], "t2i", 512 * 512, 384 * 384)
    assert t2i == memory.Workload(1, 32 * 32, (64, 64), 320)


def test_vae_tiling_is_planned_unless_the_config_sets_it():
    from train.config import Config, ProjectConfig

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    cfg = Config(project=ProjectConfig(), deepspeed=ds)
    memory.apply(cfg, memory.Choice(True, True, 0, 0, True, vae_tiling=True), 60)
    assert cfg.project.inference.vae_tiling is True
    pinned = Config(project=ProjectConfig(), deepspeed=ds, explicit=frozenset({"inference.vae_tiling"}))
    assert memory.fixed_settings(pinned)["inference.vae_tiling"] is False
    memory.apply(pinned, memory.Choice(True, True, 0, 0, True, vae_tiling=True), 60)
    assert pinned.project.inference.vae_tiling is False
    off = Config(project=ProjectConfig(), deepspeed=ds)
    memory.apply(off, memory.Choice(True, True, 0, 0, True), 60)  # validation off: left as it is
    assert off.project.inference.vae_tiling is False and "tiled" not in memory.describe(
        memory.Choice(True, True, 0, 0, True), 60)


def test_fast_accumulation_comes_with_the_planned_fp8_base_unless_the_config_sets_it():
    """apply() turns train.fp8_fast_accum on with an fp8 base (docs/perf_notes.md lever 29), leaves a bf16 base's
    off, and keeps the key where the config sets it, either way."""
    from train.config import Config, ProjectConfig

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    fp8, bf16 = memory.Choice(True, True, 0, 0, True), memory.Choice(False, False, 0, 0, True)
    planned = Config(project=ProjectConfig(), deepspeed=ds)
    memory.apply(planned, fp8, 60)
    assert planned.project.train.fp8_base and planned.project.train.fp8_fast_accum
    plain = Config(project=ProjectConfig(), deepspeed=ds)
    memory.apply(plain, bf16, 60)
    assert not plain.project.train.fp8_base and not plain.project.train.fp8_fast_accum
    exact = Config(project=ProjectConfig(), deepspeed=ds, explicit=frozenset({"train.fp8_fast_accum"}))
    memory.apply(exact, fp8, 60)
    assert exact.project.train.fp8_base and not exact.project.train.fp8_fast_accum


def test_block_times_alternate_the_models_and_take_the_median_of_paired_differences(monkeypatch):
    """memory._run alternates its models pass by pass, leaves out the warm-up rounds (the first compiles) and keeps
    every timed pass, so that measure takes a block's time as the median of the paired differences of one round:
    a drift of the GPU's clocks during the measurement, or one slow pass, does not move the plan's step (perf_notes
    M8); the bytes are each model's last pass. CUDA's counters and the clock are driven by the test."""
    import itertools

    import torch

    from tests.conftest import FakeCudaCounter

    counter = FakeCudaCounter()
    counter.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counter.allocated)
    passes = itertools.count(1)
    order = []

    class Block(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name, self.w = name, torch.nn.Parameter(torch.ones(3))

        def forward(self, x):  # pass n keeps n bytes to the backward, which needs 10 n more at its peak
            n = next(passes)
            order.append(self.name)
            counter.allocate(n)

            def backward(grad):
                counter.allocate(10 * n)
                counter.free(11 * n)
                return grad

            out = self.w * x
            out.register_hook(backward)
            return (out,)

    # (forward ms, forward + backward ms) of the 2 warm-up and 5 timed rounds, one pass per model each: the clock
    # slows for rounds 5 and 6 (both models alike), and the two-block model's fourth timed pass is slow
    one = [(900, 2000), (40, 90), (10, 30), (10, 30), (30, 70), (30, 70), (10, 30)]
    two = [(900, 2000), (40, 90), (16, 46), (16, 46), (36, 86), (90, 300), (16, 46)]
    clock = iter(t / 1000 for pair in zip(one, two, strict=True) for f, b in pair for t in (0, f, b))
    monkeypatch.setattr(memory.time, "perf_counter", lambda: next(clock))
    (k1, t1, f1, b1), (k2, t2, f2, b2) = memory._run([Block("one"), Block("two")], {"x": torch.ones(3)},
                                                     torch.device("cpu"))
    assert order == ["one", "two"] * 7
    assert f1 == pytest.approx([0.01, 0.01, 0.03, 0.03, 0.01]) and len(b2) == 5  # the warm-up rounds left out
    assert memory._median_difference(f2, f1) == pytest.approx(0.006)
    assert memory._median_difference(b2, b1) == pytest.approx(0.016)
    assert (k1, t1, k2, t2) == (13, 130, 14, 140)  # each model's last pass: the 13th and 14th
    assert next(passes) == 15 and next(clock, None) is None


def test_measure_render_runs_the_render_parts(tiny_plus, monkeypatch):
    """The GPU measurement's code path on the tiny model (CPU): a one-block transformer forward without gradients
    at the render's tokens, then the VAE decoding (online: and encoding) untiled and tiled. The byte counting
    itself needs CUDA; here each call reports its output's size."""
    import torch

    calls = []

    def peak_above(device, call, repeats=2):
        with torch.no_grad():
            out = call()
        calls.append(tuple(out.shape))
        return float(out.numel())

    monkeypatch.setattr(memory, "peak_above", peak_above)
    w = memory.render_workload([[(64, 64), (64, 64)]], "edit_plus", 64 * 64, 32 * 32)
    m = memory.measure_render(measured(100), tiny_plus / "model", w, torch.float32, torch.float32,
                              torch.device("cpu"), "lora", LoraConfig(rank=4), fp8_base=False, online=True)
    h, wd = w.target_hw
    # the transformer's packed target + references (_inputs lays the references out as one near-square grid)
    assert calls[0][0] == 1 and 0.9 * w.image_tokens <= calls[0][1] <= w.image_tokens == 16 + 2 * 16
    assert calls[1][-2:] == (h * 8, wd * 8) and calls[2][-2:] == (h, wd)  # decode, encode (untiled)
    assert len(calls) == 5 and m.render_forward_bytes == calls[0][0] * calls[0][1] * calls[0][2]
    assert m.render_vae_bytes == m.render_vae_tiled_bytes > 0  # below the tile size the two are the same


def test_the_vae_measurements_take_the_configured_path(tiny_plus, monkeypatch):
    """model.vae_2d_frames reaches the VAE that the render and encode measurements load: with it off they measure
    diffusers' own path (its chunk cache is larger), so a plan never counts the smaller transient for it."""
    import torch

    from train.model.qwen_image import components, vae_frames

    seen = []
    load = components.load_vae

    def load_vae(*args, **kwargs):
        vae = load(*args, **kwargs)
        seen.append(vae_frames.is_applied(vae))
        return vae

    monkeypatch.setattr(components, "load_vae", load_vae)
    monkeypatch.setattr(memory, "peak_above", lambda device, call, repeats=2: 1.0)
    w = memory.render_workload([[(64, 64)]], "edit_plus", 64 * 64, 32 * 32)
    for on in (True, False):
        memory.measure_render(measured(100), tiny_plus / "model", w, torch.float32, torch.float32,
                              torch.device("cpu"), "lora", LoraConfig(rank=4), False, True, vae_2d_frames=on)
        memory.encode_transient(tiny_plus / "model", torch.device("cpu"), memory.Workload(1, 0, (8, 8), 0), on)
    assert seen == [True, True, False, False]


def test_validation_workload_reads_the_files_images(tmp_path):
    """validation.file's references are sized from their headers: the widest edit sets the render's tokens."""
    from PIL import Image

    from train.config import ProjectConfig

    Image.new("RGB", (640, 320)).save(tmp_path / "wide.png")
    Image.new("RGB", (300, 300)).save(tmp_path / "square.png")
    (tmp_path / "val.jsonl").write_text('{"edit_image": "square.png", "prompt": "a"}\n'
                                        '{"edit_image": ["square.png", "wide.png"], "prompt": "b"}\n')
    p = ProjectConfig()
    p.validation.file = str(tmp_path / "val.jsonl")
    p.inference.area = 256 * 256
    w = memory.validation_workload(p, "edit_plus")
    assert w == memory.render_workload([[(300, 300)], [(300, 300), (640, 320)]], "edit_plus", 256 * 256,
                                       p.inference.condition_area)
    # the target follows the last (wide) reference; two references in the prompt bound
    assert w.target_hw[1] > w.target_hw[0] and w.text_tokens == 320 + 2 * p.inference.condition_area // 784


# ---------------------------------------------------------------- the cache build's encoders


def test_streamed_vl_bytes_are_what_stays_outside_the_blocks(full_model):
    """Qwen2.5-VL-7B streamed by block: every parameter but the decoder layers' and ViT blocks' matrices
    (embeddings, lm_head, patch embedding, merger, vectors) plus two slots of each list's largest block, in bf16;
    counted again here by name."""
    import re

    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        vl = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(full_model / "text_encoder"))
    block = re.compile(r"\.(layers|blocks)\.(\d+)\.")
    per_block, stays = {}, 0
    for name, t in vl.named_parameters():
        m = block.search(name)
        if m and t.dim() >= 2:
            per_block[m.groups()] = per_block.get(m.groups(), 0) + t.numel()
        else:
            stays += t.numel()
    assert len(per_block) == 28 + 32  # the released model's decoder layers and ViT blocks
    slots = sum(2 * max(n for (kind, _), n in per_block.items() if kind == k) for k in ("layers", "blocks"))
    expected = 2 * (stays + slots)
    assert memory.streamed_vl_bytes(full_model) == expected
    assert 2.5 * GB < expected < 4 * GB < memory.component_bytes(full_model, "text_encoder") / 4


def test_the_cache_build_streams_the_vl_encoder_only_when_it_must():
    """Resident needs 16.6 + 0.25 + 2 GB; at a 13.7 GB room the streamed 3.2 GB fits, and its line has the
    numbers; a room below the streamed need, or a host that cannot pin each process's copy, is a PlanError."""
    need = {"vl": 16.6 * GB, "vae": 0.25 * GB, "encode": 2 * GB, "streamed": 3.2 * GB}
    host = memory.Host(120 * GB, ranks_per_node=1, world_size=1)
    line = memory.cache_vl_decision(need, 13.7 * GB, 16 * GB, host)
    assert line.startswith("latent cache: Qwen2.5-VL 16.6 GB + VAE 0.2 GB + the largest encode 2.0 GB do not fit "
                           "the 13.7 GB that qwen_edit.memory.budget_gb 16.0 leaves")
    assert "streamed block by block from 16.6 GB of pinned host memory" in line and "3.2 GB of it on the GPU" in line
    with pytest.raises(memory.PlanError, match="needs 3.2 GB on the GPU") as e:
        memory.cache_vl_decision(need, 5 * GB, 8 * GB, host)
    assert "python -m train.cache" in str(e.value)
    with pytest.raises(memory.PlanError, match=r"132.8 GB of pinned host memory on this node \(8 process"):
        memory.cache_vl_decision(need, 13.7 * GB, 16 * GB, memory.Host(120 * GB, ranks_per_node=8, world_size=8))


def _live_bytes(params=(), dtype=None, excluded=frozenset()) -> int:
    """Bytes of every tensor storage alive in this process (each storage once), or only of tensors of `dtype`, less
    the storages whose data pointers are `excluded`: the tensors Python holds, and the gradients of `params`
    (autograd makes them in C++, where gc does not see them until they are read)."""
    import gc

    import torch

    gc.collect()
    seen = {}
    for obj in [*gc.get_objects(), *(p.grad for p in params)]:
        if isinstance(obj, torch.Tensor) and not obj.is_meta and dtype in (None, obj.dtype):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in seen.items() if ptr and ptr not in excluded)


def _step_transient(step) -> int:
    """The peak of the bytes `step()` allocates above what was alive when it began (torch's profiler counts every
    CPU allocation and free while it runs)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return max([0] + [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"])


def _zero_state_per_param(rank: int, world: int, port: int, stage: int, queue) -> None:
    """One rank of test_zero_state_bytes_are_deepspeeds_buffers: this rank's bytes per trainable parameter under
    ZeRO `stage` when the backward's gradients are all there (before DeepSpeed reduces them), after the backward,
    and at the peak of the optimizer step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    base = _live_bytes()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": stage == 2,
                                    "reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()  # the Adam moments exist from here on
    engine.optimizer.optimizer.step = lambda *a, **k: None  # the GPU's FusedAdam updates in place: no allocation
    seen = {}
    reduce = getattr(engine.optimizer, "reduce_gradients", None)
    if reduce is not None:
        def measured_reduce(*a, **k):
            seen["before_reduce"] = _live_bytes(engine.module.parameters()) - base
            return reduce(*a, **k)
        engine.optimizer.reduce_gradients = measured_reduce
    engine.backward(engine(x).float().square().mean())
    seen["after_backward"] = _live_bytes(engine.module.parameters()) - base
    seen["in_step"] = seen["after_backward"] + _step_transient(engine.step)
    queue.put((rank, {k: v / n for k, v in seen.items()}))
    torch.distributed.destroy_process_group()


def _spawn_ranks(world: int, target, *args) -> dict:
    """Run target(rank, world, port, *args, queue) in `world` spawned processes; rank -> what each put."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < world:
        try:
            rank, out = queue.get(timeout=2)
            results[rank] = out
        except queues.Empty:
            assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.terminate()
    return results


def test_zero_state_bytes_are_deepspeeds_buffers():
    """The plan's bytes per trainable parameter (state_bytes_per_param) against DeepSpeed's own buffers on 2 ranks
    (gloo, bf16, its ZeRO optimizer as the trainer builds it): at the backward's peak (every gradient there, before
    the reduction) and in the optimizer step, for stages 0, 1 and 2. Stage 0 holds everything on every rank;
    stages 1 and 2 split the master weights and moments (stage 2 the gradients too)."""
    world = 2
    for stage in (0, 1, 2):
        for rank, seen in _spawn_ranks(world, _zero_state_per_param, stage).items():
            backward = memory.state_bytes_per_param(False, stage, world, False)
            in_step = memory.state_bytes_per_param(False, stage, world, False, in_step=True)
            peak = max(seen.get("before_reduce", 0), seen["after_backward"])
            assert peak == pytest.approx(backward, abs=0.05), (rank, stage, seen)
            assert seen["in_step"] == pytest.approx(in_step, abs=0.05), (rank, stage, seen)
    assert memory.state_bytes_per_param(False, 2, 1, False) == 16  # one GPU: what the single-GPU plan counted


def _bucket_buffers(rank: int, world: int, port: int, zero: dict, queue) -> None:
    """One rank of test_the_counted_buckets_are_deepspeeds: the largest total of DeepSpeed's gradient bucket buffers
    seen at any module's backward, over two steps, with the zero_optimization section `zero`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seen = [0]

    def hook(*args):
        buckets = getattr(engine.optimizer, "ipg_buckets", {})
        seen.append(sum(t.numel() * t.element_size() for b in buckets.values() for t in b.buffer))

    for layer in engine.module:
        layer.register_full_backward_hook(hook)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    queue.put((rank, max(seen)))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage,overlap,contiguous,offload", [
    (0, True, True, False), (1, False, True, False), (1, True, True, True), (2, True, True, False),
    (2, False, True, False), (2, True, False, False), (2, True, False, True), (2, False, False, True)])
def test_the_counted_buckets_are_deepspeeds(stage, overlap, contiguous, offload):
    """The plan's gradient buckets (Sizes.bucket_bytes from the config's zero_optimization) against the buffers
    DeepSpeed allocates while the backward runs: two with overlap_comm (zero2.json's), one without, none without
    contiguous gradients unless its optimizer offload turns them on, none at stage 0. A 16 GB plan that counted one
    of zero2.json's two 0.4 GB buckets chose a setting that ran out of memory at step 1 (docs/performance.md)."""
    zero = {"stage": stage, "overlap_comm": overlap, "contiguous_gradients": contiguous,
            "reduce_bucket_size": 30_000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    sizes = memory.Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=stage, **memory.bucket_sizes({"zero_optimization": zero}))
    for rank, seen in _spawn_ranks(1, _bucket_buffers, zero).items():
        assert seen == sizes.bucket_bytes(offload), (rank, seen, sizes)
    if stage == 2 and overlap and contiguous:
        assert seen == 2 * 30_000 * 2  # two bf16 buckets: the case the shipped zero2.json runs


def _offloaded_device_bytes(rank: int, world: int, port: int, stage: int, queue) -> None:
    """One rank of test_offloaded_optimizer_device_bytes_are_deepspeeds: under DeepSpeed's optimizer offload the
    device side is bf16 (weights, gradients, the reduction bucket) and the host side fp32 (master, gradients,
    moments) plus two bf16 buffers of its own, left out here by name: the pinned copy of the updated weights
    (counted by host_state_bytes) and a staging buffer of the largest parameter's size (its device twin,
    temp_grad_buffer_for_gpu_offload, is left out too: a constant, 75 MB at full size, like the bucket). Bytes per
    parameter of the rest above the process's before the model, at each reduction (stage 2 reduces bucket by
    bucket during the backward, stage 1 once after it) and after the backward: the largest."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                                    "reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    opt = engine.optimizer
    buffers = [*opt.param_buffer_of_bit16_for_cpu_offload_groups, opt.temp_grad_buffer_for_cpu_offload,
               opt.temp_grad_buffer_for_gpu_offload]
    left_out = frozenset(t.untyped_storage().data_ptr() for t in buffers)
    params = list(engine.module.parameters())

    def device_bytes() -> int:
        return _live_bytes(params, torch.bfloat16, left_out)

    seen = []
    name = "reduce_ipg_grads" if stage == 2 else "reduce_gradients"
    reduce = getattr(opt, name)

    def measured_reduce(*a, **k):
        seen.append(device_bytes())
        return reduce(*a, **k)

    setattr(opt, name, measured_reduce)
    engine.backward(engine(x).float().square().mean())
    seen.append(device_bytes())
    queue.put((rank, {"weights": sum(p.numel() * 2 for p in params) / n, "peak": max(seen) / n,
                      "largest": max(p.numel() * 2 for p in params) / n, "reductions": len(seen) - 1}))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_optimizer_device_bytes_are_deepspeeds(stage):
    """Under optimizer offload the plan counts on each GPU, per trainable parameter, its bf16 weight (a LoRA
    parameter's) and at stage 1 its bf16 gradient; at stage 2 DeepSpeed frees each gradient once its bucket has gone
    to the host, so none is counted (the bucket is, apart), beyond the one gradient autograd has just made and its
    hook has not yet copied into the bucket (at most the largest parameter's: 75 MB at full size, within the margin).
    Against DeepSpeed on 2 ranks; the H200 showed the same at full size (docs/performance.md "The last resort")."""
    for rank, seen in _spawn_ranks(2, _offloaded_device_bytes, stage).items():
        assert seen["weights"] == 2 and seen["reductions"] >= 1, seen
        counted = memory.state_bytes_per_param(False, stage, 2, True) + (seen["largest"] if stage == 2 else 0)
        assert seen["peak"] == pytest.approx(counted, abs=0.05), (rank, stage, seen)
    assert memory.state_bytes_per_param(False, 2, 2, True) == 2 and memory.state_bytes_per_param(False, 1, 2, True) == 4


def _offload_host_buffers(rank: int, world: int, port: int, accumulation: int, queue) -> None:
    """One rank of test_offloaded_optimizer_host_bytes_are_deepspeeds_buffers: the bytes of every tensor DeepSpeed
    pins under optimizer offload (recorded at its accelerator's pin_memory: at start, then in the steps) and of the
    Adam moments, after two optimizer steps of `accumulation` micro-steps each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    pinned = []
    accelerator = get_accelerator()
    pin = accelerator.pin_memory

    def recorded_pin(tensor, *args, **kwargs):
        pinned.append(tensor.numel() * tensor.element_size())
        return pin(tensor, *args, **kwargs)

    accelerator.pin_memory = recorded_pin
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    at_start = len(pinned)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    for _ in range(2 * accumulation):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    moments = sum(t.numel() * t.element_size() for state in engine.optimizer.optimizer.state.values()
                  for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    queue.put((rank, {"n": n, "largest": 512 * 512, "pinned": sorted(pinned[:at_start]),
                      "in_steps": sorted(pinned[at_start:]), "moments": moments,
                      "numels": [p.numel() for p in model.parameters()]}))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_offloaded_optimizer_host_bytes_are_deepspeeds_buffers(accumulation, tmp_path):
    """host_state_bytes against what DeepSpeed's optimizer offload holds on each of 2 ranks (ZeRO 2, bf16, one
    parameter group as the trainer builds it): the pinned tensors are the fp32 master and gradient partitions, the
    bf16 copy of the partition and a bf16 buffer of the largest parameter, and the Adam moments are 8 bytes per
    parameter of the partition in ordinary memory. A pinned tensor costs the next power of two (torch's
    CachingHostAllocator), the reason a flat 18 bytes per parameter undercounted by ~20% (session 14's full
    fine-tune of 18 blocks). With gradient accumulation each rank also pins a bf16 tensor per parameter of its
    partition in the steps (4 weights and 4 biases here), counted by trainable_pinned_bf16 over the model's
    parameters and split over the ranks."""
    assert memory.pinned_bytes(3 * 2**30) == 4 * 2**30 and memory.pinned_bytes(2**30) == 2**30
    assert memory.pinned_bytes(0) == 0
    world = 2
    for rank, seen in _spawn_ranks(world, _offload_host_buffers, accumulation).items():
        part = seen["n"] // world  # 1,050,624 of the 2,101,248 parameters: the partition needs no padding
        assert seen["pinned"] == sorted([4 * part, 4 * part, 2 * part, 2 * seen["largest"]]), (rank, seen)
        assert seen["moments"] == 8 * part, (rank, seen)
        counted = sum(memory.pinned_bytes(b) for b in seen["pinned"][1:]) + seen["moments"]  # less the small buffer
        if accumulation == 1:
            assert seen["in_steps"] == [] and memory.host_state_bytes(seen["n"], world) == counted, (rank, seen)
            continue
        assert seen["in_steps"] == sorted([2 * 512] * 4 + [2 * 512 * 512] * 4), (rank, seen)
        counted += sum(memory.pinned_bytes(b) for b in seen["in_steps"])
        accumulated = memory.trainable_pinned_bf16(seen["numels"])
        assert memory.host_state_bytes(seen["n"], world, accumulated) == counted, (rank, seen)
    # 18 full-size blocks of a full fine-tune on one rank: 110.8 GB flat, 135 GB as torch pins it
    n = 6_156_000_000
    assert 18 * n / GB == pytest.approx(110.8, abs=0.1)
    assert memory.host_state_bytes(n, 1) / GB == pytest.approx(135.1, abs=0.1)
    if accumulation == 1:
        return
    # the plan counts them for the released model when the run accumulates (run_sizes sets `accumulating`)
    root = make_tiny(tmp_path, "edit_plus", num_samples=2, size=64)
    write_full_size_configs(root / "model")
    lora_sizes = memory.count_sizes(root / "model", LoraConfig().target_modules, 64)
    accumulating = dataclasses.replace(lora_sizes, accumulating=True)
    assert accumulating.host_state_bytes(1) - lora_sizes.host_state_bytes(1) == lora_sizes.accumulation_pinned
    # LoRA r64: every A and B matrix rounded up by a third (1.1 GB); a full fine-tune's tensors by 1.58x (65 GB)
    assert lora_sizes.accumulation_pinned / (2 * lora_sizes.lora_params) == pytest.approx(4 / 3)
    full = memory.count_sizes(root / "model", [], 0, full=True)
    assert full.accumulation_pinned / GB == pytest.approx(64.6, abs=0.1)


def test_full_fine_tuning_is_planned_per_rank(full_model):
    """Full fine-tuning of the released 20.4 B transformer, where the host cannot take the optimizer state: on one
    GPU nothing fits 141 GB and the refusal says over how many GPUs ZeRO-2 makes it fit; at that world size the
    plan fits, and one rank fewer does not. The state is split over the ranks: 2 + 20 / W bytes per parameter in
    the step with the bf16 weights, 12.0 at W = 2, which is what two depths of the full fine-tuning benchmark took
    on 2 GPUs (docs/performance.md)."""
    full = memory.count_sizes(full_model, LoraConfig().target_modules, 64, full=True)
    assert full.full and full.trainable_params == full.num_blocks * full.block_params + full.other_params
    m, budget, host_short = measured(8_448), 141 * GB, "its state needs 367.7 GB of host memory"
    margin = memory.margin_bytes(0, budget)
    with pytest.raises(memory.PlanError) as e:
        memory.choose(full, m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    world = int(str(e.value).split("Full fine-tuning fits with ZeRO stage 2 (zero_optimization.stage 2) over ")[1]
                .split()[0])
    assert 4 < world <= 16
    at = lambda w: memory.Sizes(**{**full.__dict__, "dp_world": w})  # noqa: E731
    c, p = memory.choose(at(world), m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    assert not c.fp8_base and c.offloaded == 0 and not c.offload_optimizer and p.fit_bytes <= budget - margin
    with pytest.raises(memory.PlanError):
        memory.choose(at(world - 1), m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    per_param = 2 + at(2).gpu_state_bytes(False, in_step=True) / full.trainable_params
    assert per_param == pytest.approx(12.0)
    # the run's sizes carry its ZeRO stage and world size, and the mode
    ds = {"zero_optimization": {"stage": 1}}
    project = ProjectConfig(model=ModelConfig(path=str(full_model)), train=TrainConfig(mode="full"))
    run = memory.run_sizes(Config(project=project, deepspeed=ds, world_size=8), online=False)
    assert (run.zero_stage, run.dp_world, run.full, run.trainable_params) == (1, 8, True, full.trainable_params)
    assert not run.accumulating
    accumulating = Config(project=project, deepspeed={**ds, "gradient_accumulation_steps": 4}, world_size=8)
    assert memory.run_sizes(accumulating, online=False).accumulating
    stage0 = memory.Sizes(**{**full.__dict__, "dp_world": world, "zero_stage": 0})  # nothing split at stage 0
    with pytest.raises(memory.PlanError, match=f"ZeRO stage 2 \\(zero_optimization.stage 2\\) over {world} or more"):
        memory.choose(stage0, m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    with pytest.raises(memory.PlanError, match="does not fit at any number of GPUs"):
        memory.choose(full, m, 40 * GB, memory.margin_bytes(0, 40 * GB), {}, fp8_ok=False, online=False,
                      offload_blocker=host_short)


def test_one_shared_copy_of_offloaded_blocks_is_counted_once_per_node(full_sizes):
    """Where /dev/shm holds the offloaded blocks (with offload.SHM_SPARE_BYTES to spare) and several processes
    train on the node, the plan counts one copy of them for the node, as the offloader then keeps; otherwise one per
    process. On 8 processes of a 24 GB budget with 64 GB of host memory, only the shared copy lets the plan offload
    what the GPU needs."""
    c = memory.Choice(True, False, 60, 40, True)
    blocks = 40 * memory.moved_bytes(full_sizes, True)
    roomy = memory.Host(500 * GB, 8, 8, shm_bytes=blocks + 3 * GB)
    tight = memory.Host(500 * GB, 8, 8, shm_bytes=blocks + 1 * GB)  # under the spare
    assert memory.host_bytes(full_sizes, c, roomy) == pytest.approx(blocks)
    assert memory.host_bytes(full_sizes, c, tight) == pytest.approx(8 * blocks)
    assert "one copy for the node's 8 training processes" in memory.host_refusal(full_sizes, c, roomy, {})
    assert "8 training process(es) on this node x 40" in memory.host_refusal(full_sizes, c, tight, {})
    m, budget = measured(8_448), 24 * GB
    margin = memory.margin_bytes(0, budget)
    shared = memory.Host(64 * GB, 8, 8, shm_bytes=32 * GB)
    chosen, _ = memory.choose(full_sizes, m, budget, margin, {}, fp8_ok=True, online=False, host=shared)
    assert chosen.offloaded > 40 and not chosen.offload_optimizer
    assert memory.host_bytes(full_sizes, chosen, shared) <= shared.room_bytes
    with pytest.raises(memory.PlanError, match="nothing fits this node's host memory"):
        memory.choose(full_sizes, m, budget, margin, {}, fp8_ok=True, online=False,
                      host=memory.Host(64 * GB, 8, 8, shm_bytes=0))


def test_the_counted_per_gpu_figures_the_docs_quote(full_model):
    """The counts README.md and docs/performance.md quote, before activations: full fine-tuning of the 20.4 B
    transformer at ZeRO-2 needs its bf16 copy plus the step's share of the state, 245 / 143 / 92 GB per GPU on
    2 / 4 / 8 GPUs; LoRA r64 on the default targets holds 6.8 GB of state on one GPU and 1.6 GB on each of 8."""
    full = memory.count_sizes(full_model, LoraConfig().target_modules, 64, full=True)
    for world, gb in ((2, 245), (4, 143), (8, 92)):
        ranked = memory.Sizes(**{**full.__dict__, "dp_world": world})
        counted = full.trainable_params * 2 + ranked.gpu_state_bytes(False, in_step=True)
        assert round(counted / GB) == gb, (world, counted / GB)
    lora = memory.count_sizes(full_model, LoraConfig().target_modules, 64)
    assert round(lora.gpu_state_bytes(False) / GB, 1) == 6.8
    assert round(memory.Sizes(**{**lora.__dict__, "dp_world": 8}).gpu_state_bytes(False) / GB, 1) == 1.6


def _deepest_full(full_sizes, m: memory.Measured, budget_gb: float, host: memory.Host, offload_ok: bool) -> int:
    """The most transformer blocks a full fine-tune may have for the plan to fit it on one GPU of `budget_gb`."""
    deepest = 0
    for depth in range(1, full_sizes.num_blocks + 1):
        s = memory.Sizes(**{**full_sizes.__dict__, "num_blocks": depth, "full": True, "lora_params": 0})
        try:
            memory.choose(s, m, budget_gb * GB, memory.margin_bytes(0, budget_gb * GB), {}, True, False,
                          None if offload_ok else "not offered", host)
        except memory.PlanError:
            break
        deepest = depth
    return deepest


# One H200's block figures at 12,984 tokens (2026-12-02): the gpu_memory.sh records' plan_measured (A, S, T, T_c, the
# online encode's transient) and the block probe's times (python -m train.bench --block_probe), h2d 34 GB/s.
H200_12984 = memory.Measured(act_bytes=1_453_120_512, ckpt_bytes=78_565_888, transient_bytes=1_337_367_040,
                             fwd_s=0.00813, fwd_bwd_s=0.02355, h2d_bytes_per_s=34e9, encode_bytes=2_212_153_856,
                             ckpt_transient_bytes=2_792_330_240, kept_bytes=81.0e6, kept_recompute_s=0.0044)


def test_the_kept_attention_plans_the_docs_quote(full_model, full_sizes):
    """docs/perf_notes.md lever 27 and docs/performance.md "Memory": the plan's time in the blocks of a 2509 step per
    budget without and with kept attention, from H200_12984; and 80 GB online over 141 GB online with the 0.27 s
    encode (1.12x with the lever, 1.19x without)."""
    online_sizes = dataclasses.replace(full_sizes, encoder_bytes=memory.encoder_bytes(full_model))
    without = dataclasses.replace(H200_12984, kept_bytes=0.0, kept_recompute_s=None)
    quoted = {(80, True): (1.765, 1.629), (80, False): (1.669, 1.572), (48, True): (1.939, 1.752),
              (48, False): (1.843, 1.673), (24, False): (1.972, 1.779), (16, False): (1.982, 1.822),
              (141, True): (1.435, 1.431)}
    steps = {}
    for (budget, online), want in quoted.items():
        s = online_sizes if online else full_sizes
        fixed = {"data.cache": "off"} if online else {}
        got = tuple(round(memory.choose(s, m, budget * GB, memory.margin_bytes(0, budget * GB), fixed, True,
                                        online)[1].step_s, 3) for m in (without, H200_12984))
        assert got == want, (budget, online, got)
        steps[budget, online] = got
    assert round((steps[80, True][1] + 0.27) / (steps[141, True][1] + 0.27), 2) == 1.12
    assert round((steps[80, True][0] + 0.27) / (steps[141, True][0] + 0.27), 2) == 1.19


def test_the_offloaded_full_fine_tune_figures_the_docs_quote(full_sizes):
    """docs/performance.md "Full fine-tuning: the deepest model per budget": the 12-block full fine-tune at 80 GB
    with the optimizer offloaded (session 16, one H200, tests/gpu_memory.sh), recomputed from that run's
    `plan_measured`: its predicted peak by the formula since the offload count's fix (27.52 GB; 27.76 measured) and
    the 8.2 GB of bf16 gradients the earlier formula added (35.76 printed), and its host memory: DeepSpeed's three
    pinned buffers as torch rounds them and the 75.9 GB the plan counted."""
    m = memory.Measured(act_bytes=1_521_128_448, ckpt_bytes=81_171_712, transient_bytes=628_826_112,
                        fwd_s=0.010754928, fwd_bwd_s=0.030393010, h2d_bytes_per_s=54_186_331_547,
                        encode_bytes=0.0, ckpt_transient_bytes=2_504_343_552, render_vae_bytes=0.0,
                        render_vae_tiled_bytes=0.0, kept_bytes=81_020_160, kept_recompute_s=0.005695705)
    full = dataclasses.replace(full_sizes, num_blocks=12, full=True)
    choice = memory.Choice(False, False, 0, 0, True, offload_optimizer=True)
    peak = memory.predict(full, m, choice).peak_bytes
    assert round(peak / GB, 2) == 27.52 and abs(peak / (27.758 * GB) - 1) < 0.01
    assert round((peak + 2 * full.trainable_params) / GB, 2) == 35.76  # the bf16 gradients counted before
    n = full.trainable_params
    assert [memory.pinned_bytes(n * b) / GB for b in (4, 4, 2)] == pytest.approx([17.18, 17.18, 8.59], abs=0.01)
    assert round(memory.host_state_bytes(n, 1) / GB, 1) == 75.9


def test_the_full_fine_tuning_depths_the_docs_quote(full_sizes):
    """docs/performance.md "Full fine-tuning: the deepest model per budget": planned from one H200's block figures at
    12,984 tokens (H200_12984) and that machine's 133.8 GB of available host memory, the deepest full fine-tune per
    budget on the GPU alone and with DeepSpeed's optimizer offload."""
    m = H200_12984
    host = memory.Host(available_bytes=133.8 * GB)
    quoted = {141: (17, 17), 80: (9, 14), 48: (5, 14), 24: (2, 14), 16: (1, 13)}
    for budget, (alone, offloaded) in quoted.items():
        assert _deepest_full(full_sizes, m, budget, host, False) == alone, budget
        assert _deepest_full(full_sizes, m, budget, host, True) == offloaded, budget


def test_the_shipped_configs_buckets():
    """zero2.json overlaps its reduction with the backward: two buckets of 2e8 bf16 gradients (0.8 GB) are counted;
    lora_fast.json (stage 1, no contiguous gradients) none, unless DeepSpeed's optimizer offload turns them on."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "ds_configs"
    ds = {name: json.loads((shipped / f"{name}.json").read_text()) for name in ("zero2", "lora_fast")}
    zero2 = memory.Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=2, **memory.bucket_sizes(ds["zero2"]))
    fast = memory.Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=1, **memory.bucket_sizes(ds["lora_fast"]))
    assert zero2.bucket_bytes(False) == zero2.bucket_bytes(True) == 0.8e9
    assert fast.bucket_bytes(False) == 0 and fast.bucket_bytes(True) == 0.4e9


def test_expandable_segments_on_every_cuda_run_the_plan_makes(monkeypatch):
    """The plan switches torch's allocator to expandable segments and empties its cache on CUDA, whether or not its
    choice offloads; not off CUDA, nor when the user set torch's allocator settings (either variable)."""
    import torch

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    for env in memory.ALLOC_CONF_ENVS:
        monkeypatch.delenv(env, raising=False)
    cuda = torch.device("cuda", 0)
    assert memory.expandable_segments(torch.device("cpu")) == "" and calls == []
    assert "expandable segments on" in memory.expandable_segments(cuda)
    assert calls == ["expandable_segments:True", "emptied"]
    for env in memory.ALLOC_CONF_ENVS:
        monkeypatch.setenv(env, "max_split_size_mb:512")
        assert memory.expandable_segments(cuda) == ""
        monkeypatch.delenv(env)
    assert len(calls) == 2


def _zero2_sizes(sizes: memory.Sizes) -> memory.Sizes:
    """`sizes` with the gradient buckets the shipped zero2.json makes."""
    import json
    from pathlib import Path

    ds = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "zero2.json").read_text())
    return dataclasses.replace(sizes, **memory.bucket_sizes(ds))


def test_the_16_gb_plans_the_docs_quote(full_sizes):
    """docs/performance.md "Memory", session 18: from that 16 GB run's own measurement (its record's plan_measured),
    zero2.json's plan keeps 46 blocks' attention with both of DeepSpeed's gradient buckets counted and predicts
    13.70 GB (13.61 measured); counting one bucket, as the run that ran out of memory did, it keeps 50. Host memory
    left out (the H200 host had 133 GB available)."""
    m = memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                        fwd_s=0.007736198999992894, fwd_bwd_s=0.02161766400000431, h2d_bytes_per_s=54992345519.41806,
                        ckpt_transient_bytes=2708410368, kept_bytes=81020160, kept_recompute_s=0.00541686399999719)
    budget = 16 * GB
    got = {}
    for label, s in (("one bucket", full_sizes), ("zero2.json", _zero2_sizes(full_sizes))):
        c, p = memory.choose(s, m, budget, memory.margin_bytes(0, budget), {}, True, False)
        assert c.offload_optimizer and c.checkpointed == c.offloaded == 60, (label, c)
        got[label] = (c.kept_attention, round(p.peak_bytes / GB, 2))
    assert got == {"one bucket": (50, 13.62), "zero2.json": (46, 13.7)}, got


# Session 19's records (one H200, 2026-12-03, commit b77c64d, 2509 cached, zero2.json): plan_measured per budget
# (no render ran, so no render figures).
S19_LORA = {
    141: memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                         fwd_s=0.007664199999993571, fwd_bwd_s=0.022402530999983128,
                         h2d_bytes_per_s=54331495333.60815, ckpt_transient_bytes=2708410368, kept_bytes=81020160,
                         kept_recompute_s=0.004428490999998758),
    80: memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                        fwd_s=0.007357491000050231, fwd_bwd_s=0.02131296099997826, h2d_bytes_per_s=53948601652.21411,
                        ckpt_transient_bytes=2709882880, kept_bytes=81020160, kept_recompute_s=0.005073101000050428),
    48: memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                        fwd_s=0.008170878999990805, fwd_bwd_s=0.022362611000005472,
                        h2d_bytes_per_s=55096560388.43513, ckpt_transient_bytes=2708410368, kept_bytes=81020160,
                        kept_recompute_s=0.004131309000001693),
    24: memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                        fwd_s=0.007900827000014488, fwd_bwd_s=0.022317783999994845,
                        h2d_bytes_per_s=54299931082.434166, ckpt_transient_bytes=2709882880, kept_bytes=81020160,
                        kept_recompute_s=0.0049004609999769855),
}
# The full fine-tunes of the same day (the deepest the GPU alone fits per budget): budget -> (blocks, plan_measured).
S19_FULL = {
    48: (5, memory.Measured(act_bytes=1520281088, ckpt_bytes=80542464, transient_bytes=630213120,
                            fwd_s=0.008305936999931873, fwd_bwd_s=0.02805201599994689,
                            h2d_bytes_per_s=54650169272.49231, ckpt_transient_bytes=2507188224, kept_bytes=81020160,
                            kept_recompute_s=0.004999029000032351)),
    24: (2, memory.Measured(act_bytes=1521485312, ckpt_bytes=80542464, transient_bytes=628087296,
                            fwd_s=0.008415406000040093, fwd_bwd_s=0.0281596620000073,
                            h2d_bytes_per_s=55147133621.532646, ckpt_transient_bytes=2507212800, kept_bytes=81020160,
                            kept_recompute_s=0.004290400999934718)),
    16: (1, memory.Measured(act_bytes=1521485312, ckpt_bytes=80542464, transient_bytes=628087296,
                            fwd_s=0.008062408000000687, fwd_bwd_s=0.027502352999931645,
                            h2d_bytes_per_s=54871200737.72586, ckpt_transient_bytes=2507212800, kept_bytes=81020160,
                            kept_recompute_s=0.004438120000145318)),
}


def test_the_session_19_lora_plans_the_docs_quote(full_sizes):
    """docs/performance.md "Memory", session 19: each budget's plan recomputed from its own run's measurement gives
    the choice and predicted peak the run printed (measured: 126.9, 70.6, 41.8, 20.2 GB)."""
    s = _zero2_sizes(full_sizes)
    quoted = {141: (0, 0, 0, True, 130.16), 80: (27, 27, 27, False, 73.22), 48: (45, 45, 45, False, 43.87),
              24: (59, 59, 59, True, 21.23)}
    for budget, want in quoted.items():
        c, p = memory.choose(s, S19_LORA[budget], budget * GB,
                             memory.margin_bytes(0, budget * GB), {}, True, False)
        got = (c.checkpointed, c.offloaded, c.kept_attention, c.fp8_transposed, round(p.peak_bytes / GB, 2))
        assert c.fp8_base and not c.offload_optimizer and got == want, (budget, got)


def test_the_session_19_full_fine_tunes_the_docs_quote(full_sizes):
    """docs/performance.md "Full fine-tuning: the deepest model per budget": from each run's own measurement the
    depth it ran is the deepest the GPU alone fits, planned bf16 with no checkpointing, at the printed peak
    (measured: 38.4, 16.0, 8.5 GB); one block more needs DeepSpeed's optimizer offload."""
    quoted = {48: 39.07, 24: 16.64, 16: 9.17}
    for budget, (depth, m) in S19_FULL.items():
        for blocks in (depth, depth + 1):
            s = _zero2_sizes(memory.Sizes(**{**full_sizes.__dict__, "num_blocks": blocks, "full": True,
                                             "lora_params": 0}))
            c, p = memory.choose(s, m, budget * GB, memory.margin_bytes(0, budget * GB), {}, True, False)
            if blocks == depth:
                assert (c.fp8_base, c.checkpointed, c.offload_optimizer) == (False, 0, False), (budget, c)
                assert round(p.peak_bytes / GB, 2) == quoted[budget], (budget, p.peak_bytes / GB)
            else:
                assert c.offload_optimizer, (budget, blocks, c)


# Session 20's records (one H200, 2026-12-04, commit 6161d1d, 2509, zero2.json): plan_measured of the 9-block full
# fine-tune at 80 GB (cached) and of the 80 GB LoRA run with online encoding.
S20_FULL_80 = memory.Measured(act_bytes=1520281088, ckpt_bytes=80542464, transient_bytes=630213120,
                              fwd_s=0.007757813000011993, fwd_bwd_s=0.027093786999998315,
                              h2d_bytes_per_s=55167432003.48575, ckpt_transient_bytes=2507188224,
                              kept_bytes=81020160, kept_recompute_s=0.005753500000011513)
S20_ONLINE_80 = memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                                fwd_s=0.008004614000014953, fwd_bwd_s=0.02291770100003987,
                                h2d_bytes_per_s=55291028650.28436, encode_bytes=2212153856.0,
                                ckpt_transient_bytes=2708410368, kept_bytes=81020160,
                                kept_recompute_s=0.0039848649999498775)
# The 80 GB online run of a later call (the same code with the GPU monitor's clock readings), its own measurement.
S20_ONLINE_80_LATER = memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                                      fwd_s=0.007898619999934908, fwd_bwd_s=0.022004672000036862,
                                      h2d_bytes_per_s=54425272050.049835, encode_bytes=2212153856.0,
                                      ckpt_transient_bytes=2709882880, kept_bytes=81020160,
                                      kept_recompute_s=0.004408876999946187)


def test_the_session_20_plans_the_docs_quote(full_model, full_sizes):
    """docs/performance.md "Memory", session 20, recomputed from each run's own measurement: the 80 GB full
    fine-tune of 9 blocks runs bf16 on the GPU alone with no checkpointing at the printed 68.98 GB (68.31 measured),
    and 10 blocks would need the optimizer offload; the 80 GB online LoRA run checkpoints and offloads 38 blocks,
    all keeping their attention, at the printed 74.33 GB (70.17 measured), the next micro-batch encoding ahead; the
    later call's run the same at 74.32 GB (70.39 measured)."""
    for blocks in (9, 10):
        s = _zero2_sizes(memory.Sizes(**{**full_sizes.__dict__, "num_blocks": blocks, "full": True, "lora_params": 0}))
        c, p = memory.choose(s, S20_FULL_80, 80 * GB, memory.margin_bytes(0, 80 * GB), {}, True, False)
        if blocks == 9:
            assert (c.fp8_base, c.checkpointed, c.offload_optimizer) == (False, 0, False), c
            assert round(p.peak_bytes / GB, 2) == 68.98, p.peak_bytes / GB
        else:
            assert c.offload_optimizer, c
    s = _zero2_sizes(dataclasses.replace(full_sizes, encoder_bytes=memory.encoder_bytes(full_model), encode_ahead=True))
    for m, peak in ((S20_ONLINE_80, 74.33), (S20_ONLINE_80_LATER, 74.32)):
        c, p = memory.choose(s, m, 80 * GB, memory.margin_bytes(0, 80 * GB), {"data.cache": "off"}, True, True)
        got = (c.fp8_base, c.fp8_transposed, c.checkpointed, c.offloaded, c.kept_attention, round(p.peak_bytes / GB, 2))
        assert got == (True, False, 38, 38, 38, peak), got


# Session 21's records (one H200, 2026-12-04, commit 1489168, zero2.json): plan_measured of the 2509 online runs at
# 141 and 80 GB (one call), of the 2509 cached run at 141 GB and of the v1 cached runs at 141 and 80 GB (the next
# call, the machine held), and at 48 and 24 GB (the call after).
S21_ONLINE = {
    141: memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                         fwd_s=0.007957529000009345, fwd_bwd_s=0.021183403999998518,
                         h2d_bytes_per_s=55056850585.77666, encode_bytes=2212153856.0,
                         ckpt_transient_bytes=2708410368, kept_bytes=81020160, kept_recompute_s=0.005193426999994699),
    80: memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                        fwd_s=0.00769119699998555, fwd_bwd_s=0.02256347400003733,
                        h2d_bytes_per_s=54144831606.38967, encode_bytes=2212153856.0,
                        ckpt_transient_bytes=2709882880, kept_bytes=81020160, kept_recompute_s=0.004515940999965551),
}
S21_CACHED_141 = memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                                 fwd_s=0.007950511000046845, fwd_bwd_s=0.02276128900001595,
                                 h2d_bytes_per_s=55214455555.29294, ckpt_transient_bytes=2709882880,
                                 kept_bytes=81020160, kept_recompute_s=0.004268764000073588)
S21_V1_CACHED = {
    141: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                         fwd_s=0.0053589380000858, fwd_bwd_s=0.014826397000092584, h2d_bytes_per_s=53751894484.359604,
                         ckpt_transient_bytes=1878763008, kept_bytes=61457760, kept_recompute_s=0.002974582999854647),
    80: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                        fwd_s=0.0049891740000020945, fwd_bwd_s=0.014074973999981921, h2d_bytes_per_s=54651192893.86066,
                        ckpt_transient_bytes=1878305280, kept_bytes=61457760, kept_recompute_s=0.0035391750001281252),
    48: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                        fwd_s=0.005145208999920214, fwd_bwd_s=0.014075141000148506, h2d_bytes_per_s=54958546172.4779,
                        ckpt_transient_bytes=1878305280, kept_bytes=61457760, kept_recompute_s=0.004081632999941576),
    24: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                        fwd_s=0.00485054199998558, fwd_bwd_s=0.014101437000135775, h2d_bytes_per_s=53846249945.91432,
                        ckpt_transient_bytes=1878305280, kept_bytes=61457760, kept_recompute_s=0.003694839999980104),
}


def test_the_session_21_plans_the_docs_quote(full_model, v1_full_model, full_sizes):
    """docs/performance.md "Memory", session 21, recomputed from each run's own measurement: 2509 online at 141 GB
    checkpoints and offloads 3 blocks without the transposed copy (131.41 GB printed, 126.11 measured), at 80 GB 38
    (74.32, 70.03); 2509 from the cache at 141 GB with the transposed copy and no checkpointing (130.18, 126.93); v1
    from the cache (its transformer is 2509's: the same counted sizes) runs without checkpointing at 141 GB (108.50,
    105.17), and checkpoints 16 / 39 / 59 blocks at 80 / 48 / 24 GB, keeping the attention of
    15 / 37 / 59 and offloading 16 / 39 / 49 (74.44 / 44.08 / 21.24 printed; 71.61 / 41.87 / 20.26 measured)."""
    s = _zero2_sizes(dataclasses.replace(full_sizes, encoder_bytes=memory.encoder_bytes(full_model), encode_ahead=True))
    quoted = {141: (3, 3, 3, 131.41), 80: (38, 38, 38, 74.32)}
    for budget, want in quoted.items():
        c, p = memory.choose(s, S21_ONLINE[budget], budget * GB, memory.margin_bytes(0, budget * GB),
                             {"data.cache": "off"}, True, True)
        got = (c.checkpointed, c.offloaded, c.kept_attention, round(p.peak_bytes / GB, 2))
        assert c.fp8_base and not c.fp8_transposed and not c.cached and got == want, (budget, c, got)
    c, p = memory.choose(_zero2_sizes(full_sizes), S21_CACHED_141, 141 * GB, memory.margin_bytes(0, 141 * GB), {},
                         True, False)
    assert (c.fp8_transposed, c.checkpointed, round(p.peak_bytes / GB, 2)) == (True, 0, 130.18), (c, p)
    v1_sizes = memory.count_sizes(v1_full_model, LoraConfig().target_modules, 64)
    assert v1_sizes == full_sizes
    s = _zero2_sizes(v1_sizes)
    quoted = {141: (0, 0, 0, True, 108.50), 80: (16, 16, 15, False, 74.44), 48: (39, 39, 37, False, 44.08),
              24: (59, 49, 59, False, 21.24)}
    for budget, want in quoted.items():
        c, p = memory.choose(s, S21_V1_CACHED[budget], budget * GB, memory.margin_bytes(0, budget * GB), {}, True,
                             False)
        got = (c.checkpointed, c.offloaded, c.kept_attention, c.fp8_transposed, round(p.peak_bytes / GB, 2))
        assert c.fp8_base and not c.offload_optimizer and got == want, (budget, got)


# Session 23's records (one H200, 2026-12-04, zero2.json): plan_measured of the 2509 cached run at 141 GB with the
# plan's fast fp8 accumulation (tree of 79f68ee) and of the v1 online run at 48 GB (tree of 4b8664a, its own call).
S23_CACHED_141 = memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                                 fwd_s=0.007687925999988465, fwd_bwd_s=0.022287029999972674,
                                 h2d_bytes_per_s=55167579394.10743, ckpt_transient_bytes=2708410368,
                                 kept_bytes=81020160, kept_recompute_s=0.004013953000026049)
S23_V1_ONLINE_48 = memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                                   fwd_s=0.005268243000003281, fwd_bwd_s=0.01431664199999716,
                                   h2d_bytes_per_s=54390567927.475006, encode_bytes=2212153856.0,
                                   ckpt_transient_bytes=1878763008, kept_bytes=61457760,
                                   kept_recompute_s=0.003934255999993752)


def _v1_online_sizes(model_dir) -> memory.Sizes:
    """The counted sizes of v1 encoding online (the encoders on the GPU, the next micro-batch encoding ahead)."""
    return _zero2_sizes(dataclasses.replace(memory.count_sizes(model_dir, LoraConfig().target_modules, 64),
                                            encoder_bytes=memory.encoder_bytes(model_dir), encode_ahead=True))


def _plan_at(s: memory.Sizes, m: memory.Measured, budget_gb: float, fixed: dict, online: bool):
    """The plan's choice at `budget_gb` with the default margin, and what the docs quote of it: (checkpointed,
    offloaded, kept attention, transposed copy, predicted peak in GB to 0.01)."""
    c, p = memory.choose(s, m, budget_gb * GB, memory.margin_bytes(0, budget_gb * GB), fixed, True, online)
    return c, (c.checkpointed, c.offloaded, c.kept_attention, c.fp8_transposed, round(p.peak_bytes / GB, 2))


def test_the_session_23_plans_the_docs_quote(v1_full_model, full_sizes):
    """docs/performance.md "Memory", session 23, recomputed from each run's own measurement: 2509 from the cache at
    141 GB with the transposed copy and no checkpointing (130.16 GB printed, 126.93 measured); v1 online at 48 GB
    with the encoders on the GPU checkpoints 54 blocks (all keeping their attention) and offloads 53, without the
    transposed copy (43.83 printed, 40.27 measured)."""
    c, p = memory.choose(_zero2_sizes(full_sizes), S23_CACHED_141, 141 * GB, memory.margin_bytes(0, 141 * GB), {},
                         True, False)
    assert (c.fp8_base, c.fp8_transposed, c.checkpointed, round(p.peak_bytes / GB, 2)) == (True, True, 0, 130.16)
    s = _v1_online_sizes(v1_full_model)
    c, got = _plan_at(s, S23_V1_ONLINE_48, 48, {"data.cache": "off"}, True)
    assert c.fp8_base and not c.cached and not c.offload_optimizer and got == (54, 53, 54, False, 43.83), got


# Session 24's records (one H200, 2026-12-04, the tree of 7456950, zero2.json, three calls on one machine held):
# plan_measured of the v1 online runs at 141 and 48 GB (call 1, data.cache "off"; its 24 GB run stopped before
# loading and recorded none), of the 2509 cached runs at 141, 80 and 48 GB (call 2) and at 24 and 141 GB (call 3).
S24_V1_ONLINE = {
    141: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                         fwd_s=0.005043520000000967, fwd_bwd_s=0.014169309999999768,
                         h2d_bytes_per_s=55114501679.150185, encode_bytes=2212153856.0,
                         ckpt_transient_bytes=1878763008, kept_bytes=61457760, kept_recompute_s=0.003254850999979908),
    48: memory.Measured(act_bytes=1099880960, ckpt_bytes=60512416, transient_bytes=844218368.0,
                        fwd_s=0.004908198999942215, fwd_bwd_s=0.013834228999940024,
                        h2d_bytes_per_s=54014918543.85737, encode_bytes=2212153856.0,
                        ckpt_transient_bytes=1878305280, kept_bytes=61457760, kept_recompute_s=0.003950866000025144),
}
S24_CACHED = {
    (2, 141): memory.Measured(act_bytes=1452693504, ckpt_bytes=80639744, transient_bytes=1339615232,
                              fwd_s=0.0077525340000192955, fwd_bwd_s=0.021515326999974604,
                              h2d_bytes_per_s=50843659540.624016, ckpt_transient_bytes=2708410368,
                              kept_bytes=81020160, kept_recompute_s=0.004607176000035906),
    (2, 80): memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                             fwd_s=0.007343388000094819, fwd_bwd_s=0.0212136489999466,
                             h2d_bytes_per_s=54911586635.44657, ckpt_transient_bytes=2709882880,
                             kept_bytes=81020160, kept_recompute_s=0.004303266999954758),
    (2, 48): memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                             fwd_s=0.007879140000113694, fwd_bwd_s=0.02229810999995152,
                             h2d_bytes_per_s=53787361599.46927, ckpt_transient_bytes=2709882880,
                             kept_bytes=81020160, kept_recompute_s=0.0036492070000804233),
    (3, 24): memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                             fwd_s=0.007317994999993971, fwd_bwd_s=0.02087673200003337,
                             h2d_bytes_per_s=54454971646.69977, ckpt_transient_bytes=2709882880,
                             kept_bytes=81020160, kept_recompute_s=0.005096646999845689),
    (3, 141): memory.Measured(act_bytes=1453050368, ckpt_bytes=80100096, transient_bytes=1338926080,
                              fwd_s=0.0075634839997746894, fwd_bwd_s=0.02170357799991507,
                              h2d_bytes_per_s=53941045642.02069, ckpt_transient_bytes=2709882880,
                              kept_bytes=81020160, kept_recompute_s=0.004018028000018603),
}


def test_the_session_24_plans_the_docs_quote(v1_full_model, full_sizes):
    """docs/performance.md "Memory", session 24, recomputed from each run's own measurement: 2509 from the cache
    runs without checkpointing at 141 GB with the transposed copy (130.16 and 130.18 GB printed, 126.73 measured),
    checkpoints and offloads 27 / 45 / 59 blocks at 80 / 48 / 24 GB, all keeping their attention, the transposed copy
    only at 24 GB (73.22 / 43.85 / 21.23 printed; 70.63 / 41.78 / 20.22 measured); v1 online runs without
    checkpointing at 141 GB (127.55, 122.40) and checkpoints 54 blocks, offloading 53, at 48 GB (43.83, 40.31); at 24
    GB with data.cache "off" nothing fits (the smallest setting 27.0 GB), so the run stops before loading."""
    quoted = {(2, 141): (0, 0, 0, True, 130.16), (2, 80): (27, 27, 27, False, 73.22),
              (2, 48): (45, 45, 45, False, 43.85), (3, 24): (59, 59, 59, True, 21.23),
              (3, 141): (0, 0, 0, True, 130.18)}
    for key, want in quoted.items():
        c, got = _plan_at(_zero2_sizes(full_sizes), S24_CACHED[key], key[1], {}, False)
        assert c.fp8_base and c.cached and not c.offload_optimizer and got == want, (key, got)
    s = _v1_online_sizes(v1_full_model)
    for budget, want in {141: (0, 0, 0, True, 127.55), 48: (54, 53, 54, False, 43.83)}.items():
        c, got = _plan_at(s, S24_V1_ONLINE[budget], budget, {"data.cache": "off"}, True)
        assert c.fp8_base and not c.cached and not c.offload_optimizer and got == want, (budget, got)
    # The 24 GB run's own measurement was not recorded; the 48 GB run's of the same call gives the same refusal, and
    # at 16 GB (not run) too.
    for budget in (24, 16):
        with pytest.raises(memory.PlanError, match=r"needs 27\.0 GB\. .*data\.cache off"):
            memory.choose(s, S24_V1_ONLINE[48], budget * GB, memory.margin_bytes(0, budget * GB),
                          {"data.cache": "off"}, True, True)
        # Left to the plan (the shipped default, data.cache unset), the same run trains from the cache instead.
        c, _ = _plan_at(s, S24_V1_ONLINE[48], budget, {}, True)
        assert c.cached, (budget, c)
