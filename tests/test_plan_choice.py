"""The choice (train/plan/choice.py, predicting with train/plan/predict.py and worded by train/plan/explain.py): the
setting it picks over budgets and workloads, the formula's parts, the keys a config fixes, online encoding, the
optimizer offload as the last resort, full fine-tuning over data-parallel ranks, and the NoFit it answers when
nothing fits. The block figures have the shape the GPU measurement gives (plan_helpers.measured)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_helpers import QWEN_LORA, measured, plan
from recorded_plans import RELEASED

from train.config import Config, DataConfig, ModelConfig, ProjectConfig, TrainConfig
from train.plan.choice import OFFLOAD_KEY, NoFit, choose
from train.plan.explain import PlanError, describe, refusal, render_note
from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.keys import config_values, optimizer_offload_blocker
from train.plan.measure import Measured
from train.plan.predict import Choice, activation_phases, backward_bytes, predict
from train.plan.run_plan import gpu_margin, run_sizes
from train.plan.sizes import GB, Sizes, count_sizes, state_bytes_per_param


def activation_peak(s: Sizes, m: Measured, checkpointed: int) -> float:
    """The backward's activation peak: the larger of its phases (activation_phases), not their sum."""
    return max(acts for acts, _ in activation_phases(s, m, checkpointed))


@pytest.mark.parametrize("tokens, budgets", [(8_448, (141, 80, 48, 24)), (12_544, (141, 80, 48))])
def test_plan_over_budgets(tokens, budgets):
    """Fits each budget; less memory never buys a faster step; the biggest card keeps every block plain and
    resident, 24 GB offloads. (With these figures 12.5k tokens need 23.5 GB at the least: the LoRA optimizer
    state, 8.5 GB at r64, stays on the GPU.)"""
    m = measured(tokens)
    previous = None
    for budget in budgets:
        margin = gpu_margin(0, budget * GB)
        c, p = plan(RELEASED, m, budget * GB, margin, {}, fp8_ok=True, online=False)
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
    none, one, two = (predict(RELEASED, m, Choice(True, False, n, 0, True)) for n in (0, 1, 2))
    assert none.peak_bytes - one.peak_bytes == pytest.approx(m.act_bytes - m.ckpt_bytes)
    assert one.peak_bytes - two.peak_bytes == pytest.approx(m.act_bytes - m.ckpt_bytes)
    assert two.step_s - one.step_s == pytest.approx(m.fwd_s)


def test_a_recomputation_meets_only_the_checkpointed_inputs():
    """The backward runs the last (plain) blocks first; the first N blocks recompute after those have freed their
    activations. So the activation peak is the larger of the two phases: with N of 60 checkpointed,
    (60 - N) A + N S + T while the plain blocks go back, N S + T_c while the checkpointed ones do (T_c measured
    with a recomputation in it). Summing them over-predicted every partly
    checkpointed run on the H200 by about one block's activations (docs/performance.md, Memory)."""
    m = Measured(**{**measured(12_544).__dict__, "ckpt_transient_bytes": 9 * GB})
    a, s, t, tc = m.act_bytes, m.ckpt_bytes, m.transient_bytes, 9 * GB
    for n in (1, 30, 59):
        assert activation_peak(RELEASED, m, n) == pytest.approx(max((60 - n) * a + n * s + t, n * s + tc))
        assert activation_peak(RELEASED, m, n) < (60 - n) * a + n * s + tc  # the old sum
    assert activation_peak(RELEASED, m, 60) == pytest.approx(60 * s + tc)  # only the second phase
    assert activation_peak(RELEASED, m, 0) == pytest.approx(60 * a + t)  # only the first
    # a recomputation larger than the plain blocks' activations decides the peak on its own
    big = Measured(**{**m.__dict__, "ckpt_transient_bytes": 200 * GB})
    assert activation_peak(RELEASED, big, 30) == pytest.approx(30 * s + 200 * GB)


def test_explicit_keys_win_and_online_encoders_count():
    m = Measured(**{**measured(12_544).__dict__, "encode_bytes": 4 * GB})
    fixed = {"train.fp8_base": False, "train.gradient_checkpointing": True}
    c, _ = plan(RELEASED, m, 141 * GB, 0, fixed, fp8_ok=True, online=False)
    assert not c.fp8_base and c.checkpointed >= 1
    # online: the 16.6 GB VL model shares the GPU; the plan prefers it while it fits, else trains from the cache
    sizes = Sizes(**{**RELEASED.__dict__, "encoder_bytes": int(16.6 * GB)})
    c141, _ = plan(sizes, m, 141 * GB, 8 * GB, {}, fp8_ok=True, online=True)
    assert not c141.cached
    c48, _ = plan(sizes, m, 48 * GB, 3.9 * GB, {}, fp8_ok=True, online=True)
    assert c48.cached
    pinned, _ = plan(sizes, m, 48 * GB, 3.9 * GB, {"data.cache": "off"}, fp8_ok=True, online=True)
    assert not pinned.cached and pinned.offloaded > 0  # data.cache set to "off" in the config: offload instead
    with pytest.raises(PlanError, match="nothing fits"):
        plan(sizes, m, 24 * GB, 2.7 * GB, {"data.cache": "off"}, fp8_ok=True, online=True)


def test_encoding_ahead_adds_the_encode_transient_to_the_step(released_model):
    """data.encode_ahead: the next micro-batch encodes while this one trains, so the online peak is the step's plus
    the encode's transient E (both stream pools hold theirs); in turn the encode runs between the steps and only
    the larger of E and the activations counts. From the cache nothing encodes. run_sizes takes the key, online
    only."""
    e = 4 * GB
    m = Measured(**{**measured(12_544).__dict__, "encode_bytes": e})
    in_turn = Sizes(**{**RELEASED.__dict__, "encoder_bytes": int(16.6 * GB)})
    ahead = dataclasses.replace(in_turn, encode_ahead=True)
    for checkpointed, offloaded in ((0, 0), (30, 10), (60, 60)):  # activations above E in each
        online = Choice(True, False, checkpointed, offloaded, False)
        grown = predict(ahead, m, online).peak_bytes - predict(in_turn, m, online).peak_bytes
        assert grown == pytest.approx(e)
        cached = dataclasses.replace(online, cached=True)
        assert predict(ahead, m, cached).peak_bytes == predict(in_turn, m, cached).peak_bytes
    # an encode larger than the step's activations: in turn it alone counts, ahead both do
    big = Measured(**{**m.__dict__, "encode_bytes": 100 * GB})
    online = Choice(True, False, 60, 60, False)
    acts = activation_peak(in_turn, big, 60)
    unreduced = in_turn.unreduced_partition_bytes(False, 1)  # allocated after the backward's peak, before the encode
    assert unreduced > 0
    assert predict(in_turn, big, online).peak_bytes == pytest.approx(
        predict(in_turn, m, online).peak_bytes - acts + unreduced + 100 * GB
    )
    assert predict(ahead, big, online).peak_bytes == pytest.approx(predict(ahead, m, online).peak_bytes + 96 * GB)
    # the plan pays for the overlap where memory is short: more blocks checkpointed, never fewer
    margin = gpu_margin(0, 80 * GB)
    c_turn, _ = plan(in_turn, m, 80 * GB, margin, {"data.cache": "off"}, fp8_ok=True, online=True)
    c_ahead, p_ahead = plan(ahead, m, 80 * GB, margin, {"data.cache": "off"}, fp8_ok=True, online=True)
    assert c_ahead.checkpointed > c_turn.checkpointed and p_ahead.peak_bytes <= 80 * GB - margin

    def run(online: bool, key: bool) -> bool:
        project = ProjectConfig(model=ModelConfig(path=str(released_model)), data=DataConfig(encode_ahead=key),
                                lora=QWEN_LORA)
        return run_sizes(Config(project=project, deepspeed={}, world_size=1), online=online).encode_ahead

    assert run(True, True) and not run(True, False) and not run(False, True)


def test_the_backward_peaks_meet_the_gradient_partition_once_a_bucket_is_reduced():
    """ZeRO-2's bf16 gradient partition comes with the first reduced bucket (2e8 gradients): the plain blocks' peak,
    in the backward's first block, never meets it under LoRA r64 (7.1 M gradients a block); the checkpointed blocks'
    peak meets it after 28 plain blocks or more, not after fewer. Accumulating gradients keeps it from the previous
    micro-batch at every peak."""
    m = measured(12_544)
    partition = RELEASED.lora_params * 2
    per_block = RELEASED.lora_params / RELEASED.num_blocks
    state = RELEASED.gpu_state_bytes(False) + RELEASED.bucket_bytes(False)
    for checkpointed in (0, 20, 31, 33, 60):
        (first, done_first), *rest = activation_phases(RELEASED, m, checkpointed)
        c = Choice(True, False, checkpointed, checkpointed, True)
        if checkpointed == 60:  # only the checkpointed blocks' phase
            expected = first + state - partition
        else:
            assert done_first == 1
            peaks = [first + state - partition]
            for acts, done in rest:
                assert done == 60 - checkpointed + 1
                peaks.append(acts + state - (partition if done * per_block <= 2e8 else 0))
            expected = max(peaks)
        assert backward_bytes(RELEASED, m, c) == pytest.approx(expected), checkpointed
        accumulating = dataclasses.replace(RELEASED, accumulating=True)
        assert backward_bytes(accumulating, m, c) == pytest.approx(max(a for a, _ in [(first, 0), *rest]) + state)
    assert 28 * per_block <= 2e8 < 29 * per_block


def test_budget_below_the_minimum_names_the_numbers():
    with pytest.raises(PlanError) as e:
        plan(RELEASED, measured(12_544), 6 * GB, 1.8 * GB, {}, fp8_ok=True, online=False)
    text = str(e.value)
    assert "6.0 GB" in text and "needs" in text and "qwen_edit.data.area" in text
    # without fp8 matmuls (an older GPU) the smallest plan is bf16 and offloaded
    c, _ = plan(RELEASED, measured(8_448), 24 * GB, 2.7 * GB, {}, fp8_ok=False, online=False)
    assert not c.fp8_base and c.offloaded > 0


def test_optimizer_offload_is_the_last_resort():
    """At 16 GB only DeepSpeed's optimizer offload fits 8.4k tokens (the LoRA r64 state, 6.8 GB, is what does not):
    it is chosen, its predicted peak is the same setting's without it minus 12 bytes per LoRA parameter (the fp32
    master and the moments; the bf16 gradient partition is not there at the backward's peak in either), and the
    host step is charged; at 24 GB a setting without it fits, and it is not chosen."""
    m = measured(8_448)
    margin = gpu_margin(0, 16 * GB)
    c, p = plan(RELEASED, m, 16 * GB, margin, {}, fp8_ok=True, online=False)
    assert c.offload_optimizer and p.peak_bytes <= 16 * GB - margin
    on_gpu = predict(RELEASED, m, Choice(c.fp8_base, c.fp8_transposed, c.checkpointed, c.offloaded, c.cached))
    lowered = RELEASED.lora_params * (
        state_bytes_per_param(False, 2, 1, False) - state_bytes_per_param(False, 2, 1, True)
    ) - RELEASED.unreduced_partition_bytes(False, 1)
    assert on_gpu.peak_bytes - p.peak_bytes == pytest.approx(lowered)
    assert lowered == pytest.approx(RELEASED.lora_params * 12)
    assert p.step_s == on_gpu.step_s and on_gpu.optimizer_s == 0
    assert p.optimizer_s == pytest.approx(RELEASED.lora_params * (30 / 10e9 + 4 / 25e9))  # ~1.34 s
    assert "optimizer state in host memory" in describe(c, 60)
    # nothing without it fits 16 GB: with the offload ruled out the plan refuses
    with pytest.raises(PlanError):
        plan(RELEASED, m, 16 * GB, margin, {OFFLOAD_KEY: False}, fp8_ok=True, online=False)
    c24, _ = plan(RELEASED, m, 24 * GB, gpu_margin(0, 24 * GB), {}, fp8_ok=True, online=False)
    assert not c24.offload_optimizer and c24.offloaded > 0  # block offloading first: it costs less time


def test_optimizer_offload_needs_adam_zero_and_host_memory():
    """An optimizer DeepSpeed cannot step on the host (not Adam/AdamW), ZeRO stage 0 or a host without the room
    rule the offload out: the plan refuses as before, saying that the offload would fit and why it cannot be used."""
    ds, roomy = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}, Host(64 * GB)
    assert optimizer_offload_blocker(ds, RELEASED, roomy) is None
    assert optimizer_offload_blocker({**ds, "optimizer": {"type": "Adam"}}, RELEASED, roomy) is None
    lion = optimizer_offload_blocker({**ds, "optimizer": {"type": "Lion"}}, RELEASED, roomy)
    assert 'optimizer.type "Lion"' in lion and "AdamW" in lion
    assert "stage is 0" in optimizer_offload_blocker({"optimizer": {"type": "AdamW"}}, RELEASED, roomy)
    # 425 M parameters: 7.6 GB at 18 bytes, 8.8 GB as torch pins it (host_state_bytes), against 8 GB less its
    # margin (2 GB per process and 5%): 5.6 GB
    host = optimizer_offload_blocker(ds, RELEASED, Host(8 * GB))
    assert "8.8 GB of host memory" in host and "8.0 GB is available, less a 2.4 GB margin" in host
    assert optimizer_offload_blocker(ds, RELEASED, Host(8 * GB, 1, 2)) is None  # half each: 4.4 GB
    assert optimizer_offload_blocker(ds, RELEASED, Host(8 * GB, 2, 2))  # both ranks on this node
    with pytest.raises(PlanError) as e:
        plan(RELEASED, measured(8_448), 16 * GB, 2.3 * GB, {}, fp8_ok=True, online=False, offload_blocker=lion)
    text = str(e.value)
    assert "nothing fits the memory budget: 16.0 GB" in text and "needs 17.7 GB" in text  # the best without it
    assert "optimizer offload (zero_optimization.offload_optimizer) the run would fit" in text
    assert "needs 12.6 GB, of 13.7 GB" in text and 'optimizer.type "Lion"' in text
    with pytest.raises(PlanError) as e:  # too small even with the offload: said so
        plan(RELEASED, measured(8_448), 12 * GB, 2.1 * GB, {}, fp8_ok=True, online=False, offload_blocker=lion)
    assert "would still not fit" in str(e.value)


def test_full_fine_tuning_is_planned_per_rank(released_model):
    """Full fine-tuning of the released 20.4 B transformer, where the host cannot take the optimizer state: on one
    GPU nothing fits 141 GB and the refusal says over how many GPUs ZeRO-2 makes it fit; at that world size the
    plan fits, and one rank fewer does not. The state is split over the ranks: 2 + 20 / W bytes per parameter in
    the step with the bf16 weights, 12.0 at W = 2, which is what two depths of the full fine-tuning benchmark took
    on 2 GPUs (docs/performance.md)."""
    full = count_sizes(released_model, QWEN_LORA.target_modules, 64, full=True)
    assert full.full and full.trainable_params == full.num_blocks * full.block_params + full.other_params
    m, budget, host_short = measured(8_448), 141 * GB, "its state needs 367.7 GB of host memory"
    margin = gpu_margin(0, budget)
    with pytest.raises(PlanError) as e:
        plan(full, m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    world = int(
        str(e.value).split("Full fine-tuning fits with ZeRO stage 2 (zero_optimization.stage 2) over ")[1].split()[0]
    )
    assert 4 < world <= 16
    at = lambda w: Sizes(**{**full.__dict__, "dp_world": w})  # noqa: E731
    c, p = plan(at(world), m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    assert not c.fp8_base and c.offloaded == 0 and not c.offload_optimizer and p.fit_bytes <= budget - margin
    with pytest.raises(PlanError):
        plan(at(world - 1), m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    per_param = 2 + at(2).gpu_state_bytes(False, in_step=True) / full.trainable_params
    assert per_param == pytest.approx(12.0)
    # the run's sizes carry its ZeRO stage and world size, and the mode
    ds = {"zero_optimization": {"stage": 1}}
    project = ProjectConfig(model=ModelConfig(path=str(released_model)), train=TrainConfig(mode="full"), lora=QWEN_LORA)
    run = run_sizes(Config(project=project, deepspeed=ds, world_size=8), online=False)
    assert (run.zero_stage, run.dp_world, run.full, run.trainable_params) == (1, 8, True, full.trainable_params)
    assert not run.accumulating
    accumulating = Config(project=project, deepspeed={**ds, "gradient_accumulation_steps": 4}, world_size=8)
    assert run_sizes(accumulating, online=False).accumulating
    stage0 = Sizes(**{**full.__dict__, "dp_world": world, "zero_stage": 0})  # nothing split at stage 0
    with pytest.raises(PlanError, match=f"ZeRO stage 2 \\(zero_optimization.stage 2\\) over {world} or more"):
        plan(stage0, m, budget, margin, {}, fp8_ok=False, online=False, offload_blocker=host_short)
    with pytest.raises(PlanError, match="does not fit at any number of GPUs"):
        plan(full, m, 40 * GB, gpu_margin(0, 40 * GB), {}, fp8_ok=False, online=False, offload_blocker=host_short)


def test_the_choice_answers_a_no_fit_in_figures_and_explain_words_it():
    """choose says why nothing fits as data, not prose: the kind, the smallest setting tried and what it needs, and
    the optimizer offload it could not use with the reason; explain turns that into the run's message. Keys that
    allow no setting at all (more blocks offloaded than checkpointed) are a NoFit of their own."""
    m = measured(8_448)
    no_fit = choose(RELEASED, m, 16 * GB, 2.3 * GB, {}, True, False, offload_blocker="the optimizer is Lion")
    assert isinstance(no_fit, NoFit) and no_fit.kind == "budget" and no_fit.room == pytest.approx(13.7 * GB)
    assert not no_fit.smallest.offload_optimizer and no_fit.needs_bytes > no_fit.room
    assert no_fit.needs_bytes == predict(RELEASED, m, no_fit.smallest).fit_bytes
    assert no_fit.offload.offload_optimizer and no_fit.offload_needs_bytes <= no_fit.room
    assert no_fit.blocker == "the optimizer is Lion" and no_fit.full_ranks is None
    text = refusal(no_fit, RELEASED, UNCOUNTED_HOST, {})
    assert text.startswith("nothing fits the memory budget: 16.0 GB with a 2.3 GB margin; the smallest setting")
    assert f"({describe(no_fit.smallest, 60)}) needs {no_fit.needs_bytes / GB:.1f} GB" in text
    assert "but the optimizer is Lion." in text
    fixed = {"train.checkpoint_blocks": 10, "train.offload_blocks": 20}
    none = choose(RELEASED, m, 141 * GB, 0, fixed, True, False)
    assert isinstance(none, NoFit) and none.kind == "no candidate" and none.smallest is None
    with pytest.raises(PlanError, match="the config's explicit settings leave no candidate to plan"):
        plan(RELEASED, m, 141 * GB, 0, fixed, True, False)


# ---------------------------------------------------------------- validation renders


def with_render(m: Measured, forward: float, vae: float, vae_tiled: float) -> Measured:
    return Measured(
        **{**m.__dict__, "render_forward_bytes": forward, "render_vae_bytes": vae, "render_vae_tiled_bytes": vae_tiled}
    )


@pytest.fixture(scope="module")
def render_sizes():
    """The released transformer with the VAE's 127 M parameters counted (a render from the cache loads it)."""
    return Sizes(**{**RELEASED.__dict__, "vae_bytes": int(0.254 * GB)})


def test_a_render_that_fits_changes_nothing(render_sizes):
    """Validation off: no tiling is planned (config_values() has no inference.vae_tiling). A render that fits every
    budget: the same training settings as without it, decoded untiled."""
    for tokens, budget in ((8_448, 141), (8_448, 24), (12_544, 80), (12_544, 48)):
        margin = gpu_margin(0, budget * GB)
        off, p_off = plan(render_sizes, measured(tokens), budget * GB, margin, {}, fp8_ok=True, online=False)
        assert off.vae_tiling is None and p_off.render_peak_bytes == 0
        assert "inference.vae_tiling" not in config_values(off, 60)
        on, p_on = plan(
            render_sizes,
            with_render(measured(tokens), 0.5 * GB, 0.8 * GB, 0.3 * GB),
            budget * GB,
            margin,
            {},
            fp8_ok=True,
            online=False,
        )
        assert on == Choice(**{**off.__dict__, "vae_tiling": False})
        assert p_on.peak_bytes == p_off.peak_bytes and p_on.step_s == p_off.step_s
        assert 0 < p_on.render_peak_bytes < p_on.peak_bytes
        assert config_values(on, 60)["inference.vae_tiling"] is False


def test_the_render_peak_enters_the_choice(render_sizes):
    """At 24 GB the step fits, but an untiled 1 MP decode does not: the plan tiles the decode and keeps the step;
    with inference.vae_tiling fixed false it pays with the step (more blocks offloaded) instead, and says so."""
    budget, tokens = 24 * GB, 8_448
    margin = gpu_margin(0, budget)
    room = budget - margin
    step_only, p0 = plan(render_sizes, measured(tokens), budget, margin, {}, fp8_ok=True, online=False)
    # what the step's choice keeps on the GPU during a render, with the VAE: the untiled decode gets 0.5 GB too much
    kept = predict(
        render_sizes, with_render(measured(tokens), 0, 0, 0), Choice(**{**step_only.__dict__, "vae_tiling": False})
    ).render_peak_bytes
    m = with_render(measured(tokens), 1.2 * GB, room - kept + 0.5 * GB, 0.9 * GB)
    c, p = plan(render_sizes, m, budget, margin, {}, fp8_ok=True, online=False)
    assert c == Choice(**{**step_only.__dict__, "vae_tiling": True})
    assert p.step_s == p0.step_s and p.render_peak_bytes <= room and p.peak_bytes <= room
    note = render_note(render_sizes, m, c, p, budget, margin, {}, fp8_ok=True, online=False)
    assert "inference.vae_tiling = true, which the plan chose" in note and "untiled it would need" in note
    assert config_values(c, 60)["inference.vae_tiling"] is True and "decode tiled" in describe(c, 60)

    fixed = {"inference.vae_tiling": False}
    c2, p2 = plan(render_sizes, m, budget, margin, fixed, fp8_ok=True, online=False)
    assert c2.vae_tiling is False and p2.fit_bytes <= room
    assert p2.step_s > p0.step_s and (c2.offloaded > step_only.offloaded or not c2.fp8_transposed)
    note = render_note(render_sizes, m, c2, p2, budget, margin, fixed, fp8_ok=True, online=False)
    assert "the renders set this plan" in note and "set false in the config" in note
    assert "inference.vae_tiling = true" in note and "inference.area" in note  # the keys that lower a render

    # when only the renders cannot fit, the refusal says so and names their keys
    huge = with_render(measured(tokens), 1.2 * GB, float("inf"), room)
    with pytest.raises(PlanError) as e:
        plan(render_sizes, huge, budget, margin, {}, fp8_ok=True, online=False)
    text = str(e.value)
    assert "with validation renders" in text and "the training step fits" in text
    assert "inference.vae_tiling = true" in text and "validation.file" in text


def test_a_render_counts_what_it_loads(render_sizes):
    """From the cache a render loads the VAE beside the model; online the encoders are there already (the VAE is
    among them). The forward and the decode do not coexist: the larger of the two counts."""
    m = with_render(measured(8_448), 2 * GB, 3 * GB, 1 * GB)
    s = Sizes(**{**render_sizes.__dict__, "encoder_bytes": int(16.6 * GB)})

    def render(cached: bool, tiled: bool, mm=m) -> float:
        return predict(s, mm, Choice(True, True, 60, 40, cached, vae_tiling=tiled)).render_peak_bytes

    assert render(False, False) - render(True, False) == pytest.approx(16.6 * GB - 0.254 * GB)
    assert render(True, False) - render(True, True) == pytest.approx(1 * GB)  # tiled: the forward's 2 GB counts
    more = with_render(measured(8_448), 2 * GB, 5 * GB, 1 * GB)
    assert render(True, False, more) - render(True, False) == pytest.approx(2 * GB)
