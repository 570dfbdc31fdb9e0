"""train/model/qwen_image21/forward.py against diffusers' QwenImage21Transformer2DModel.forward on the tiny 2.1
transformer in float32 on the CPU: the output and every gradient for each layout a micro-batch can hold (padded
prompts, two rows), with either attention processor and with checkpointed blocks; the layout's metadata made once."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from test_qwen_image21_attention import LAYOUTS, forward_backward, layout_inputs

from train.model import prepare
from train.model.qwen_image21 import attention, forward
from train.model.qwen_image21.tiny import build_transformer


@pytest.fixture(scope="module")
def models():
    """(diffusers' forward, the layout-cached one): two copies of one tiny transformer."""
    torch.manual_seed(0)
    plain = build_transformer().float()
    cached = copy.deepcopy(plain)
    forward.use_layout_cache(cached)
    return plain, cached


@pytest.mark.parametrize("processor", [QwenImage21AttnProcessor, attention.SegmentedSDPAProcessor])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_output_and_gradients_equal_diffusers_forward(models, layout, processor):
    plain, cached = models
    inputs = layout_inputs(plain, *LAYOUTS[layout])
    expected = forward_backward(plain, processor, inputs)
    ours = forward_backward(cached, processor, inputs)
    assert ours.keys() == expected.keys() and len(expected) > 10
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name


def test_checkpointed_blocks_and_a_second_call_equal_diffusers_forward(models):
    plain, cached = (copy.deepcopy(m) for m in models)
    assert cached.forward.__self__ is cached
    for model in (plain, cached):
        model.enable_gradient_checkpointing(prepare.checkpoint_first(model.transformer_blocks, 0))
    inputs = layout_inputs(plain, *LAYOUTS["three_references"])
    expected = forward_backward(plain, attention.SegmentedSDPAProcessor, inputs)
    for _ in range(2):
        ours = forward_backward(cached, attention.SegmentedSDPAProcessor, inputs)
        assert all(torch.equal(ours[name], value) for name, value in expected.items())


def test_each_layout_is_made_once_and_the_least_recent_goes(models, monkeypatch):
    cached = copy.deepcopy(models[1])
    forward.use_layout_cache(cached)  # idempotent
    cached._qwen_edit_layouts.clear()
    made = []
    real = forward.layout
    monkeypatch.setattr(forward, "layout", lambda *args: made.append(args[2]) or real(*args))
    monkeypatch.setattr(forward, "LAYOUTS", 2)
    order = ["one_reference", "text_to_image", "one_reference", "three_references", "text_to_image"]
    with torch.no_grad():
        for name in order:
            cached(**layout_inputs(cached, *LAYOUTS[name]))
    # one_reference kept by its second use; three_references pushes text_to_image out, which is made again
    assert [len(shapes) for shapes in made] == [2, 1, 4, 1]
    assert len(cached._qwen_edit_layouts) == 2


def test_calls_it_does_not_cover_go_to_diffusers_forward(models, monkeypatch):
    _, cached = models
    inputs = layout_inputs(cached, *LAYOUTS["one_reference"])
    monkeypatch.setattr(forward, "_cached", lambda *args: pytest.fail("the layout cache was used"))
    with torch.no_grad():
        output = cached(**{**inputs, "return_dict": True}).sample
        assert torch.equal(output, cached(**{**inputs, "attention_kwargs": {"scale": 1.0}})[0])
