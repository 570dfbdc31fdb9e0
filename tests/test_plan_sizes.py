"""Sizes counted (train/plan/sizes.py, the encoders' bytes of train/plan/arch.py): the released transformer's
parameters, an offloaded block's host buffer, the shipped DeepSpeed configs' gradient buckets, the text encoder's
bytes while it streams. DeepSpeed's own buffers are checked in tests/test_plan_deepspeed.py."""

from __future__ import annotations

import dataclasses

import pytest
from plan_helpers import QWEN_LORA
from recorded_plans import ENCODERS_BYTES, RELEASED, ZERO2_BUCKETS

from train.config import LoraConfig
from train.model.qwen_image.tiny import make_tiny, write_full_size_configs
from train.plan.arch import component_bytes, encoder_weight_bytes, streamed_vl_bytes
from train.plan.sizes import GB, Sizes, bucket_sizes, count_sizes, moved_bytes, optimizer_host_bytes, pinned_bytes


def test_counted_sizes_are_the_released_model(released_model, tmp_path):
    """count_sizes of the released configs is the recorded plans' RELEASED (v1 and 2509 share the transformer), and
    the text encoder and VAE weigh ENCODERS_BYTES in bf16."""
    v1 = make_tiny(tmp_path, "edit", num_samples=2, size=64) / "model"
    write_full_size_configs(v1)
    s = count_sizes(released_model, QWEN_LORA.target_modules, 64)
    assert s == count_sizes(v1, QWEN_LORA.target_modules, 64) == RELEASED
    assert encoder_weight_bytes(released_model) == ENCODERS_BYTES
    total = s.num_blocks * s.block_params + s.other_params
    assert s.num_blocks == 60 and abs(total - 20.43e9) < 0.01e9  # DESIGN.md: 20.43 B parameters
    assert s.block_fp8_params / s.block_params > 0.99  # the converted linears are nearly all of a block
    assert s.block_token_params / s.block_fp8_params == pytest.approx(2 / 3, abs=0.01)  # mod linears are 1/3
    # LoRA r64 on the 12 default projections: r * (in + out) per linear per block
    per_block = 64 * (8 * (3072 + 3072) + 2 * (3072 + 12288) + 2 * (12288 + 3072))
    assert s.lora_params == 60 * per_block


def test_pinned_host_bytes_are_what_the_offloader_pins(tiny_plus):
    """moved_bytes is the size of an offloaded block's host buffer (train/model/offload.py), bf16-sized and fp8, up to
    the offloader's 256-byte alignment of each tensor."""
    import torch

    from train.model import offload, prepare

    lora = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q"])
    s = count_sizes(tiny_plus / "model", lora.target_modules, lora.rank)
    for fp8_base in (False, True):
        _, offloader = prepare.load_for_training(
            tiny_plus / "model",
            torch.float32,
            torch.device("cpu"),
            "lora",
            lora,
            True,
            False,
            fp8_base,
            0,
            False,
            offload_blocks=2,
        )
        tensors = sum(len(layout.entries) for layout in offloader.layouts.values())
        expected = 2 * moved_bytes(s, fp8_base, dtype_bytes=4)
        assert expected <= offloader.host_bytes <= expected + tensors * offload.ALIGN, fp8_base


def test_the_shipped_configs_buckets():
    """zero2.json overlaps its reduction with the backward: two buckets of 2e8 bf16 gradients (0.8 GB) are counted;
    lora_fast.json (stage 1, no contiguous gradients) none, unless DeepSpeed's optimizer offload turns them on."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "ds_configs"
    ds = {name: json.loads((shipped / f"{name}.json").read_text()) for name in ("zero2", "lora_fast")}
    zero2 = Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=2, **bucket_sizes(ds["zero2"]))
    fast = Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=1, **bucket_sizes(ds["lora_fast"]))
    assert zero2.bucket_bytes(False) == zero2.bucket_bytes(True) == 0.8e9
    assert bucket_sizes(ds["zero2"]) == ZERO2_BUCKETS  # what the recorded plans count
    assert fast.bucket_bytes(False) == 0 and fast.bucket_bytes(True) == 0.4e9


def test_streamed_vl_bytes_are_what_stays_outside_the_blocks(released_model):
    """Qwen2.5-VL-7B streamed by block: every parameter but the decoder layers' and ViT blocks' matrices
    (embeddings, lm_head, patch embedding, merger, vectors) plus two slots of each list's largest block, in bf16;
    counted again here by name."""
    import re

    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        vl = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(released_model / "text_encoder"))
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
    assert streamed_vl_bytes(released_model) == expected
    assert 2.5 * GB < expected < 4 * GB < component_bytes(released_model, "text_encoder") / 4


def test_pinned_host_buffers_round_up_to_a_power_of_two(released_model):
    """torch's pinned allocator rounds each tensor up to a power of two, so DeepSpeed's offloaded optimizer state of
    a 6.156 B-parameter full fine-tune on one rank takes 135 GB, not the 110.8 GB of a flat 18 bytes per parameter.
    Gradient accumulation pins a bf16 tensor per trainable parameter too, which the plan counts for the released
    model when the run accumulates (run_sizes sets `accumulating`): every LoRA r64 matrix rounded up by a third, a
    full fine-tune's tensors by 1.58x (65 GB)."""
    assert pinned_bytes(3 * 2**30) == 4 * 2**30 and pinned_bytes(2**30) == 2**30 and pinned_bytes(0) == 0
    assert optimizer_host_bytes(6_156_000_000, 1) / GB == pytest.approx(135.1, abs=0.1)
    lora_sizes = count_sizes(released_model, QWEN_LORA.target_modules, 64)
    accumulating = dataclasses.replace(lora_sizes, accumulating=True)
    assert accumulating.host_state_bytes(1) - lora_sizes.host_state_bytes(1) == lora_sizes.accumulation_pinned
    assert lora_sizes.accumulation_pinned / (2 * lora_sizes.lora_params) == pytest.approx(4 / 3)
    full = count_sizes(released_model, [], 0, full=True)
    assert full.accumulation_pinned / GB == pytest.approx(64.6, abs=0.1)
