"""train.bench --variant qwen_image_21: the workload's tokens as Qwen-Image-2.1's transformer sees them, its FLOP
count against an independent count on the tiny model, the options it refuses, and the CPU run end to end.

Timings are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.benchmarks import ab, build, flops21, options, step
from train.benchmarks.timing import Phase
from train.benchmarks.workload import make_workload

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def tiny_setup(refs: int, text_tokens: int = 32):
    """(workload, tiny model, its synthetic batch, the transformer's keyword arguments) of --tiny --refs `refs`."""
    args = options.parse_args(
        ["--variant", "qwen_image_21", "--tiny", "--refs", str(refs), "--text_tokens", str(text_tokens)]
    )
    fam = build.args_family(args)
    w = make_workload(args.area, args.refs, args.text_tokens, args.micro_batch, fam)
    model = build.build_model(args, CPU, torch.float32).eval()
    b = build.synthetic_batch(w, model, CPU, torch.float32, text_mask=False)
    kwargs = fam.transformer_inputs(b, b.x0, torch.tensor([0.5]), torch.float32)
    return w, model, b, kwargs


@pytest.mark.parametrize("refs", [0, 2])
def test_workload_tokens_are_the_transformers_sequence(refs):
    """The workload's counts are the joint sequence the 2.1 transformer runs: latents unpatched at 16 px (128^2 ->
    8 x 8 = 64 tokens per image), references first, the text positions besides their image slots."""
    w, model, b, kwargs = tiny_setup(refs)
    assert (w.target_tokens, w.reference_tokens, w.text_tokens) == (64, 64 * refs, 32)
    assert kwargs["hidden_states"].shape[1] == w.image_tokens  # references, then the target
    assert kwargs["encoder_hidden_states"].shape[1] == w.text_tokens + w.reference_tokens // 4  # one slot per 2x2
    with torch.no_grad():
        out = model(**kwargs)[0]
    assert out.shape[1] == w.tokens_per_sample == w.text_tokens + w.image_tokens


def test_linear_flops_match_torch_flop_counter():
    """The forward's matmuls as torch.utils.flop_counter counts them on the tiny model with two references equal
    flops21's linear count; its attention count equals the pairs that diffusers' block-causal rule allows, counted
    on the dense mask built from the model's own token metadata."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    w, model, _, kwargs = tiny_setup(2)
    blocks = [w.target_tokens] * (w.refs + 1)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(**kwargs)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if op.__name__.split(".")[0] in ("mm", "addmm", "bmm"))
    assert matmuls == flops21.forward_linear_flops(model, w.text_tokens, blocks)

    img_mask = kwargs["img_mask"][0]
    pad = torch.repeat_interleave(img_mask, torch.where(img_mask, 4, 1))
    image_ids, _ = QwenImage21Transformer2DModel.build_token_metadata(pad, kwargs["img_shapes"][0])
    q, k = torch.arange(len(pad))[:, None], torch.arange(len(pad))[None, :]
    allowed = (q >= k) | ((image_ids[:, None] == image_ids[None, :]) & (image_ids[:, None] >= 0))
    assert flops21.allowed_pairs(w.text_tokens, blocks) == int(allowed.sum())
    expected = len(model.transformer_blocks) * 4 * model.inner_dim * int(allowed.sum())
    assert flops21.forward_attention_flops(model, w.text_tokens, blocks) == expected
    assert step.model_flops(model, w, "lora") == 2 * matmuls + 3 * expected


def test_full_size_linears_all_have_rows():
    """The released 32-block architecture (meta): 7 token linears per block and proj_out see the joint sequence;
    LoRA on the default targets adds its layers without changing the count."""
    model = build.build_full_transformer(None, "meta", torch.bfloat16, name="qwen_image_21")
    rows = [flops21.linear_rows(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert rows.count("joint") == 32 * 7 + 1 and rows.count("prompt") == 2 and rows.count("image") == 1
    w = make_workload(1024 * 1024, 1, 256, 1, build.bench_family("qwen_image_21"))
    before = step.model_flops(model, w, "lora")
    build.prepare_training(model, "lora", build.lora_config(32, "default", w.family), "none", compile_blocks=False)
    assert step.model_flops(model, w, "lora") == before
    with pytest.raises(ValueError, match="no known rows"):
        flops21.linear_rows("transformer_extra.0")


def test_options_of_the_21_variant():
    """--variant qwen_image_21 takes 0-10 references and an attention processor; the MMDiT's options, too few text
    tokens, an unknown processor and an A/B without its lever's setting are refused."""
    assert options.parse_args(["--variant", "qwen_image_21", "--refs", "10"]).refs == 10
    assert options.parse_args(["--variant", "qwen_image_21", "--attention", "flex"]).attention == "flex"
    assert options.parse_args(["--variant", "qwen_image_21", "--fp8_base", "--fused_swiglu"]).fused_swiglu
    text_calls = ["--ab_rounds", "2", "--ab_lever", "text_calls", "--attention", "segmented"]
    assert options.parse_args(["--variant", "qwen_image_21", *text_calls, "--attention_kernel", "fa4"]).ab_rounds == 2
    assert options.parse_args(["--variant", "qwen_image_21", "--ab_rounds", "2", "--ab_lever", "lean_step"]).ab_rounds
    into = ["--ab_rounds", "2", "--ab_lever", "fa4_into", "--attention", "segmented"]
    assert options.parse_args(["--variant", "qwen_image_21", *into, "--attention_kernel", "fa4"]).ab_rounds == 2
    bad_options = (["--refs", "11"], ["--attention", "dense"], ["--zero_cond_t"], ["--floor"], ["--fused_swiglu"],
                   text_calls, into, ["--ab_rounds", "2"], [*text_calls[:-1], "flex", "--attention_kernel", "fa4"])
    for bad in (*bad_options, ["--refs", "3", "--text_tokens", "7"]):
        with pytest.raises(SystemExit):
            options.parse_args(["--variant", "qwen_image_21", *bad])
    with pytest.raises(SystemExit):  # the MMDiT's MLP is no SwiGLU
        options.parse_args(["--fp8_base", "--fused_swiglu"])


def test_cpu_run_end_to_end(tmp_path):
    """`python -m train.bench --variant qwen_image_21 --tiny --refs 1 --fp8_base --fused_swiglu --ab_rounds 1` runs
    the project's 2.1 step on CPU, without and with the fused SwiGLU, and records its workload and FLOPs; with the
    bench extra installed, also the peer's bf16 eager step and its ratio."""
    out = tmp_path / "bench.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "train.bench",
        "--variant",
        "qwen_image_21",
        "--tiny",
        "--refs",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--text_mask",
        "--attention",
        "segmented",
        "--fp8_base",
        "--fused_swiglu",
        "--ab_rounds",
        "1",
        "--json",
        str(out),
    ]
    with_peer = importlib.util.find_spec("diffsynth") is not None and importlib.util.find_spec("einops") is not None
    if with_peer:
        cmd += ["--peer", "diffsynth", "--peer_variants", "bf16:eager"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # shared cores: one thread
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["variant"] == "qwen_image_21" and record["tokens_per_sample"] == 32 + 2 * 64
    assert record["attention"] == "SegmentedSDPAProcessor" and "attention SegmentedSDPAProcessor" in proc.stdout
    assert record["fp8_base"] and record["fused_swiglu"] and "fused SwiGLU" in proc.stdout
    assert record["ab_rounds"] == 1 and record["ab_off_s_per_step"] > 0 and "fused SwiGLU off" in proc.stdout
    assert record["flops_per_step"] > 0 and record["s_per_step"] > 0 and len(record["losses"]) == 2  # timed steps
    assert all(loss == loss and abs(loss) < float("inf") for loss in record["losses"])
    if with_peer:
        (row,) = record["peer_rows"]
        assert "error" not in row and row["trainable_params"] == record["trainable_params"], row
        assert record["peer_ratio"] > 0 and "QwenImage21DiT" in proc.stdout


def test_ab_rounds_alternate_the_lever_and_pool_each_side(monkeypatch):
    """ab.alternate: off then on in every pair of rounds, the lever left on; each side's timed steps pooled without
    the warm-ups; the rounds' means and their difference; a graph count that grows after the first pair is flagged."""
    switched, graphs = [], iter([3, 5, 5, 5, 5, 6])
    monkeypatch.setattr(ab, "compiled_graphs", lambda: next(graphs))
    step_s = {False: 0.002, True: 0.001}  # each side's step time; the warm-up steps take 9 s

    def timed(step, warmup, steps, device, gc_every_steps):  # time_steps' result, with the clock made up
        losses = [float(step(i)) for i in range(warmup + steps)]
        return Phase([9.0] * warmup + [step_s[switched[-1]]] * steps, warmup, 1.0 + switched[-1], losses)

    monkeypatch.setattr(ab, "time_steps", timed)
    on, fields = ab.alternate(lambda i: torch.tensor(float(i)), switched.append, rounds=3, warmup=1, steps=4,
                              device=torch.device("cpu"), lever="text_calls")
    assert fields["ab_lever"] == ab.LEVERS["text_calls"] != ab.LEVERS["fused_swiglu"]
    assert switched == [False, True] * 3
    assert len(on.seconds) == 12 and on.warmup == 0 and on.losses == [1.0, 2.0, 3.0, 4.0] * 3
    assert len(fields["ab_round_means_s"]) == 3 and all(off > on_ for off, on_ in fields["ab_round_means_s"])
    assert fields["ab_off_s_per_step"] > on.s_per_step and fields["ab_on_minus_off_ms"] < 0
    assert fields["ab_on_minus_off_ms"] == pytest.approx(-1.0) and fields["ab_off_peak_memory_gb"] == 1.0
    assert fields["ab_graphs_after_round"] == [3, 5, 5, 5, 5, 6] and fields["ab_recompiled"]
    lines = ab.report_lines({**fields, "s_per_step": on.s_per_step, "steps": 4})
    assert "WARNING" in lines[-1] and "3 rounds each of 4 timed steps" in lines[0]
