"""Out-of-memory advice (train/runtime/oom.py): each phase's settings, the step's advice without what is already in
effect, and torch's own figures shortened."""

from __future__ import annotations

import dataclasses

from train.runtime.oom import InEffect, OutOfMemory, oom_advice, torch_oom_figures


def test_oom_advice_names_each_phases_settings():
    step = oom_advice("step", 1)
    assert "gradient_checkpointing = true" in step and "offload_blocks" in step and "micro_batch" not in step
    assert "zero_optimization.offload_optimizer" in step
    assert "train_micro_batch_size_per_gpu = 1" in oom_advice("step", 2)
    assert "fp8_base" in oom_advice("load", 1) and "data.cache" in oom_advice("load", 1)
    assert 'data.cache "auto"' in oom_advice("encode", 1)
    cache = oom_advice("cache", 4)  # the build encodes one row at a time, so no micro-batch advice
    assert "python -m train.cache" in cache and "margin_gb" in cache and "micro_batch" not in cache
    assert "inference.area" in oom_advice("validation", 4)
    assert "micro_batch" not in oom_advice("validation", 4)
    assert OutOfMemory("x").without_traceback


def test_the_step_advice_leaves_out_what_is_in_effect():
    """With the plan's settings known, the step's advice does not suggest what the run already does (its 16 GB
    choice checkpoints and offloads every block, in fp8, with DeepSpeed's optimizer offload); it says how many
    blocks are offloaded and points at the plan's margin. Without the plan, the keys to set by hand."""
    everything = InEffect(True, 60, True, True, True, 0.0)
    step = oom_advice("step", 1, everything)
    for already in ("gradient_checkpointing", "fp8_base", "offload_optimizer", "micro_batch"):
        assert already not in step, (already, step)
    assert "now 60" in step and "qwen_edit.memory.margin_gb (now automatic" in step and "data.area" in step
    by_hand = oom_advice("step", 2, InEffect(False, 0, False, False, False, 0.0))
    for lever in (
        "gradient_checkpointing = true",
        "fp8_base = true",
        "offload_optimizer",
        'memory.plan "auto"',
        "train_micro_batch_size_per_gpu = 1",
    ):
        assert lever in by_hand, (lever, by_hand)
    assert "margin_gb (now 3 GB)" in oom_advice("step", 1, dataclasses.replace(everything, margin_gb=3.0))


def test_torch_oom_figures_are_shortened():
    """torch's own figures of a CUDA out-of-memory error (its message as torch 2.x words it) reach the run's
    message; an error without them adds nothing on a machine without CUDA."""
    e = RuntimeError(
        "CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a total capacity of 139.72 GiB of "
        "which 120.51 GiB is free. Including non-PyTorch memory, this process has 14.90 GiB memory in "
        "use. Of the allocated memory 13.85 GiB is allocated by PyTorch, and 0.51 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large ..."
    )
    figures = torch_oom_figures(e)
    assert figures.startswith(
        " (torch: tried to allocate 1.20 GiB; 13.85 GiB allocated and 0.51 GiB reserved but free"
    ), figures
    assert torch_oom_figures(RuntimeError("CUDA out of memory (injected)")) == ""
