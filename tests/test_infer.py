"""Batch inference (train/infer.py, qwen_image/pipelines.py) on the tiny model: process-count independence, resume,
bad rows, LoRAs, the device/dtype bridge, argument errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import warm
from conftest import REPO, TINY_CONFIG, launcher_command, main_in_process, patch_family

from train import config, infer
from train import main as trainer
from train.model import family, loading, placement, prepare, renders
from train.model.qwen_image import components, pipelines
from train.runtime import engine

SETTINGS = {"num_inference_steps": 2, "true_cfg_scale": 1.0, "area": 128 * 128, "condition_area": 64 * 64}


def write_edits(folder: Path, tiny: Path) -> Path:
    """Five good rows (one with its own seed, one named) around two bad ones (missing image, empty prompt)."""
    data = tiny / "data"
    rows = [
        {"edit_image": str(data / "0000_ref.png"), "prompt": "make the circle red"},
        {"edit_image": str(data / "0001_ref.png"), "prompt": "make the square blue", "seed": 1234},
        {"edit_image": str(data / "missing.png"), "prompt": "make it green"},
        {"edit_image": str(data / "0002_ref.png"), "prompt": "make the circle yellow", "output": "named/yellow"},
        {"edit_image": str(data / "0003_ref.png"), "prompt": "  "},
        {"edit_image": str(data / "0000_ref.png"), "prompt": "make the circle red"},  # row 0 again, another seed
        {"edit_image": str(data / "0004_ref.png"), "prompt": "make the square green"},
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "infer.json").write_text(json.dumps({"qwen_edit": {"inference": SETTINGS}}))
    return folder


GOOD = {"000000.png", "000001.png", "named/yellow.png", "000005.png", "000006.png"}


def infer_args(tiny: Path, folder: Path, out: Path, input_name: str = "edits.jsonl") -> list[str]:
    return ["--model", str(tiny / "model"), "--input", str(folder / input_name), "--out", str(out),
            "--config", str(folder / "infer.json"), "--seed", "100"]


def run_infer(tiny: Path, folder: Path, out: Path, num_procs: int | None = None, input_name: str = "edits.jsonl"):
    """`python -m train.infer ...` (num_procs None; started warm: tests/warm.py) or `deepspeed --num_gpus N
    train/infer.py ...`."""
    args = infer_args(tiny, folder, out, input_name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if num_procs is None:
        return warm.run(["-m", "train.infer", *args], cwd=REPO, env=env, timeout=600)
    cmd = [*launcher_command(num_procs), str(REPO / "train" / "infer.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


def outputs(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*.png")}


@pytest.fixture(scope="module")
def one_process(tiny_edit, tmp_path_factory):
    folder = write_edits(tmp_path_factory.mktemp("infer_edits"), tiny_edit)
    out = folder / "out1"
    proc = run_infer(tiny_edit, folder, out)
    check(proc)
    return folder, out, proc


@pytest.mark.slow
def test_one_and_two_processes_write_identical_images(one_process, tiny_edit):
    """The same rows give bitwise-identical PNGs from 1 process and from 2 under the deepspeed launcher (CPU, fp32):
    seeds are per row, never per process."""
    folder, out1, _ = one_process
    out2 = folder / "out2"
    check(run_infer(tiny_edit, folder, out2, num_procs=2))
    one, two = outputs(out1), outputs(out2)
    assert set(one) == GOOD, sorted(one)
    assert set(two) == set(one)
    differing = [name for name in one if one[name] != two[name]]
    assert not differing, f"images differ between 1 and 2 processes: {differing}"
    # Not vacuous: the same edit with another seed (rows 0 and 5) gives another image.
    assert one["000000.png"] != one["000005.png"]
    assert (out1 / "bad_rows.txt").read_text() == (out2 / "bad_rows.txt").read_text()
    assert json.loads((out2 / "summary.json").read_text())["world_size"] == 2


def test_bad_rows_are_reported_and_skipped(one_process):
    """A missing image and an empty prompt are reported with their lines, listed in bad_rows.txt; exit 0."""
    _, out, proc = one_process
    report = (out / "bad_rows.txt").read_text().splitlines()
    assert len(report) == 2, report
    assert report[0].startswith("line 3: ") and "missing.png: file not found" in report[0]
    assert report[1].startswith("line 5: ") and "prompt" in report[1]
    assert "bad row: line 3" in proc.stderr and "bad row: line 5" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == 5 and summary["bad_rows"] == 2 and summary["already_done"] == 0
    assert len(summary["seconds_per_image"]) == 1 and len(summary["seconds_per_image"][0]) == 5  # one per image
    assert all(t > 0 for t in summary["seconds_per_image"][0])
    assert summary["peak_memory_gb"] == [None]  # the CPU has no allocator peak


def test_resume_writes_only_missing_outputs(one_process, tiny_edit, tmp_path):
    """A re-run renders only the rows whose PNG is missing; the others are not touched (same inode and mtime)."""
    folder, out1, _ = one_process
    out = tmp_path / "out"
    shutil.copytree(out1, out)
    (out / "000001.png").unlink()
    stats = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*.png")}
    code, _, err = main_in_process(infer, infer_args(tiny_edit, folder, out))  # the command, in this process
    assert code == 0, err[-3000:]
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in stats} == stats
    assert (out / "000001.png").read_bytes() == (out1 / "000001.png").read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == 1 and summary["already_done"] == 4
    assert not list(out.rglob("*.tmp"))


def test_every_row_bad_exits_nonzero(tiny_edit, tmp_path):
    """When no row can be rendered the command fails (exit 1) and still writes the report."""
    folder = write_edits(tmp_path, tiny_edit)
    (folder / "bad.jsonl").write_text('{"edit_image": "nope.png", "prompt": "x"}\nnot json\n')
    code, _, err = main_in_process(infer, infer_args(tiny_edit, folder, tmp_path / "out", "bad.jsonl"))
    assert code == 1, err[-3000:]
    assert len((tmp_path / "out" / "bad_rows.txt").read_text().splitlines()) == 2


def test_argument_errors_exit_2(tiny_edit, tmp_path, capsys):
    """Bad flags are reported together before anything loads; split placement needs two GPUs."""
    bad_cfg = tmp_path / "bad.json"
    bad_cfg.write_text(json.dumps({"qwen_edit": {"inference": {"num_inference_steps": 0}}}))
    code = infer.main(["--model", str(tmp_path), "--input", str(tmp_path / "none.jsonl"), "--out", str(tmp_path),
                       "--lora", str(tmp_path / "x.safetensors:0.5"), "--config", str(bad_cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "--model:" in err and "--input:" in err and "x.safetensors' is not a file" in err
    assert "qwen_edit.inference.num_inference_steps: must be > 0" in err
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(tiny_edit / "data" / "metadata.jsonl"),
                             "--out", str(tmp_path), "--placement", "split"])
    problems = infer.check_args(args, world_size=2)
    assert any("one process" in p for p in problems)
    assert any("needs 2 GPUs" in p for p in problems) == (torch.cuda.device_count() < 2)


def test_weightless_directory_stops_both_commands_or_renders_at_random_init(tiny_edit, tmp_path, monkeypatch, capsys):
    """A model directory with configs and no weights (what make_tiny --full_size_configs writes): train.infer and
    train/main.py stop before loading with the one message that names the folders; under QWEN_EDIT_RANDOM_INIT=1
    train.infer builds every model at random init, says so, and writes its images."""
    model = tmp_path / "model"
    shutil.copytree(tiny_edit / "model", model)
    for f in model.glob("*/*.safetensors*"):
        f.unlink()
    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(json.dumps({"edit_image": str(tiny_edit / "data" / f"000{i}_ref.png"),
                                         "prompt": "make the circle red"}) + "\n" for i in range(2)))
    cfg = tmp_path / "infer.json"
    cfg.write_text(json.dumps({"qwen_edit": {"inference": SETTINGS}}))
    argv = ["--model", str(model), "--input", str(edits), "--out", str(tmp_path / "out"), "--config", str(cfg)]
    monkeypatch.delenv(loading.RANDOM_INIT_ENV, raising=False)
    message = f"{str(model)!r} has no weights in transformer/, vae/, text_encoder/: transformer/ and vae/ need"
    assert infer.main(argv) == 2
    assert f"--model: {message}" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert trainer.main(["--ds_config", "ds_configs/tiny_cpu.json", "--model", str(model), "--data",
                         str(tiny_edit / "data"), "--output_dir", str(tmp_path / "run")]) == 2
    assert f"qwen_edit.model.path: {message}" in capsys.readouterr().err

    monkeypatch.setenv(loading.RANDOM_INIT_ENV, "1")
    args = infer.parse_args(argv)
    assert infer.check_args(args, world_size=1) == []
    code = infer.run(args, config.inference_settings(cfg), engine.Dist(0, 1, 0, torch.device("cpu")))
    out = capsys.readouterr().out
    assert code == 0 and sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["000000.png", "000001.png"]
    for what in ("text encoder", "VAE", "transformer"):
        assert f"QWEN_EDIT_RANDOM_INIT=1: {what} at RANDOM INIT on cpu (for measurements only)" in out
    # CPU offload's placement: the same models kept in host memory, the transformer with the same values
    cpu = torch.device("cpu")
    hosted, resident = (components.random_pipeline_models(model, torch.float32, cpu, on_host=h) for h in (True, False))
    for name in ("text_encoder", "vae", "transformer"):
        assert ({n: p.shape for n, p in hosted[name].named_parameters()}
                == {n: p.shape for n, p in resident[name].named_parameters()}), name
    assert all(torch.equal(a, b) for a, b in zip(hosted["transformer"].state_dict().values(),
                                                 resident["transformer"].state_dict().values(), strict=True))


def test_random_models_are_built_where_the_placement_keeps_them(tiny_edit, monkeypatch):
    """QWEN_EDIT_RANDOM_INIT=1: host memory for CPU offload, cuda:1 for the split transformer, else the device; none
    without the variable (from_pretrained then loads the weights)."""
    calls = []
    patch_family(monkeypatch, random_pipeline_models=lambda *a: calls.append(a[2:]) or {"built": a})
    settings, gpu = config.ProjectConfig(), torch.device("cuda", 0)
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", "x", "--out", "y"])
    monkeypatch.delenv(loading.RANDOM_INIT_ENV, raising=False)
    assert infer.random_models(args, settings, gpu, torch.bfloat16) == {} and not calls
    monkeypatch.setenv(loading.RANDOM_INIT_ENV, "1")
    for offload in ("none", "model", "sequential"):
        settings.inference.cpu_offload = offload
        infer.random_models(args, settings, gpu, torch.bfloat16)
    args.placement = "split"
    infer.random_models(args, settings, gpu, torch.bfloat16)
    assert calls == [(gpu, gpu, False), (gpu, gpu, True), (gpu, gpu, True), (gpu, torch.device("cuda", 1), False)]


def test_read_requests_seeds_names_and_problems(tmp_path):
    """Seeds default to base + row index (blank lines do not count), names to the index; duplicates are bad rows."""
    (tmp_path / "edits.jsonl").write_text(
        '{"edit_image": "a.png", "prompt": "p"}\n\n'
        '{"edit_image": ["a.png", "b.png"], "prompt": "q", "seed": 5, "output": "x.png"}\n'
        '{"edit_image": "a.png", "prompt": "r", "output": "x"}\n'
        '{"edit_image": "a.png", "prompt": "s", "seed": -1}\n'
        '{"edit_image": "a.png", "prompt": "t", "output": "../up"}\n'
        '[1]\n'
    )
    requests, problems = renders.read_requests(tmp_path / "edits.jsonl", base_seed=10)
    assert [(q.index, q.line, q.seed, q.name) for q in requests] == [(0, 1, 10, "000000"), (1, 3, 5, "x")]
    assert requests[1].references == [tmp_path / "a.png", tmp_path / "b.png"]
    assert [(i, line) for i, line, _ in problems] == [(2, 4), (3, 5), (4, 6), (5, 7)]
    assert "already used by line 3" in problems[0][2] and "seed" in problems[1][2]


def test_parse_lora():
    assert placement.parse_lora("a/b.safetensors") == (Path("a/b.safetensors"), 1.0)
    assert placement.parse_lora("a/b.safetensors:0.5") == (Path("a/b.safetensors"), 0.5)
    assert placement.parse_lora("c:/x.safetensors") == (Path("c:/x.safetensors"), 1.0)


def test_bridge_moves_and_casts_inputs_and_outputs():
    """The hooks feed a module its own dtype (keyword arguments too) and hand back the caller's dtype."""
    linear = torch.nn.Linear(4, 4).double()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, hidden_states=None, mask=None):
            assert hidden_states.dtype == torch.float64 and mask.dtype == torch.long
            return (self.linear(hidden_states),)

    module = Wrapped()
    hooks = placement.bridge(module, torch.device("cpu"), torch.float64, torch.device("cpu"), torch.float32)
    out = module(hidden_states=torch.ones(2, 4), mask=torch.ones(2, dtype=torch.long))[0]
    assert out.dtype == torch.float32
    for hook in hooks:
        hook.remove()
    with pytest.raises(AssertionError):
        module(hidden_states=torch.ones(2, 4), mask=torch.ones(2, dtype=torch.long))


def trained_looking_lora(tiny: Path, folder: Path) -> Path:
    """A LoRA file for the tiny model (diffusers' layout) whose B matrices are not zero, so it changes the edit."""
    from train.config import LoraConfig, ModelConfig
    from train.runtime import exports

    transformer = loading.load_transformer(ModelConfig(path=str(tiny / "model")), torch.float32)
    prepare.add_lora(transformer, LoraConfig(rank=4, alpha=4, target_modules=["attn.to_q", "attn.to_v"]))
    torch.manual_seed(0)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    return exports.export_lora(transformer, folder, alpha=4, rank=4, keys=family.family_named("qwen_image").lora)


def test_loras_load_with_weights(tiny_edit, tmp_path):
    """--lora FILE:WEIGHT: a trained-looking LoRA changes the edit; weight 0 gives the base model's edit back."""
    from train.config import InferenceConfig

    lora = trained_looking_lora(tiny_edit, tmp_path)
    settings = InferenceConfig(**SETTINGS)
    pipe = pipelines.load_pipeline(tiny_edit / "model", torch.float32)
    placement.place(pipe, settings, torch.device("cpu"))
    from PIL import Image

    image = [Image.open(tiny_edit / "data" / "0000_ref.png").convert("RGB")]

    def edit():
        return torch.tensor(list(pipelines.edit(pipe, "edit", image, "make it red", 3, settings).getdata()))

    base = edit()
    placement.load_loras(pipe, [(lora, 1.0)])
    assert not torch.equal(edit(), base)
    pipe.set_adapters(["lora0"], adapter_weights=[0.0])
    assert torch.equal(edit(), base)


def test_streamed_blocks_render_the_same_images(tiny_edit, tmp_path, monkeypatch):
    """cpu_offload "blocks" (the encoders first for each chunk of rows, Qwen2.5-VL streamed, then the transformer
    with its first blocks streamed from host memory by the offloader) writes the images everything resident
    writes, with guidance and a LoRA on the streamed blocks, in two chunks of rows; bad rows are still reported
    (CPU, fp32)."""
    import io

    import numpy as np
    from PIL import Image

    from train.model import offload
    from train.plan.inference import InferencePlacement

    lora = trained_looking_lora(tiny_edit, tmp_path)
    folder = write_edits(tmp_path / "edits", tiny_edit)
    settings_file = folder / "infer.json"
    settings_file.write_text(json.dumps({"qwen_edit": {"inference": {**SETTINGS, "true_cfg_scale": 2.0}}}))
    cpu = engine.Dist(0, 1, 0, torch.device("cpu"))
    offloaders = []
    built = offload.BlockOffloader.__init__

    def spy(self, *args, **kwargs):
        built(self, *args, **kwargs)
        offloaders.append(self)

    monkeypatch.setattr(offload.BlockOffloader, "__init__", spy)
    out = {}
    for how in ("none", "blocks"):
        args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(folder / "edits.jsonl"),
                                 "--out", str(tmp_path / how), "--config", str(settings_file), "--seed", "100",
                                 "--lora", f"{lora}:0.8"])
        settings = config.inference_settings(args.config)
        settings.inference.cpu_offload = how
        monkeypatch.setattr(infer, "plan", lambda *a, how=how: InferencePlacement(how, 2, True))
        assert infer.run(args, settings, cpu) == 0
        out[how] = outputs(tmp_path / how)
        summary = json.loads((tmp_path / how / "summary.json").read_text())
        assert summary["written"] == 5 and summary["bad_rows"] == 2, (how, summary)
    assert set(out["none"]) == GOOD and set(out["blocks"]) == GOOD
    for name in GOOD:
        # Streamed-from-slot weights compute in another memory layout: a few pixels may round the other way (seen:
        # <= 1 level in 0.005% of them); a wrong block, LoRA or conditioning moves most pixels by many levels.
        a, b = (np.asarray(Image.open(io.BytesIO(out[how][name])), dtype=np.int16) for how in ("none", "blocks"))
        assert np.abs(a - b).max() <= 1 and (a != b).mean() < 1e-3, name
    # three offloaders: Qwen2.5-VL's ViT blocks and decoder layers, and the transformer's first 2 blocks
    streamed = [o for o in offloaders if o.order == [0, 1] and o.copies]
    assert len(offloaders) == 3 and streamed and all(o.copies for o in offloaders)


def test_a_placement_that_cannot_fit_stops_before_loading(tiny_edit, tmp_path, monkeypatch, capsys):
    """The plan's refusal (explain.PlanError) ends train.infer with exit 2 and its message, no traceback, nothing
    loaded and no image written."""
    from train.plan import explain

    folder = write_edits(tmp_path / "edits", tiny_edit)
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(folder / "edits.jsonl"),
                             "--out", str(tmp_path / "out"), "--config", str(folder / "infer.json")])

    def refuse(*_):
        raise explain.PlanError("train.infer: the models do not fit; raise qwen_edit.memory.budget_gb")

    monkeypatch.setattr(infer, "plan", refuse)
    patch_family(monkeypatch, load_pipeline=lambda *a, **k: pytest.fail("a model loaded"))
    code = infer.run(args, config.inference_settings(args.config), engine.Dist(0, 1, 0, torch.device("cpu")))
    err = capsys.readouterr().err
    assert code == 2 and "error: train.infer: the models do not fit" in err and "Traceback" not in err
    assert not list((tmp_path / "out").rglob("*.png"))


def test_the_tiny_config_renders_the_tiny_model_at_its_training_size(tiny_edit, tmp_path, capsys):
    """README's batch-inference command with --config set to the tiny training config (ds_configs/tiny_cpu.json)
    renders at the size the tiny model trains at, without classifier-free guidance, instead of the defaults' 1 MP
    with guidance (minutes per image on a CPU): the config's inference section is what train.infer uses."""
    from PIL import Image

    edits = tmp_path / "edits.jsonl"
    edits.write_text(json.dumps({"edit_image": str(tiny_edit / "data" / "0000_ref.png"), "prompt": "make it red"}))
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(edits), "--out",
                             str(tmp_path / "out"), "--config", str(TINY_CONFIG)])
    settings = config.inference_settings(args.config)
    trained = json.loads(TINY_CONFIG.read_text())["qwen_edit"]["data"]
    assert (settings.inference.area, settings.inference.condition_area) == (trained["area"], trained["condition_area"])
    assert settings.inference.true_cfg_scale == 1.0  # one transformer pass per step
    assert infer.run(args, settings, engine.Dist(0, 1, 0, torch.device("cpu"))) == 0
    side = int(trained["area"] ** 0.5)  # the tiny data's references are square
    assert Image.open(tmp_path / "out" / "000000.png").size == (side, side)
