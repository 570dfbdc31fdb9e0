"""train.bench --floor: the census of the step's calls, and the CPU run of the floor row (its fields and ratio).

Timings are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage

from train.benchmarks import build, floor, options, step
from train.benchmarks.workload import FAMILY, make_workload
from train.config import TrainConfig
from train.model import kept_attention
from train.model.qwen_image.tiny import SCHEDULER_CONFIG
from train.trainer import loop

REPO = Path(__file__).resolve().parent.parent


def test_census_finds_the_calls_the_step_makes():
    """The tiny model with an fp8 base and LoRA on the attention: one attention per block, the 12 token linears of a
    block in fp8, its 2 modulation linears as matrix-vector products; input gradients everywhere but before the
    first trainable weight (block 0's q/k/v projections, the embeddings, the modulation); LoRA's A and B on the 8
    attention projections."""
    args = options.parse_args(["--tiny", "--fp8_base", "--floor"])
    model = build.census_model(args, torch.float32)
    blocks = len(model.transformer_blocks)
    w = make_workload(args.area, args.refs, args.text_tokens, args.micro_batch)
    b = build.synthetic_batch(w, model, torch.device("cpu"), torch.float32, text_mask=False)
    kwargs, _, _ = loop.noisy_inputs(
        b, TrainConfig(), torch.Generator().manual_seed(0), SCHEDULER_CONFIG, torch.float32, FAMILY
    )
    linears, attention = floor.census(model, {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()})

    assert [a.shape for a in attention] == [(1, w.tokens_per_sample, 4, 16)] * blocks and all(a.grad for a in attention)
    kinds = [c.kind for c in linears]
    assert kinds.count("fp8") == 12 * blocks and kinds.count("fp8_vector") == 2 * blocks
    assert kinds.count("lora") == 2 * 8 * blocks
    without_grad = [c for c in linears if c.kind == "fp8" and not c.input_grad]
    assert sorted(c.m for c in without_grad) == [w.text_tokens] * 3 + [w.image_tokens] * 3  # block 0's q, k, v
    assert not any(c.input_grad for c in linears if c.kind in ("fp8_vector", "frozen") and c.m == 1)
    mlp_up = [c for c in linears if c.kind == "fp8" and c.n == 4 * c.k]
    assert sorted(c.m for c in mlp_up) == sorted([w.image_tokens, w.text_tokens] * blocks)


@pytest.mark.parametrize("kernel", ["sdpa", "fa4"])
def test_routed_attention_is_timed_through_the_steps_op(monkeypatch, kernel):
    """With --attention_kernel other than sdpa, the step's blocks run their attention as kept attention's op
    (step.route_attention): the floor's census model is routed the same way, so its census records the op's calls
    and the floor times them through the op, on the kernel the step runs; with sdpa, diffusers' default."""
    monkeypatch.setattr(transformer_qwenimage, "dispatch_attention_fn", transformer_qwenimage.dispatch_attention_fn)
    args = options.parse_args(["--tiny", "--fp8_base", "--floor", "--attention_kernel", kernel])
    model = step.floor_census_model(args, torch.float32)
    w = make_workload(args.area, args.refs, args.text_tokens, args.micro_batch)
    b = build.synthetic_batch(w, model, torch.device("cpu"), torch.float32, text_mask=False)
    kwargs, _, _ = loop.noisy_inputs(
        b, TrainConfig(), torch.Generator().manual_seed(0), SCHEDULER_CONFIG, torch.float32, FAMILY
    )
    _, attention = floor.census(model, {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()})
    assert len(attention) == len(model.transformer_blocks)
    routed = kernel != "sdpa"
    assert all((dict(a.options).get("backend") == kept_attention.BACKEND) is routed for a in attention)
    through_op = []
    fused = kept_attention.fused_forward
    monkeypatch.setattr(kept_attention, "fused_forward", lambda *a, **k: through_op.append(1) or fused(*a, **k))
    rows = floor.time_attention(attention[0], 1, torch.device("cpu"), torch.float32, 1)
    assert [r["call"] for r in rows] == ["forward", "backward"] and bool(through_op) is routed


def test_floor_row_on_the_cpu(tmp_path):
    """`python -m train.bench --tiny --fp8_base --fp8_transposed --floor`: the row holds every floor field, the
    floor is the sum of its timed parts and the ratios are the step's mean and median over it."""
    out = tmp_path / "floor.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "train.bench",
        "--tiny",
        "--fp8_base",
        "--fp8_transposed",
        "--floor",
        "--floor_repeats",
        "2",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "floor ratio" in proc.stdout
    r = json.loads(out.read_text().splitlines()[-1])
    bad = {k: r.get(k) for k in floor.NUMERIC_FIELDS if not isinstance(r.get(k), float) or r[k] <= 0}
    assert not bad, f"missing or non-positive fields: {bad}"
    rows = r["floor_rows"]
    for part in floor.PARTS:
        assert r[f"floor_{part}_s"] == pytest.approx(sum(x["s_per_step"] for x in rows if x["part"] == part))
        assert any(x["part"] == part for x in rows), part
    assert all(x["s_per_step"] == pytest.approx(x["ms"] * x["calls"] / 1e3) for x in rows)
    assert r["floor_s"] == pytest.approx(r["floor_attention_s"] + r["floor_fp8_s"] + r["floor_dense_s"])
    assert r["floor_ratio"] == pytest.approx(r["s_per_step"] / r["floor_s"])
    assert r["floor_ratio_median"] == pytest.approx(r["floor_step_median_s"] / r["floor_s"])
    assert r["floor_ratio_with_lora"] == pytest.approx(r["s_per_step"] / (r["floor_s"] + r["floor_lora_s"]))
    assert r["floor_matmul_timing"] == "host_clock" and "matmuls timed by the host clock" in proc.stdout
    assert {(x["part"], x["call"]) for x in rows} == {
        ("attention", "forward"),
        ("attention", "backward"),
        ("fp8", "forward"),
        ("fp8", "input_grad"),
        ("dense", "forward"),
        ("dense", "input_grad"),
        ("lora", "forward"),
        ("lora", "weight_grad"),
        ("lora", "input_grad"),
    }


def test_floor_refuses_what_it_cannot_time():
    """Full fine-tuning has no frozen base; torchao's linears are not train/model/fp8.py's calls."""
    for bad in (
        ["--floor", "--mode", "full"],
        ["--floor", "--fp8_base", "--fp8_impl", "torchao_training"],
        ["--floor", "--floor_repeats", "0"],
    ):
        with pytest.raises(SystemExit):
            options.parse_args(bad)


def test_profiled_kernels_are_placed_by_name_then_launching_op():
    """--profile's kernel table: communication and copies by their names, matmuls and attention by the aten op that
    launched them (found above the runtime call), inductor's Triton kernels by name; per-step figures and shares."""
    from types import SimpleNamespace as NS

    from train.benchmarks import kernels

    op = NS(name="aten::_scaled_mm", cpu_parent=NS(name="bench/forward", cpu_parent=None))
    launch = NS(name="cudaLaunchKernel", cpu_parent=op)
    assert kernels.launching_op(launch) == "aten::_scaled_mm"
    assert kernels.launching_op(NS(name="cudaLaunchKernel", cpu_parent=None)) == ""
    K = kernels.Kernel
    found = [
        K("nvjet_qqtst_128x256", "aten::_scaled_mm", 300.0),
        K("nvjet_tst_64x8", "aten::mm", 60.0),
        K("cudnn_generated_fort_native_sdpa_sm90", "aten::_scaled_dot_product_cudnn_attention", 600.0),
        K("flash_bwd_kernel", "", 150.0),
        K("triton_poi_fused_mul_0", "", 90.0),
        K("Memcpy DtoD", "aten::copy_", 30.0),
        K("ncclDevKernel_AllReduce_Sum_bf16", "", 60.0),
        K("some_kernel", "aten::add", 90.0),
    ]
    assert [kernels.category(k) for k in found] == [
        "fp8 matmul",
        "dense matmul",
        "attention",
        "attention",
        "inductor fused",
        "copies and fills",
        "communication",
        "other",
    ]
    text = kernels.report(found * 3, steps=3, top=2)
    lines = text.splitlines()
    assert lines[0] == "kernels: 1.38 ms of device time per step, by category:"
    assert lines[1].split() == ["attention", "0.75", "ms/step", "54.3%"]
    assert "cudnn_generated_fort_native_sdpa_sm90" in lines[-2] and "nvjet_qqtst_128x256" in lines[-1]
    assert lines[-2].split()[:3] == ["0.600", "1.0", "43.5%"]
    assert kernels.report([], steps=3).startswith("kernels: none recorded")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_kernel_ms_runs_python_only_to_warm_up_and_capture(device):
    """On a GPU the call runs in Python for the warm-up and the graph's capture only: the timed replays launch its
    kernels without it. On a CPU every warm-up and timed call runs (the host clock times each)."""
    from train.benchmarks import gemms

    dev = torch.device(device)
    x = torch.randn(256, 512, device=dev)
    w = torch.randn(512, 512, device=dev)
    ran = []

    def call():
        ran.append(1)
        return x @ w

    ms = gemms.kernel_ms(call, repeats=7, device=dev, calls=4, warmup=2)
    assert ms > 0
    assert len(ran) == (2 + 4 if dev.type == "cuda" else 2 + 7)
