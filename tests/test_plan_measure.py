"""Blocks measured and workloads built (train/plan/measure.py, the family's hooks in train/plan/arch.py): the
largest bucket and the prompt's bound, the block timings' alternation and medians under a driven clock, a
validation render's measurement on the tiny model, the VAE's path, and the render workload as the pipelines size
it. The byte counts themselves need CUDA; here the counters or the calls report sizes."""

from __future__ import annotations

import pytest
from plan_helpers import measured

from train.config import LoraConfig, ProjectConfig
from train.plan import measure
from train.plan.arch import largest_bucket, render_workload, text_tokens_bound
from train.plan.measure import encode_transient, measure_render
from train.plan.run_plan import validation_workload
from train.plan.workload import Workload


def test_largest_bucket_and_text_bound():
    keys = [((128, 128), (128, 128)), ((128, 128), (128, 128), (128, 128)), ((64, 64), (64, 64))]
    w = largest_bucket(keys, 2, 700, "edit")
    assert w.image_tokens == 3 * 64 * 64 and w.target_hw == (128, 128) and w.batch == 2
    assert text_tokens_bound("edit_plus", 2, 1024 * 1024, 384 * 384) == 320 + 2 * 188
    assert text_tokens_bound("edit", 1, 1024 * 1024, 384 * 384) == 320 + 1337


def test_block_times_alternate_the_models_and_take_the_median_of_paired_differences(monkeypatch):
    """_run alternates its models pass by pass, leaves out the warm-up rounds (the first compiles) and keeps
    every timed pass, so that measure takes a block's time as the median of the paired differences of one round:
    a drift of the GPU's clocks during the measurement, or one slow pass, does not move the plan's step;
    the bytes are each model's last pass. CUDA's counters and the clock are driven by the test."""
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
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    (k1, t1, f1, b1), (k2, t2, f2, b2) = measure._run(
        [Block("one"), Block("two")], {"x": torch.ones(3)}, torch.device("cpu")
    )
    assert order == ["one", "two"] * 7
    assert f1 == pytest.approx([0.01, 0.01, 0.03, 0.03, 0.01]) and len(b2) == 5  # the warm-up rounds left out
    assert measure._median_difference(f2, f1) == pytest.approx(0.006)
    assert measure._median_difference(b2, b1) == pytest.approx(0.016)
    assert (k1, t1, k2, t2) == (13, 130, 14, 140)  # each model's last pass: the 13th and 14th
    assert next(passes) == 15 and next(clock, None) is None


def _tiny_render(tiny_plus, w: Workload, vae_2d_frames: bool = True):
    """measure_render of the tiny 2509 model on the CPU in float32, LoRA r4 without fp8, encoding online."""
    import torch

    cpu = torch.device("cpu")
    return measure_render(
        measured(100),
        tiny_plus / "model",
        w,
        torch.float32,
        torch.float32,
        cpu,
        "lora",
        LoraConfig(rank=4, target_modules=["attn.to_q"]),
        fp8_base=False,
        online=True,
        vae_2d_frames=vae_2d_frames,
    )


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

    monkeypatch.setattr(measure, "peak_above", peak_above)
    w = render_workload([[(64, 64), (64, 64)]], "edit_plus", 64 * 64, 32 * 32)
    m = _tiny_render(tiny_plus, w)
    h, wd = w.target_hw
    # the packed target + references (arch.block_inputs lays the references out as one near-square grid)
    assert calls[0][0] == 1 and 0.9 * w.image_tokens <= calls[0][1] <= w.image_tokens == 16 + 2 * 16
    assert calls[1][-2:] == (h * 8, wd * 8) and calls[2][-2:] == (h, wd)  # decode, encode (untiled)
    assert len(calls) == 5 and m.render_forward_bytes == calls[0][0] * calls[0][1] * calls[0][2]
    assert m.render_vae_bytes == m.render_vae_tiled_bytes > 0  # below the tile size the two are the same


def test_the_vae_measurements_take_the_configured_path(tiny_plus, monkeypatch):
    """model.vae_2d_frames reaches the VAE that the render and encode measurements load: with it off they measure
    diffusers' own path (its chunk cache is larger), so a plan never counts the smaller transient for it."""
    import torch
    from conftest import patch_family

    from train.model import family
    from train.model.qwen_image import vae_frames

    seen = []
    load = family.family_named("qwen_image").load_vae

    def load_vae(*args, **kwargs):
        vae = load(*args, **kwargs)
        seen.append(vae_frames.is_applied(vae))
        return vae

    patch_family(monkeypatch, load_vae=load_vae)
    monkeypatch.setattr(measure, "peak_above", lambda device, call, repeats=2: 1.0)
    w = render_workload([[(64, 64)]], "edit_plus", 64 * 64, 32 * 32)
    for on in (True, False):
        _tiny_render(tiny_plus, w, vae_2d_frames=on)
        encode_transient(tiny_plus / "model", torch.device("cpu"), Workload(1, 0, (8, 8), 0), on)
    assert seen == [True, True, False, False]


def test_render_workload_is_the_pipelines_sizes():
    """Target sized from the last reference, every reference at inference.area, batch 1."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    w = render_workload([[(1024, 1024), (1024, 1024)], [(512, 512)]], "edit_plus", 1024 * 1024, 384 * 384)
    assert w == Workload(1, 3 * 64 * 64, (128, 128), 320 + 2 * 188)
    wide = render_workload([[(1024, 1024), (2000, 1000)]], "edit_plus", 1024 * 1024, 384 * 384)
    width, height = calculate_dimensions(1024 * 1024, 2.0)  # the pipeline's own sizing: 1440 x 736 px
    assert wide.target_hw == (height // 8, width // 8) == (92, 180)
    assert wide.image_tokens == 2 * (height // 16) * (width // 16) + 64 * 64
    t2i = render_workload([[]], "t2i", 512 * 512, 384 * 384)
    assert t2i == Workload(1, 32 * 32, (64, 64), 320)


def test_validation_workload_reads_the_files_images(tmp_path):
    """validation.file's references are sized from their headers: the widest edit sets the render's tokens."""
    from PIL import Image

    Image.new("RGB", (640, 320)).save(tmp_path / "wide.png")
    Image.new("RGB", (300, 300)).save(tmp_path / "square.png")
    (tmp_path / "val.jsonl").write_text(
        '{"edit_image": "square.png", "prompt": "a"}\n{"edit_image": ["square.png", "wide.png"], "prompt": "b"}\n'
    )
    project = ProjectConfig()
    project.validation.file = str(tmp_path / "val.jsonl")
    project.inference.area = 256 * 256
    w = validation_workload(project, "edit_plus")
    assert w == render_workload(
        [[(300, 300)], [(300, 300), (640, 320)]], "edit_plus", 256 * 256, project.inference.condition_area
    )
    # the target follows the last (wide) reference; two references in the prompt bound
    assert w.target_hw[1] > w.target_hw[0] and w.text_tokens == 320 + 2 * project.inference.condition_area // 784
