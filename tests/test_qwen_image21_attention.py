"""train/model/qwen_image21/attention.py against diffusers' own QwenImage21AttnProcessor: the tiny 2.1 transformer's
output and every gradient (weights and inputs) in float32 on CPU, for the layouts a micro-batch can hold; its SDPA
calls take no mask unless rows are padded; sampling with the pipeline's prefix KV cache gives the same latents."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.models.transformers import transformer_qwenimage21
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

from train.model import kept_attention
from train.model.qwen_image import rope
from train.model.qwen_image21 import attention
from train.model.qwen_image21 import rope as rope21
from train.model.qwen_image21.tiny import build_transformer
from train.runtime import probes

TEXT_BEFORE, TEXT_BETWEEN = 3, 2  # prompt tokens before the first image slot and between two references' slots


def layout_inputs(
    model, references: list[tuple[int, int]], target: tuple[int, int], prompt_lengths: list[int], seed: int = 0
) -> dict:
    """Random transformer inputs for one slot layout: references' latent grids, the target's, one row per prompt
    length (shorter ones right-padded and masked, as the conditioning pads them)."""
    generator = torch.Generator().manual_seed(seed)
    batch, longest = len(prompt_lengths), max(prompt_lengths)
    slots = [False] * TEXT_BEFORE
    for k, (h, w) in enumerate(references):
        slots += [True] * (h * w // 4) + [False] * (TEXT_BETWEEN if k < len(references) - 1 else 0)
    slots += [False] * longest
    num_text = len(slots)
    mask = torch.stack([torch.arange(num_text) < num_text - longest + n for n in prompt_lengths]).long()
    img_mask = torch.tensor(slots + [True] * (target[0] * target[1] // 4)).expand(batch, -1)
    num_latents = sum(h * w for h, w in [*references, target])
    return dict(
        hidden_states=torch.randn(batch, num_latents, model.config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, num_text, model.config.context_in_dim, generator=generator),
        encoder_hidden_states_mask=None if bool(mask.all()) else mask,
        timestep=torch.rand(batch, generator=generator),
        img_shapes=[[*((1, h, w) for h, w in references), (1, *target)]] * batch,
        img_mask=img_mask,
        return_dict=False,
    )


LAYOUTS = {
    "text_to_image": ([], (4, 4), [7]),
    "one_reference": ([(4, 6)], (4, 4), [9]),
    "three_references": ([(4, 4), (2, 6), (6, 4)], (4, 6), [8]),
    "batch_of_two": ([(2, 4), (4, 4)], (4, 4), [6, 6]),
    "batch_of_two_padded": ([(4, 4)], (4, 4), [10, 6]),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_transformer().float()


def forward_backward(model, processor_class, inputs: dict) -> dict[str, torch.Tensor]:
    """Output and the gradients of a fixed random projection of it, for every weight and float input."""
    for block in model.transformer_blocks:
        block.attn.set_processor(processor_class())
    model.zero_grad(set_to_none=True)
    leaves = {
        k: v.clone().requires_grad_(True) for k, v in inputs.items() if k in ("hidden_states", "encoder_hidden_states")
    }
    output = model(**{**inputs, **leaves})[0]
    projection = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    (output * projection).sum().backward()
    grads = {f"grad {name}": p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"output": output.detach(), **{f"grad {k}": v.grad for k, v in leaves.items()}, **grads}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_equal_diffusers_processor(model, layout):
    inputs = layout_inputs(model, *LAYOUTS[layout])
    expected = forward_backward(model, QwenImage21AttnProcessor, inputs)
    ours = forward_backward(model, attention.SegmentedSDPAProcessor, inputs)
    assert ours.keys() == expected.keys() and len(expected) > 10
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_real_rotary_pairs_equal_diffusers_complex_rotation(model, monkeypatch):
    """Real (cos, sin) pairs in the 2.1 blocks (train/model/qwen_image21/rope.py): the output and every gradient as
    with diffusers' complex rotation, and every block's q and k went through the real product."""
    # the module function is restored after the test
    monkeypatch.setattr(transformer_qwenimage21, "apply_rotary_emb_qwen", transformer_qwenimage21.apply_rotary_emb_qwen)
    inputs = layout_inputs(model, *LAYOUTS["three_references"])
    expected = forward_backward(model, QwenImage21AttnProcessor, inputs)
    real = copy.deepcopy(model)
    rope21.use_real_pairs(real)
    rope21.use_real_pairs(real)  # idempotent: one hook, one wrapper
    assert len(real.pos_embed._forward_hooks) == 1
    assert transformer_qwenimage21.apply_rotary_emb_qwen.original.__module__ == transformer_qwenimage21.__name__
    calls = []
    original = rope.rotate_pairs
    monkeypatch.setattr(rope, "rotate_pairs", lambda x, pairs: calls.append(pairs.shape) or original(x, pairs))
    ours = forward_backward(real, QwenImage21AttnProcessor, inputs)
    assert len(calls) == 2 * len(real.transformer_blocks) and all(s[-1] == 2 for s in calls)
    assert ours.keys() == expected.keys() and len(expected) > 10
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_kernel_calls_without_padding_and_diffusers_processor_with_it(model, monkeypatch):
    """Three references: per block one kernel call per reference, two per text run after the first (the split), one
    for the first text run and one for the target, and as many backward calls; a padded batch goes to diffusers'
    processor."""
    forward, backward = [], []
    fused_forward, fused_backward = kept_attention.fused_forward, kept_attention.fused_backward

    def spy_forward(q, k, v, scale, is_causal=False, **into):
        forward.append((q.shape[2], k.shape[2], is_causal))
        return fused_forward(q, k, v, scale, is_causal, **into)

    def spy_backward(grad, q, k, v, out, lse, scale, is_causal=False, into=(None, None, None)):
        backward.append((q.shape[2], k.shape[2], is_causal))
        return fused_backward(grad, q, k, v, out, lse, scale, is_causal, into)

    monkeypatch.setattr(kept_attention, "fused_forward", spy_forward)
    monkeypatch.setattr(kept_attention, "fused_backward", spy_backward)
    masked = []
    diffusers_call = QwenImage21AttnProcessor.__call__
    monkeypatch.setattr(
        QwenImage21AttnProcessor, "__call__", lambda *a, **kw: masked.append(1) or diffusers_call(*a, **kw)
    )
    inputs = layout_inputs(model, *LAYOUTS["three_references"])
    forward_backward(model, attention.SegmentedSDPAProcessor, inputs)
    blocks = len(model.transformer_blocks)
    per_block = 3 + 1 + 2 * 3 + 1
    assert len(forward) == per_block * blocks and sorted(forward) == sorted(backward) and not masked
    assert sum(causal for *_, causal in forward) == 4 * blocks
    length = max(keys for _, keys, _ in forward)
    assert forward.count((4 * 6, length, False)) == blocks  # the target's queries over every key
    forward.clear()
    forward_backward(model, attention.SegmentedSDPAProcessor, layout_inputs(model, *LAYOUTS["batch_of_two_padded"]))
    assert not forward and len(masked) == blocks


@pytest.mark.parametrize("capability, fused", [((9, 0), True), ((7, 5), False)])
def test_the_processor_reads_whether_the_gpu_has_the_fused_kernels(monkeypatch, capability, fused):
    """The processor's check, which compiled blocks trace, reads a flag read from the device when the processor is
    made (a GPU without the fused kernels, compute capability < 8.0, takes diffusers' masked calls)."""
    monkeypatch.setattr(kept_attention, "_cuda_ok", False)  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    attention.SegmentedSDPAProcessor()
    assert kept_attention._cuda_ok is fused


@pytest.mark.parametrize("prompts", [["make it blue"], ["make it blue", "a square"]], ids=["one_prompt", "padded"])
def test_sampling_with_prefix_cache_equals_diffusers_processor(tiny_21, prompts):
    """The pipeline's prefix KV cache (first step fills it, the next reads it) through the segmented processor: its
    own kernel calls for one prompt, diffusers' masked calls for prompts of different lengths."""
    from PIL import Image

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21)
    pipe.set_progress_bar_config(disable=True)
    image = Image.new("RGBA", (96, 64), (200, 30, 30, 128))

    def sample():
        return pipe(
            prompt=prompts,
            image=[image],
            num_inference_steps=3,
            output_resolution=64,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).images

    expected = sample()
    attention.set_attention(pipe.transformer, "segmented", False)
    torch.testing.assert_close(sample(), expected, rtol=1e-4, atol=1e-5)


def test_attention_probe_times_each_processor_on_one_layout():
    """The GPU probe of train/benchmarks/attention21.py at a tiny width on the CPU (flex left to the GPU run)."""
    from train.benchmarks import attention21

    args = attention21.parse_args(
        [
            "--references",
            "2",
            "--target",
            "4x4",
            "--prompt_tokens",
            "5",
            "--width",
            "32",
            "--heads",
            "2",
            "--steps",
            "1",
        ]
    )
    record = attention21.run(args)
    assert set(record["seconds"]) == {"diffusers", "segmented"} and min(record["seconds"].values()) > 0
    assert "segmented" in attention21.format_report(record)
    assert record["kernel"] in torch.nn.attention.SDPBackend.__members__
    assert f"SDPA picks {record['kernel']}" in attention21.format_report(record)
    with pytest.raises(ValueError, match="--kinds"):
        attention21.run(attention21.parse_args(["--kinds", "dense"]))


def test_the_compiled_sum_of_key_shares_writes_what_the_eager_one_does():
    """The backward's sum of gradient shares, compiled by inductor as CUDA runs it (compiled_sum, dynamic shapes),
    writes into a slice of the gradient exactly what the eager function writes, and a region of another size reuses
    the graph."""
    torch._dynamo.reset()
    compiled = attention.compiled_sum(3)
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for length in (5, 9, 7):
        whole = torch.randn(1, length + 3, 2, 8, generator=generator).to(torch.bfloat16).transpose(1, 2)
        shares = [whole[:, :, 3:], *(torch.randn(1, 2, length, 8, generator=generator).to(torch.bfloat16)
                                     for _ in range(2))]
        expected, got = (torch.zeros(1, 2, length + 4, 8, dtype=torch.bfloat16) for _ in range(2))
        attention.sum_shares(expected[:, :, 2:-2], *shares)
        compiled(got[:, :, 2:-2], *shares)
        assert torch.equal(got, expected) and bool(expected[:, :, 2:-2].abs().sum() > 0)
        into, target = got[:, :, 2:-2], torch.randn(1, 2, length, 8, generator=generator).to(torch.bfloat16)
        into.copy_(target)  # the target call's share, written by the kernel, added last: sum_shares' order
        attention.compiled_sum(3, fn=attention.sum_shares_into)(into, *shares)
        attention.sum_shares(expected[:, :, 2:-2], *shares, target)
        assert torch.equal(got, expected)
        graphs.append(probes.compiled_graphs())
    assert graphs[2] == graphs[1], "a third size compiled again"


def test_every_number_of_key_shares_has_a_compiled_sum_of_its_own():
    """Layouts with many references sum many shares: each count compiles its own graph and writes what the eager
    sum writes, past dynamo's recompile limit per function (after which one shared function would run eagerly)."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    for count in range(1, torch._dynamo.config.recompile_limit + 5):
        shares = [torch.randn(1, 2, 3, 4, generator=generator).to(torch.bfloat16) for _ in range(count)]
        expected, got = torch.empty(1, 2, 3, 4, dtype=torch.bfloat16), torch.empty(1, 2, 3, 4, dtype=torch.bfloat16)
        graphs = probes.compiled_graphs()
        attention.compiled_sum(count, backend="eager")(got, *shares)
        assert probes.compiled_graphs() == graphs + 1, f"{count} shares ran without compiling"
        attention.sum_shares(expected, *shares)
        assert torch.equal(got, expected)
    assert attention.summer(torch.device("cpu")) is attention.sum_shares
    assert attention.summer(torch.device("cuda")) is attention.compiled_sum_shares
    assert attention.summer(torch.device("cuda"), into=True) is attention.compiled_sum_shares_into


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sdpa", "fa4"])
@pytest.mark.parametrize("references", [0, 1, 3])
def test_the_op_in_bfloat16_on_cuda_errs_as_dense_attention_does(references, kernel, monkeypatch):
    """On the GPU's fused kernels in bf16 (SDPA's; FlashAttention-4's where installed, whose causal calls align
    bottom-right), the op's output and gradients are as close to float32 attention under the dense block-causal mask
    as bf16 SDPA under that mask is (within 1.25x: the key shares are summed apart)."""
    monkeypatch.setattr(kept_attention, "_external", None)  # use_kernel sets it; put back after the test
    try:
        kept_attention.use_kernel(kernel, torch.device("cuda"))
    except RuntimeError as e:
        pytest.skip(str(e))
    kept_attention.detect_cuda()  # as set_attention does before a run: eligible() reads what it found
    assert kept_attention.eligible(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    torch.manual_seed(0)
    runs = [False] * 10
    for k in range(references):
        runs += [True] * 512 + [False] * (8 if k < references - 1 else 0)
    image = torch.tensor(runs + [False] * 150 + [True] * 1024, device="cuda")
    ids, target = transformer_qwenimage21.QwenImage21Transformer2DModel.build_token_metadata(
        image, [(1, 16, 32)] * references + [(1, 32, 32)])
    segments = transformer_qwenimage21._qwenimage21_prefix_segments(ids, int((~target).sum()))
    pos = torch.arange(image.numel(), device="cuda")
    allowed = (pos[:, None] >= pos[None, :]) | ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))
    qkv = [torch.randn(2, image.numel(), 8, 128, device="cuda") for _ in range(3)]
    grad = torch.randn(2, 8, image.numel(), 128, device="cuda")

    def run(op: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        q, k, v = (x.to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in qkv)
        out = (attention.block_causal_attention(q, k, v, segments) if op
               else torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
        (out.float() * grad).sum().backward()
        return [t.float() for t in (out, q.grad, k.grad, v.grad)]

    exact = run(False, torch.float32)
    op_err, dense_err = ([float((a - b).norm() / b.norm()) for a, b in zip(run(op, torch.bfloat16), exact, strict=True)]
                         for op in (True, False))
    assert all(o <= 1.25 * d for o, d in zip(op_err, dense_err, strict=True)), (op_err, dense_err)
