"""Qwen-Image-2.1's transformer in its training forms and its memory plan, in-process on the CPU: checkpointing,
offloaded blocks, the attention processors (train.attention) and an fp8 base against the plain form; the released
architecture's configs (train.make_tiny --full_size_configs), the plan's sizes, block inputs and choice on them."""

from __future__ import annotations

import pytest
import torch

from train.config import LoraConfig
from train.model import family, prepare
from train.model.qwen_image21 import attention, batches
from train.model.qwen_image21.tiny import build_transformer
from train.plan import arch, explain
from train.plan.choice import choose
from train.plan.host import UNCOUNTED_HOST
from train.plan.measure import Measured
from train.plan.run_plan import gpu_margin
from train.plan.sizes import GB, count_sizes
from train.plan.workload import Workload
from train.runtime import probes

FAM = family.family_named("qwen_image21")
LORA = LoraConfig(rank=4, alpha=4.0, target_modules=list(FAM.lora.targets))


def prepared(**options):
    """The tiny 2.1 transformer (3 blocks, seed 0) with LoRA on the family's targets, prepared with `options`."""
    torch.manual_seed(0)
    model = build_transformer(num_layers=3)
    options = {"gradient_checkpointing": False, "compile_blocks": False, **options}
    prepare.prepare_for_training(model, "lora", LORA, **options)
    return model.train()


def loss_and_grads(model, target_hw=(4, 4), reference_hws=((4, 4), (2, 4)), sigmas=(0.3, 0.8)):
    """One training loss (by default two rows, two references of different sizes, a noisy target) and the LoRA
    gradients of that call alone."""
    model.zero_grad(set_to_none=True)
    b = batches.synthetic_batch(model, len(sigmas), target_hw, list(reference_hws), 20, torch.device("cpu"),
                                torch.float32)
    kwargs = FAM.transformer_inputs(b, b.x0, torch.tensor(sigmas), torch.float32)
    loss = FAM.target_prediction(model(**kwargs), b).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpointed_and_offloaded_blocks_train_exactly_like_the_plain_form():
    loss, grads = loss_and_grads(prepared())
    other_loss, other = loss_and_grads(prepared(gradient_checkpointing=True, offload={0, 1, 2}))
    assert torch.equal(loss, other_loss) and grads.keys() == other.keys()
    assert all(torch.equal(grads[n], other[n]) for n in grads)


def test_the_attention_processors_train_alike():
    """sdpa (diffusers' processor, the default off CUDA) and segmented (this project's) give one loss and one
    gradient, to float32 rounding. (flex has no backward on the CPU: the config refuses it there.)"""
    plain = prepared()
    assert all(type(b.attn.processor).__name__ == "QwenImage21AttnProcessor" for b in plain.transformer_blocks)
    loss, grads = loss_and_grads(plain)
    model = prepared(attention="segmented")
    assert all(isinstance(b.attn.processor, attention.SegmentedSDPAProcessor) for b in model.transformer_blocks)
    other_loss, other = loss_and_grads(model)
    assert torch.allclose(loss, other_loss, rtol=1e-5)
    assert all(torch.allclose(grads[n], other[n], atol=1e-6, rtol=1e-4) for n in grads)


def one_row(model, layout):
    """loss_and_grads on one row of a (target, reference) latent-size layout."""
    target_hw, reference_hw = layout
    return loss_and_grads(model, target_hw, [reference_hw], (0.4,))


def test_compiled_segmented_blocks_take_new_layouts_without_recompiling(monkeypatch):
    """The run boundaries reach the op as symbolic ints: once a second layout has made the blocks' shapes dynamic,
    a third (other sizes, so other boundaries) runs the compiled graphs as they are, and trains as uncompiled blocks
    do. Specialised boundaries would compile again for every layout, and fall back to eager past dynamo's limit.
    The op's backward sums the key shares with its compiled sum, as on CUDA (the uncompiled blocks: the eager one)."""
    torch._dynamo.reset()
    sums = {"compiled": attention.compiled_sum_shares, "eager": attention.sum_shares}
    use = ["compiled"]
    monkeypatch.setattr(attention, "summer", lambda device, into=False: sums[use[0]])
    compiled = prepared(attention="segmented", compile_blocks=True)
    layouts = [((4, 4), (4, 4)), ((4, 6), (4, 6)), ((6, 4), (2, 4)), ((6, 6), (6, 4))]
    for layout in layouts[:2]:
        one_row(compiled, layout)
    graphs = probes.compiled_graphs()
    for layout in layouts[2:]:
        use[0] = "compiled"
        loss, grads = one_row(compiled, layout)
        assert probes.compiled_graphs() == graphs, f"layout {layout} compiled again"
        use[0] = "eager"
        other_loss, other = one_row(prepared(attention="segmented"), layout)
        assert torch.allclose(loss, other_loss, rtol=1e-5)
        assert all(torch.allclose(grads[n], other[n], atol=1e-6, rtol=1e-4) for n in grads)


def test_auto_attention_is_segmented_only_for_compiled_blocks_on_cuda():
    assert attention.processor_name("auto", compiled_on_cuda=True) == "segmented"
    assert attention.processor_name("flex", compiled_on_cuda=True) == "flex"
    assert attention.processor_name("auto", compiled_on_cuda=False) == "sdpa"
    assert attention.processor_name("segmented", compiled_on_cuda=True) == "segmented"


def test_an_fp8_base_trains_close_to_the_plain_form():
    """e4m3 frozen weights change the model a little: the loss within 2% and not bitwise equal, finite gradients."""
    loss, _ = loss_and_grads(prepared())
    fp8_loss, grads = loss_and_grads(prepared(fp8_base=True))
    assert fp8_loss != loss and fp8_loss == pytest.approx(loss.item(), rel=2e-2)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())


@pytest.fixture(scope="module")
def released_21(tmp_path_factory):
    """`python -m train.make_tiny --variant qwen_image_21 --full_size_configs`: the released configs, no weights."""
    from train import make_tiny

    out = tmp_path_factory.mktemp("released_21")
    make_tiny.main(["--out", str(out), "--variant", "qwen_image_21", "--num_samples", "4", "--full_size_configs"])
    return out / "model"


def test_full_size_configs_are_the_released_architecture(released_21):
    """32 single-stream blocks of width 4096 with a SwiGLU of 12288 over 64 latent channels; the transformer and
    Qwen3-VL-8B weigh what the released files hold in bf16 (14.5 GB, 17.5 GB) within 3%."""
    model = arch.empty_transformer(released_21)
    assert len(arch.transformer_blocks(model)) == 32 and model.inner_dim == 4096
    assert model.transformer_blocks[0].img_mlp.gate_layer.out_features == 12288 and model.config.in_channels == 64
    assert sum(p.numel() for p in model.parameters()) * 2 == pytest.approx(14.5e9, rel=0.03)
    assert arch.component_bytes(released_21, "text_encoder") == pytest.approx(17.5e9, rel=0.03)
    assert arch.attention_dims(released_21) == (32, 128) and not arch.keeps_attention(released_21)


def measured_21(tokens: int) -> Measured:
    """Block figures shaped as the GPU measurement of a Qwen-Image block gives them (tests/plan_helpers.py),
    scaled to 2.1's width (4096 against 3072) and its one stream: what a 2.1 measurement is expected to look like."""
    scale = tokens / 12_500
    return Measured(
        act_bytes=2.0 * GB * scale,
        ckpt_bytes=tokens * 4096 * 2,
        transient_bytes=5 * GB * scale,
        fwd_s=0.0065 * scale,
        fwd_bwd_s=0.02 * scale,
        h2d_bytes_per_s=25e9,
    )


def test_the_plan_sizes_and_chooses_for_the_released_2_1(released_21):
    """LoRA rank 64 on the default targets, an edit with one reference at 1 MP from the cache: the plan counts the
    released blocks and finds a setting at every budget from 141 GB down to 16 GB (fp8 base, then checkpointing,
    then offloaded blocks), predicted within the budget less its margin; below that it refuses in words that name
    no Qwen-Image model."""
    sizes = count_sizes(released_21, list(FAM.lora.targets), 64)
    assert sizes.num_blocks == 32
    assert sizes.block_params == 4 * 4096**2 + 3 * 4096 * 12288 + 2 * 128  # attention, SwiGLU MLP, q/k norms
    assert sizes.lora_params == 32 * 64 * (4 * 2 * 4096 + 2 * (4096 + 12288) + (12288 + 4096))
    tokens = 2 * 64 * 64 + batches.text_tokens_bound("qwen_image_21", 1, 1024 * 1024, 0)
    choices = {}
    for budget_gb in (141, 80, 48, 24, 16):
        budget = budget_gb * GB
        result = choose(sizes, measured_21(tokens), budget, gpu_margin(0, budget), {}, True, False)
        choice, pred = explain.choice_or_refusal(result, sizes, UNCOUNTED_HOST, {})
        assert pred.peak_bytes <= budget - gpu_margin(0, budget), budget_gb
        choices[budget_gb] = choice
    assert choices[141].checkpointed == 0 and choices[24].checkpointed > 0 and choices[16].offloaded > 0
    result = choose(sizes, measured_21(tokens), 8 * GB, gpu_margin(0, 8 * GB), {}, True, False)
    with pytest.raises(explain.PlanError) as e:
        explain.choice_or_refusal(result, sizes, UNCOUNTED_HOST, {})
    assert "nothing fits the memory budget" in str(e.value)
    assert not any(word in str(e.value) for word in ("Qwen", "2509", "60 blocks", "MMDiT"))


def test_the_plan_runs_a_2_1_block_at_a_workload(tiny_21):
    """The plan's mini transformer of 2.1 (its width, one block) takes the inputs arch.block_inputs builds for a
    workload (an odd-sized reference grid rounded to the 2x2 groups an image slot covers), and the largest bucket
    of 2.1 rows is the one with the most latent tokens, target first."""
    model = arch.mini_transformer(tiny_21, 1, torch.float32, torch.device("cpu"))
    work = Workload(2, 8 * 8 + 5 * 7, (8, 8), 40)
    with torch.no_grad():
        out = model(**arch.block_inputs(model, work, torch.float32, torch.device("cpu")))[0]
    assert out.shape[0] == 2 and out.shape[2] == model.config.out_channels
    keys = [((8, 8),), ((8, 8), (8, 8)), ((8, 8), (8, 8), (4, 4))]
    assert arch.largest_bucket(keys, 1, 300, "qwen_image_21") == Workload(1, 144, (8, 8), 300)


def test_make_tiny_s_options_for_2_1(tmp_path, capsys):
    """--references N gives every 2.1 row N references (one slot layout, for a benchmark row); the MMDiT's options
    are refused for 2.1, --references for the MMDiT."""
    from train import make_tiny
    from train.data.rows import read_rows
    from train.model.qwen_image21.tiny import make_dataset

    make_dataset(tmp_path / "data", num_samples=3, size=64, references=3)
    rows, _ = read_rows(tmp_path / "data")
    assert [len(r.references) for r in rows] == [3, 3, 3] and len({tuple(r.references) for r in rows}) == 3
    for argv, words in (
        (["--variant", "qwen_image_21", "--vae", "pooling"], "leave them out for --variant qwen_image_21"),
        (["--variant", "edit", "--references", "1"], "--references is 0-10 and for --variant qwen_image_21 only"),
    ):
        with pytest.raises(SystemExit):
            make_tiny.main(["--out", str(tmp_path / "out"), *argv])
        assert words in capsys.readouterr().err


def test_the_streamed_load_trains_like_the_prepared_model(tiny_21):
    """prepare.load_for_training on the 2.1 checkpoint (weights streamed into their training form: fp8 linears
    quantised as they load, both blocks' frozen weights in host memory, checkpointed, segmented attention) gives the
    loss and gradients of the from_pretrained transformer prepared alike."""
    from diffusers import QwenImage21Transformer2DModel

    from train.model import fp8

    options = dict(gradient_checkpointing=True, compile_blocks=False, fp8_base=True, attention="segmented")
    torch.manual_seed(0)
    streamed, offloader = prepare.load_for_training(
        tiny_21, torch.float32, torch.device("cpu"), "lora", LORA, offload_blocks=2, **options
    )
    assert len(offloader.blocks) == 2
    assert sum(isinstance(m, fp8.Float8FrozenLinear) for m in streamed.modules()) == 2 * len(FAM.lora.targets)
    torch.manual_seed(0)
    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_21, subfolder="transformer")
    prepare.prepare_for_training(reference, "lora", LORA, **options)
    loss, grads = loss_and_grads(streamed.train())
    other_loss, other = loss_and_grads(reference.train())
    assert torch.equal(loss, other_loss) and all(torch.equal(grads[n], other[n]) for n in grads)
