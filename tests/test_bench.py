"""train.bench: the CPU smoke run of the real step (CI), and the FLOP / trainable-parameter counts on meta.

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

from train.benchmarks import build, flops, options, profiling, report
from train.benchmarks.workload import make_workload

REPO = Path(__file__).resolve().parent.parent
# Every number the smoke run must report as > 0 (the baseline's too, since it runs with --baseline).
POSITIVE = ("s_per_step", "samples_per_s", "tokens_per_s", "mfu", "flops_per_step", "peak_memory_gb", "area",
            "width", "height", "target_tokens", "reference_tokens", "text_tokens", "tokens_per_sample",
            "trainable_params", "total_params", "micro_batch", "gpu_count", "steps", "peak_tflops_per_gpu",
            "baseline_s_per_step", "baseline_samples_per_s", "baseline_mfu", "baseline_peak_memory_gb", "ratio")
TEXT = ("gpu_name", "device_type", "torch_version", "deepspeed_version", "diffusers_version", "date", "mode")
# The issue's workload: 1024^2 target + one 1024^2 reference (4096 tokens each) + 256 text tokens.
IMAGE_TOKENS, TEXT_TOKENS = 2 * 4096, 256


def test_cpu_smoke_reports_every_field(tmp_path):
    """`python -m train.bench --tiny --baseline` runs the real step on CPU and writes a complete JSON line; with the
    bench extra installed, also the peer's bf16 eager step (`--peer diffsynth`) and its ratio."""
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "train.bench", "--tiny", "--steps", "2", "--warmup", "1", "--baseline",
           "--json", str(out)]
    with_peer = importlib.util.find_spec("diffsynth") is not None and importlib.util.find_spec("einops") is not None
    if with_peer:
        cmd += ["--peer", "diffsynth", "--peer_variants", "bf16:eager"]
    # One thread: the CI machine's cores are shared, and spinning OpenMP threads slow the tiny step ~50x there.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"
    assert "s/step" in proc.stdout and "not meaningful" in proc.stdout  # the report block, with the CPU note
    record = json.loads(out.read_text().splitlines()[-1])
    bad = {k: record.get(k) for k in (*POSITIVE, *report.NUMERIC_FIELDS, *report.BASELINE_FIELDS)
           if not isinstance(record.get(k), (int, float)) or isinstance(record.get(k), bool) or record[k] <= 0}
    assert not bad, f"missing or non-positive fields: {bad}"
    empty = [k for k in TEXT if not isinstance(record.get(k), str) or not record[k]]
    assert not empty, f"missing text fields: {empty}"
    assert record["device_type"] == "cpu" and record["precision"] == "float32" and record["model"] == "tiny"
    assert record["tokens_per_sample"] == record["target_tokens"] + record["reference_tokens"] + record["text_tokens"]
    # Both loops start from the same LoRA weights and draw the same noise: in fp32 their loss curves agree
    assert len(record["losses"]) == len(record["baseline_losses"]) == 3
    assert record["loss_max_rel_diff"] < 1e-5 and record["loss_within_tolerance"] is True
    if with_peer:
        (row,) = record["peer_rows"]
        assert row["variant"] == "bf16:eager" and "error" not in row, row
        assert row["s_per_step"] > 0 and len(row["losses"]) == 3 and record["peer_ratio"] > 0
        assert row["trainable_params"] == record["trainable_params"] and "peer ratio" in proc.stdout


@pytest.fixture(scope="module")
def full_meta() -> torch.nn.Module:
    """The full 60-block architecture on the meta device (shapes only, no memory)."""
    return build.build_full_transformer(60, "meta", torch.bfloat16)


def test_flops_of_the_issue_workload(full_meta):
    """1024^2 + one 1024^2 reference + 256 text tokens: 3.87e14 FLOPs per LoRA step, ~31% MFU at 1.28 s."""
    lora = flops.step_flops(full_meta, IMAGE_TOKENS, TEXT_TOKENS, "lora")
    assert lora == pytest.approx(3.87e14, rel=0.01)
    assert flops.mfu(lora, 1.28, 1) == pytest.approx(0.31, abs=0.01)
    attention = flops.forward_attention_flops(full_meta, IMAGE_TOKENS + TEXT_TOKENS)
    assert attention == 60 * 4 * (IMAGE_TOKENS + TEXT_TOKENS) ** 2 * 3072
    full = flops.step_flops(full_meta, IMAGE_TOKENS, TEXT_TOKENS, "full")
    assert full - lora == pytest.approx(flops.forward_linear_flops(full_meta, IMAGE_TOKENS, TEXT_TOKENS))
    assert flops.step_flops(full_meta, IMAGE_TOKENS, TEXT_TOKENS, "lora", batch=2) == pytest.approx(2 * lora)


def test_every_linear_is_assigned_a_stream(full_meta):
    """Per block 6 image-stream, 6 text-stream and 2 modulation linears; plus the embeddings and output."""
    streams = [flops.linear_stream(n) for n, m in full_meta.named_modules() if isinstance(m, torch.nn.Linear)]
    assert streams.count("image") == 60 * 6 + 2  # + img_in, proj_out
    assert streams.count("text") == 60 * 6 + 1  # + txt_in
    assert streams.count("one") == 60 * 2 + 3  # + norm_out.linear, the two timestep-embedding linears
    with pytest.raises(ValueError, match="no known stream"):
        flops.linear_stream("transformer_blocks.0.new_thing")


def test_lora_trainable_counts_on_meta():
    """r64 on the 8 attention projections: 188,743,680 trainable (peft's add_adapter works on meta modules).

    The FLOP count is the same after LoRA is added: LoRA's layers are skipped, the base layers counted.
    """
    model = build.build_full_transformer(60, "meta", torch.bfloat16)
    before = flops.step_flops(model, IMAGE_TOKENS, TEXT_TOKENS, "lora")
    build.prepare_training(model, "lora", build.lora_config(64, "attn"), "none", compile_blocks=False)
    assert build.trainable_count(model) == 188_743_680
    assert flops.step_flops(model, IMAGE_TOKENS, TEXT_TOKENS, "lora") == before


def _tokens_seen(name: str, image: int, text: int) -> int:
    """Independent reading of the rule: modulation/timestep linears 1 token, text-stream text, the rest image."""
    if any(k in name for k in ("_mod.", "norm_out", "time_text_embed")):
        return 1
    return text if any(k in name for k in ("txt_", "add_", "to_add_out")) else image


def test_tiny_flops_follow_the_module():
    """The counter walks the module: the tiny model's count matches its own shapes, not the full model's."""
    from train.model.qwen_image.tiny import build_transformer

    tiny = build_transformer()  # 2 blocks, inner_dim 4 heads x 16 = 64
    image, text = 128, 32
    linear = sum(2 * _tokens_seen(n, image, text) * m.in_features * m.out_features
                 for n, m in tiny.named_modules() if isinstance(m, torch.nn.Linear))
    attention = 2 * 4 * (image + text) ** 2 * 64
    assert flops.step_flops(tiny, image, text, "lora") == pytest.approx(2 * linear + 3 * attention)


def test_compile_mode_reaches_every_block(monkeypatch):
    """--compile_mode is torch.compile's mode for each block (reduce-overhead: CUDA graphs); none: torch's default."""
    from train.model.qwen_image.tiny import build_transformer

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    lora = build.lora_config(4, "attn")
    build.prepare_training(build_transformer(), "lora", lora, "none", True, compile_mode="reduce-overhead")
    assert seen == [{"mode": "reduce-overhead"}] * 2  # the tiny model's 2 blocks
    seen.clear()
    build.prepare_training(build_transformer(), "lora", lora, "none", True)
    assert seen == [{}] * 2
    assert options.parse_args(["--compile", "--compile_mode", "reduce-overhead"]).compile_mode == "reduce-overhead"


def test_zero_cond_t_builds_the_2511_transformer():
    """--zero_cond_t: the benchmarked transformer (tiny, and full size on meta) has 2511's config; FLOPs unchanged."""
    tiny = build.build_model(options.parse_args(["--tiny", "--zero_cond_t"]), torch.device("cpu"), torch.float32)
    assert tiny.config.zero_cond_t and all(b.zero_cond_t for b in tiny.transformer_blocks)
    assert not build.build_model(options.parse_args(["--tiny"]), torch.device("cpu"), torch.float32).config.zero_cond_t
    full = build.build_full_transformer(2, "meta", torch.bfloat16, zero_cond_t=True)
    assert full.config.zero_cond_t
    plain = build.build_full_transformer(2, "meta", torch.bfloat16)
    assert flops.step_flops(full, IMAGE_TOKENS, TEXT_TOKENS, "lora") == flops.step_flops(plain, IMAGE_TOKENS,
                                                                                         TEXT_TOKENS, "lora")


def test_workload_and_option_checks():
    """The issue's workload is 4096 + 4096 image tokens + 256 text; impossible combinations are refused."""
    w = make_workload(1024 * 1024, refs=1, text_tokens=256, micro_batch=1)
    assert (w.width, w.height, w.image_tokens, w.tokens_per_sample) == (1024, 1024, IMAGE_TOKENS, 8448)
    args = options.parse_args([])
    assert (args.area, args.text_tokens, args.lora_rank, args.steps, args.warmup) == (1024 * 1024, 256, 64, 20, 5)
    for bad in (["--mode", "full", "--baseline"], ["--tiny", "--num_layers", "4"], ["--steps", "0"],
                ["--compile_mode", "reduce-overhead"], ["--baseline", "--attention_kernel", "fa4"]):
        with pytest.raises(SystemExit):
            options.parse_args(bad)


def test_random_init_loads_a_weightless_directory(tiny_edit, tmp_path, monkeypatch):
    """QWEN_EDIT_RANDOM_INIT=1 builds the models from their config.json (same shapes); without it a directory
    without weights is an error, never a silent random model."""
    import shutil

    from train.config import ModelConfig
    from train.model import loading
    from train.model.qwen_image import components

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_edit / "model", model_dir)
    reference = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    for f in model_dir.glob("*/*.safetensors"):
        f.unlink()
    monkeypatch.delenv(loading.RANDOM_INIT_ENV, raising=False)
    with pytest.raises(OSError):
        loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    monkeypatch.setenv(loading.RANDOM_INIT_ENV, "1")
    built = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    assert {n: p.shape for n, p in built.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    encoders = components.load_encoders(model_dir, torch.float32, torch.device("cpu"))
    assert encoders.vae.config.z_dim == 16 and encoders.text_encoder.config.text_config.hidden_size == 32
    # the same weights in every process and run (seeded per model), and the caller's RNG left alone
    state = torch.random.get_rng_state()
    again = components.load_encoders(model_dir, torch.float32, torch.device("cpu"))
    vae = components.load_vae(model_dir, torch.float32, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in ((encoders.text_encoder, again.text_encoder), (encoders.vae, again.vae), (encoders.vae, vae)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    built_again = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(built.state_dict().values(), built_again.state_dict().values(),
                                                 strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(built.state_dict().values(), reference.state_dict().values(),
                                                     strict=True))  # it is not the saved model


def test_full_size_configs_describe_the_released_architectures(tiny_edit, tmp_path):
    """`python -m train.make_tiny --full_size_configs`: 60-block transformer, Qwen2.5-VL-7B, default VAE; no weights."""
    import json
    import shutil

    from train.model.qwen_image.tiny import write_full_size_configs

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_edit / "model", model_dir)
    write_full_size_configs(model_dir)
    assert not list(model_dir.glob("*/*.safetensors"))
    transformer = json.loads((model_dir / "transformer" / "config.json").read_text())
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["joint_attention_dim"]) == (
        60, 24, 3584)
    vl = json.loads((model_dir / "text_encoder" / "config.json").read_text())
    text = vl.get("text_config", vl)
    assert (text["hidden_size"], text["num_hidden_layers"], vl["vision_config"]["depth"]) == (3584, 28, 32)
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        built = QwenImageTransformer2DModel.from_config(transformer)
    assert sum(p.numel() for p in built.parameters()) == 20_430_401_088


def test_full_size_configs_at_a_chosen_depth(tmp_path, capsys):
    """`python -m train.make_tiny --full_size_configs --num_layers 17`: the released width with 17 blocks (the
    deepest full fine-tune docs/performance.md plans at 141 GB); --num_layers without --full_size_configs is refused
    before anything is written."""
    import json

    from train import make_tiny

    make_tiny.main(["--out", str(tmp_path / "d"), "--num_samples", "2", "--size", "64", "--full_size_configs",
                    "--num_layers", "17"])
    transformer = json.loads((tmp_path / "d" / "model" / "transformer" / "config.json").read_text())
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["attention_head_dim"]) == (
        17, 24, 128)
    with pytest.raises(SystemExit):
        make_tiny.main(["--out", str(tmp_path / "e"), "--num_layers", "17"])
    assert "add --full_size_configs" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_idle_report_attributes_gaps_to_the_issuing_phase():
    """Gaps between kernels (overlapping kernels merged) are charged to the phase the host was in when the
    kernel after the gap was issued; host synchronisations are counted per phase."""
    s = profiling.Span
    spans = [s("bench/forward", 0, 100, False), s("bench/backward", 100, 200, False), s("bench/step", 200, 300, False),
             s("k1", 0, 40, True), s("k2", 30, 50, True),  # overlap: busy until 50
             s("k3", 60, 90, True),  # 10 us gap, issued in forward
             s("k4", 130, 190, True),  # 40 us gap, issued in backward
             s("k5", 290, 300, True),  # 100 us gap, issued in step
             s("cudaStreamSynchronize", 210, 280, False), s("cudaStreamSynchronize", 20, 25, False),
             s("deepspeed/runtime/utils.py(233): is_invalid_grad_norm", 204, 286, False),
             s("torch/_tensor.py(10): item", 205, 285, False), s("aten::item", 206, 284, False),
             s("aten::_local_scalar_dense", 207, 283, False)]
    lines = profiling.idle_report(spans, steps=1, top=2).splitlines()
    assert lines[0].startswith("device idle between kernels: 0.15 ms/step in 3 gaps/step")
    assert lines[1:4] == ["  bench/step: 0.10 ms/step", "  bench/backward: 0.04 ms/step",
                          "  bench/forward: 0.01 ms/step"]
    assert lines[4] == ("host synchronisations per step: cudaStreamSynchronize in bench/forward x1, "
                        "cudaStreamSynchronize in bench/step x1")
    assert "k4 -> k5" in lines[6] and "k3 -> k4" in lines[7] and len(lines) == 8
    # each synchronisation by the innermost op around it and the innermost Python frame outside torch
    lines = profiling.sync_origins_report(spans, steps=1).splitlines()
    assert lines[0].startswith("host synchronisations per step by origin") and len(lines) == 3
    assert sorted(lines[1:]) == [
        "  x1 cudaStreamSynchronize in bench/forward from python",
        "  x1 cudaStreamSynchronize in bench/step from aten::_local_scalar_dense at "
        "deepspeed/runtime/utils.py(233): is_invalid_grad_norm"]
    # an op's own stack, where the profiler attaches one, and an explicit synchronisation (no op around it)
    spans[-1] = s("aten::_local_scalar_dense", 207, 283, False, ("/v/torch/_tensor.py(10): item",
                                                                 "/r/train/benchmarks/step.py(70): step"))
    assert "from aten::_local_scalar_dense at train/benchmarks/step.py(70): step" in \
        profiling.sync_origins_report(spans, 1)
    assert profiling.sync_origin(s("cudaDeviceSynchronize", 2, 3, False),
                                 [s("/v/deepspeed/utils/timer.py(237): start", 0, 10, False),
                                  s("torch/cuda/__init__.py(9): synchronize", 1, 5, False)]) == \
        "deepspeed/utils/timer.py(237): start"


def test_kernel_filter_takes_events_and_averages():
    """Device kernels count; host ops and the step-phase ranges the profiler mirrors on the device do not (both
    for the profiler's events, which have .name, and its key_averages rows, which have .key)."""
    from types import SimpleNamespace as NS

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert profiling.is_kernel(NS(name="nvjet_gemm", device_type=cuda, is_user_annotation=False))
    assert profiling.is_kernel(NS(key="nvjet_gemm", device_type=cuda))
    assert not profiling.is_kernel(NS(name="aten::mm", device_type=cpu, is_user_annotation=False))
    assert not profiling.is_kernel(NS(key="bench/forward", device_type=cuda))
    assert not profiling.is_kernel(NS(name="my_range", device_type=cuda, is_user_annotation=True))
