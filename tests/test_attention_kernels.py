"""The attention-kernel probe (train/benchmarks/attention_kernels.py) on the CPU: its calls cover exactly the
block-causal mask's allowed pairs, the op's kernel runs and agrees with float32 math, and a kernel this machine
cannot run is reported, not raised."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage21 as T

from train.benchmarks import attention21, attention_kernels


@pytest.mark.parametrize("references", [0, 1, 3])
def test_the_calls_count_the_allowed_pairs_of_the_mask(references):
    """The probe's FLOP count rests on its calls' pairs: their sum is the number of query-key pairs the pipeline's
    block-causal mask allows (text causal, an image bidirectional within itself, everything before it visible)."""
    calls, length = attention_kernels.layer_calls(references, (4, 6), 7)
    mask, shapes = attention21.layout(references, (4, 6), 7)
    ids, _ = T.QwenImage21Transformer2DModel.build_token_metadata(mask, shapes)
    pos = torch.arange(length)
    allowed = (pos[:, None] >= pos[None, :]) | ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))
    assert length == mask.numel()
    assert sum(attention_kernels.pairs(c) for c in calls) == int(allowed.sum())


def test_the_probe_times_the_ops_kernel_and_reports_what_cannot_run():
    args = attention_kernels.parse_args(["--references", "2", "--target", "4x4", "--prompt_tokens", "5",
                                         "--heads", "2", "--head_dim", "16", "--steps", "1"])
    record = attention_kernels.run(args)
    sdpa = record["kernels"]["sdpa"]
    assert sdpa["forward_s"] > 0 and sdpa["backward_s"] > 0 and sdpa["forward_tflops"] > 0
    assert max(sdpa["max_abs_error"].values()) < 1e-4  # float32 on the CPU
    assert "fa4" in record["not_available"] and "compute capability" in record["not_available"]["fa4"]
    report = attention_kernels.format_report(record)
    assert "sdpa" in report and "fa4   not available" in report
    with pytest.raises(SystemExit, match="--kernels"):
        attention_kernels.run(attention_kernels.parse_args(["--kernels", "xformers"]))
