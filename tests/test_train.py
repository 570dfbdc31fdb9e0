"""End-to-end runs of train/main.py on the tiny model: the launcher, ZeRO-2 over 2 CPU processes, exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE_STEPS, metrics, run_trainer, start_refused, write_config
from PIL import Image
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


@pytest.fixture(scope="module")
def zero2_run(tiny_edit, tmp_path_factory) -> Path:
    """60 steps of LoRA with ZeRO-2 on 2 processes through the deepspeed launcher."""
    from conftest import free_port

    out = tmp_path_factory.mktemp("zero2_run")
    port = free_port()
    proc = run_trainer(tiny_edit, out, num_procs=2, extra=("--max_steps", "60"), port=port)
    check(proc)
    (out / "master_port").write_text(str(port))
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def test_zero2_leaves_no_shared_memory(zero2_run):
    """A CPU launch neither builds nor loads DeepSpeed's shared-memory all-reduce op
    (train.runtime.engine.skip_cpu_shm_op), so it maps none of its 64 MiB per-rank /dev/shm buffers, which
    DeepSpeed never unlinks: before, every CPU launch leaked them until the machine ran out of memory, and the
    op's JIT build cost minutes whenever torch's extension cache looked stale."""
    port = (zero2_run / "master_port").read_text()
    shm = Path("/dev/shm")
    assert shm.is_dir()  # Linux: where DeepSpeed's shm op puts them
    left = [p.name for p in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
    assert not left, left
    assert "deepspeed_shm_comm" not in (zero2_run / "stdout.txt").read_text()  # 'built successfully' when loaded


def test_zero2_loss_falls(zero2_run):
    """The synthetic recolouring task is learned: the loss of the last 20 steps is well below the first 20."""
    losses = [r["loss"] for r in metrics(zero2_run)]
    assert len(losses) == 6, losses
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.85 * first, f"loss did not fall enough: {losses}"


def test_zero2_ranks_hold_identical_weights(zero2_run):
    """Both ranks' trainable weights hash alike after training (ZeRO-2 keeps replicas in sync)."""
    summary = json.loads((zero2_run / "summary.json").read_text())
    assert summary["world_size"] == 2
    digests = summary["replica_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests


def test_zero2_summary_times_the_steps(zero2_run):
    """summary.json's step_time: the 55 steps after the 5 warm-up ones, samples/s from their mean over both ranks'
    samples; the same summary is the console's end-of-run line."""
    from train.runtime import steptime

    stats = json.loads((zero2_run / "summary.json").read_text())["step_time"]
    assert stats["timed_steps"] == 55 and stats["first_timed_step"] == 6 and 6 <= stats["slowest_step"] <= 60
    assert stats["samples_per_s"] == pytest.approx(2 / stats["mean_s_per_step"])
    assert steptime.describe(stats) in (zero2_run / "stdout.txt").read_text()


def test_zero2_outputs(zero2_run):
    """Resolved config, metrics fields, one optimizer shard per rank, the LoRA export."""
    resolved = json.loads((zero2_run / "config.json").read_text())
    assert resolved["zero_optimization"]["stage"] == 2 and resolved["qwen_edit"]["train"]["max_steps"] == 60
    record = metrics(zero2_run)[-1]
    for key in ("step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "peak_memory_gb",
                "peak_reserved_gb", "alloc_retries", "compiled_graphs", "gc_s", "host_rss_gb", "host_pinned_gb"):
        assert key in record, key
    assert all(r["gc_s"] >= 0 for r in metrics(zero2_run))
    assert record["alloc_retries"] == 0  # a CPU run has no caching allocator
    assert record["host_rss_gb"] > 0 and record["host_pinned_gb"] == 0  # nor a pinned host allocator
    assert record["step"] == 60
    ckpt = zero2_run / "global_step60"
    assert len(list(ckpt.glob("*zero_pp_rank_*_optim_states.pt"))) == 2, list(ckpt.iterdir())
    assert (zero2_run / "latest").read_text().strip() == "global_step60"
    lora = load_file(zero2_run / "export" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora), list(lora)[:4]
    assert (zero2_run / "tensorboard").is_dir()
    stdout = (zero2_run / "stdout.txt").read_text()  # a pipe, not a terminal: plain progress lines, no bar
    assert "\r" not in stdout and "step 60/60 | epoch " in stdout and " | ETA 0s" in stdout, stdout[-2000:]
    assert f"loss curve: {zero2_run / 'loss.png'}" in stdout
    assert Image.open(zero2_run / "loss.png").size == (640, 360)


# A plain CPU run's console: the run's own lines (rank 0's), and the info lines of the deepspeed launcher's launch.py,
# which run_trainer starts directly (launch.sh keeps them out). Any other line is a library's noise to filter in
# train/runtime/quiet.py, or a line of the run's own to add here.
CONSOLE_LINES = re.compile("|".join([
    r"prompts: ", r"sampling: ", r"data: ", r"\d+ rows, variant ", r"disk: ", r"step \d+/\d+ \| ", r"loss curve: ",
    r"step time over steps ",
    r"exported ", r"warning: \d+ processes on this node share its \d+ CPU core",  # a machine of one core
    r"\[[\d-]+ [\d:,]+\] \[INFO\] \[launch\.py:",
]))


def test_zero2_console_shows_only_the_runs_own_lines(zero2_run):
    """Neither rank prints library noise (torch's _pytree registrations, diffusers' torchao import, DeepSpeed's
    learning-rate and accelerator lines, the all_gather_into_tensor FutureWarning): this fails when a plain CPU run's
    console gains a line."""
    lines = [*(zero2_run / "stdout.txt").read_text().splitlines(), *(zero2_run / "stderr.txt").read_text().splitlines()]
    assert [line for line in lines if line.strip() and not CONSOLE_LINES.match(line)] == []
    assert any(line.startswith("step 60/60 | ") for line in lines)


def test_exported_lora_loads_into_pipeline_and_changes_output(zero2_run, tiny_edit):
    """diffusers' QwenImageEditPipeline.load_lora_weights takes the export, every weight lands, output changes."""
    from diffusers import DiffusionPipeline
    from PIL import Image

    from train.model.qwen_image.conditioning import pipeline_areas

    pipe = DiffusionPipeline.from_pretrained(tiny_edit / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    row = json.loads((tiny_edit / "data" / "metadata.jsonl").read_text().splitlines()[0])
    image = Image.open(tiny_edit / "data" / row["edit_image"]).convert("RGB")

    def edit():
        with pipeline_areas(128 * 128):
            return pipe(image=image, prompt=row["prompt"], num_inference_steps=4, true_cfg_scale=1.0,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images

    before = edit()
    pipe.load_lora_weights(zero2_run / "export", weight_name="pytorch_lora_weights.safetensors")
    after = edit()
    exported = load_file(zero2_run / "export" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported), (len(loaded), len(exported))
    name = "transformer_blocks.0.attn.to_q.lora_B.default_0.weight"
    assert torch.equal(loaded[name], exported["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"])
    assert (after - before).abs().max() > 1e-3


def test_two_ranks_equal_one_rank_with_accumulation(tiny_edit, fault_config, reference_run, tmp_path):
    """2 processes x micro-batch 1 (ZeRO-2: conftest.reference_run, shared with the fault tests) and 1 process x GAS
    2 see the same samples and noise: same weights (fp32). So does ZeRO stage 1 without gradient hooks on 2
    processes (ds_configs/lora_fast.json's setting). The reference's config saves every 4 steps: a save changes no
    number."""
    out_dp, out_gas, out_z1 = reference_run, tmp_path / "gas", tmp_path / "z1"
    steps = ("--max_steps", str(REFERENCE_STEPS))
    gas_cfg = write_config(tmp_path / "gas.json", base=fault_config, gradient_accumulation_steps=2)
    check(run_trainer(tiny_edit, out_gas, config=gas_cfg, extra=steps))
    z1_cfg = write_config(tmp_path / "z1.json", base=fault_config, zero_optimization={
        "stage": 1, "overlap_comm": False, "contiguous_gradients": False})
    check(run_trainer(tiny_edit, out_z1, config=z1_cfg, num_procs=2, extra=steps))
    a = load_file(out_dp / "export" / "pytorch_lora_weights.safetensors")
    moved = max((a[k]).abs().max().item() for k in a if "lora_B" in k)
    assert moved > 1e-3, "LoRA B never moved from zero: the comparison would be vacuous"
    for other in (out_gas, out_z1):
        b = load_file(other / "export" / "pytorch_lora_weights.safetensors")
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 1e-5, f"{other.name}: max |difference| {worst:.3g} (tolerance 1e-5: fp32 summation order only)"


def test_full_finetune_exports_transformer(tiny_edit, tmp_path):
    """mode=full trains every transformer weight in one process and exports a loadable diffusers directory."""
    from diffusers import QwenImageTransformer2DModel

    cfg = write_config(tmp_path / "full.json", **{"qwen_edit.train.mode": "full", "optimizer.params.lr": 1e-3})
    out = tmp_path / "out"
    check(run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "30")))
    losses = [r["loss"] for r in metrics(out)]
    assert losses[-1] < losses[0], losses
    trained = QwenImageTransformer2DModel.from_pretrained(out / "export" / "transformer")
    base = QwenImageTransformer2DModel.from_pretrained(tiny_edit / "model", subfolder="transformer")
    base_params = dict(base.named_parameters())
    frozen = [n for n, p in trained.named_parameters() if torch.equal(p, base_params[n])]
    # The last block's text-stream outputs feed nothing (only image tokens reach proj_out): no gradient.
    last = f"transformer_blocks.{len(trained.transformer_blocks) - 1}."
    dead = ("attn.add_q_proj", "attn.to_add_out", "attn.norm_added_q", "txt_mlp.")
    assert frozen and all(n.startswith(last) and any(k in n for k in dead) for n in frozen), frozen


def test_edit_plus_trains_with_two_references(tiny_plus, tmp_path):
    """The 2509 variant (two references per row) runs through the same entry point."""
    out = tmp_path / "out"
    check(run_trainer(tiny_plus, out, extra=("--max_steps", "10")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variant"] == "edit_plus" and summary["steps"] == 10
    assert (out / "export" / "pytorch_lora_weights.safetensors").is_file()


def _without_references(tiny: Path, to: Path) -> Path:
    """The tiny edit dataset with edit_image left out of every other row (the model linked)."""
    import shutil

    shutil.copytree(tiny / "data", to / "data")
    (to / "model").symlink_to(tiny / "model")
    meta = to / "data" / "metadata.jsonl"
    rows = [json.loads(line) for line in meta.read_text().splitlines()][:8]
    rows = [{k: v for k, v in row.items() if k != "edit_image" or i % 2} for i, row in enumerate(rows)]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return to


@pytest.mark.parametrize("kind", ["t2i", "edit_without_references"])
def test_text_to_image_rows_train(kind, request, tmp_path):
    """Qwen-Image (t2i: rows of image + prompt) and an edit model on rows half of which have no edit_image train
    through the same entry point; the log, metrics and summary name the variant; the exported LoRA loads into
    QwenImagePipeline (built from the model's components) and changes its output."""
    from diffusers import DiffusionPipeline, QwenImagePipeline

    tiny = request.getfixturevalue("tiny_t2i") if kind == "t2i" else _without_references(
        request.getfixturevalue("tiny_edit"), tmp_path / "tiny")
    variant = "t2i" if kind == "t2i" else "edit"
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", **{"qwen_edit.output.log_every_steps": 1,
                                                 "qwen_edit.data.rows_without_reference": "text_to_image"})
    proc = run_trainer(tiny, out, config=cfg, extra=("--max_steps", "4"))
    check(proc)
    assert f"variant {variant} (" in proc.stdout
    if kind != "t2i":
        assert "4 of 8 rows have no edit_image: trained as text-to-image samples" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["variant"] == variant
    records = metrics(out)
    assert len(records) == 4 and all(r["variant"] == variant for r in records)
    loaded = DiffusionPipeline.from_pretrained(tiny / "model", local_files_only=True)
    pipe = loaded if kind == "t2i" else QwenImagePipeline(**{k: v for k, v in loaded.components.items()
                                                             if k != "processor"})
    pipe.set_progress_bar_config(disable=True)

    def sample():
        return pipe(prompt="a red circle on grey", height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images

    before = sample()
    pipe.load_lora_weights(out / "export", weight_name="pytorch_lora_weights.safetensors")
    assert (sample() - before).abs().max().item() > 1e-4


def test_bad_config_is_reported_before_anything_loads(tiny_edit, tmp_path):
    """A config error exits 2, names every key, and writes nothing into the output directory."""
    cfg = write_config(tmp_path / "bad.json", **{"qwen_edit.lora.rank": 0, "qwen_edit.train.mod": "lora"})
    out = tmp_path / "out"
    code, err = start_refused(tiny_edit, out, config=cfg)
    assert code == 2, err[-3000:]
    assert "qwen_edit.lora.rank: must be > 0" in err
    assert "qwen_edit.train.mod: unknown key" in err
    assert not out.exists()


def test_bad_rows_stop_the_launcher(tiny_edit, tmp_path):
    """A corrupt image stops a 2-process run with exit 2 and a report naming the row and file."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_edit / "data", data)
    (data / "0003_target.png").write_bytes(b"not a png")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "model").symlink_to(tiny_edit / "model")
    (tiny / "data").symlink_to(data)
    out = tmp_path / "out"
    proc = run_trainer(tiny, out, num_procs=2)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "row 4 (0003_target.png): cannot be decoded" in text, text[-3000:]
    assert "bad_rows" in text
    assert "row 4" in (out / "bad_rows.txt").read_text()
    assert not list(out.glob("global_step*"))


LORA_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def plain_run(tiny_edit, tmp_path_factory):
    """3 logged steps without any speed option, a checkpoint at step 2: (losses, exported LoRA, output dir)."""
    out = tmp_path_factory.mktemp("plain")
    cfg = write_config(out / "cfg.json", **{"qwen_edit.output.log_every_steps": 1,
                                            "qwen_edit.output.save_every_steps": 2})
    check(run_trainer(tiny_edit, out / "run", config=cfg, extra=("--max_steps", "3")))
    return [r["loss"] for r in metrics(out / "run")], load_file(out / "run" / "export" / LORA_FILE), out / "run"


@pytest.mark.parametrize("changes, loss_tol, weight_tol", [
    ({"gradient_checkpointing": True}, 1e-5, 1e-5),  # recomputation only: same kernels
    ({"gradient_checkpointing": True, "checkpoint_blocks": 1}, 1e-5, 1e-5),  # block 0 recomputed, block 1 not
    # both blocks' frozen weights in host memory, copied in before each use: the same numbers, checkpointed
    ({"gradient_checkpointing": True, "offload_blocks": 2}, 1e-5, 1e-5),
    ({"compile": True}, 1e-4, 1e-4),  # torch.compile fuses kernels, which round differently
    # e4m3 frozen weights and fp8 matmuls change the model itself: losses within 1%, and after 3 Adam steps of
    # lr 1e-2 the LoRA weights within 0.3 lr of the plain run's (a broken fp8 path misses both by far)
    ({"fp8_base": True}, 1e-2, 3e-3),
    ({"fp8_base": True, "fp8_transposed": True}, 1e-2, 3e-3),  # the same matmuls with a stored transpose
    ({"fp8_base": True, "fp8_fast_accum": True}, 1e-2, 3e-3),  # a CPU's fp8 matmul accumulates one way only
], ids=["checkpointing", "checkpoint_blocks", "offload_blocks", "compile", "fp8_base", "fp8_transposed",
        "fp8_fast_accum"])
def test_speed_options_keep_the_numbers(tiny_edit, tmp_path, plain_run, changes, loss_tol, weight_tol):
    """train.gradient_checkpointing (+ checkpoint_blocks), train.compile and train.fp8_base train like the plain
    run: losses and exported LoRA weights agree within the stated tolerances (fp32, CPU)."""
    cfg = write_config(tmp_path / "cfg.json", **{f"qwen_edit.train.{k}": v for k, v in changes.items()},
                       **{"qwen_edit.output.log_every_steps": 1})
    out = tmp_path / "run"
    proc = run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "3"))
    check(proc)
    losses, weights = [r["loss"] for r in metrics(out)], load_file(out / "export" / LORA_FILE)
    plain_losses, plain_weights, _ = plain_run
    assert losses == pytest.approx(plain_losses, rel=loss_tol)
    diff = max((weights[k] - plain_weights[k]).abs().max().item() for k in weights)
    assert diff < weight_tol, diff
    if changes.get("fp8_base"):  # the option really ran: quantised weights cannot give bitwise the same losses
        assert losses != plain_losses
    if changes.get("fp8_fast_accum"):  # and reached every converted linear (the tiny model's 2 blocks: 28)
        assert "fp8 base: 28 frozen linears kept in float8 e4m3, 24 of them with fast accumulation" in proc.stdout


def _continues(out: Path, losses: list, weights: dict, tol: float = 1e-6) -> None:
    """The run in `out`, resumed from global_step2, gave the uninterrupted run's losses and final LoRA within `tol`
    (fp32 rounding of a changed setting's own arithmetic). Step 3's update depends on the restored Adam moments and
    step count: resumed with load_optimizer_states=False (Adam started afresh; tried by hand) the LoRA ends 2e-3
    away from the plain run's, far beyond `tol`."""
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert [r["loss"] for r in metrics(out)] == pytest.approx(losses, rel=tol)
    resumed = load_file(out / "export" / LORA_FILE)
    assert resumed.keys() == weights.keys()
    assert max((resumed[k] - weights[k]).abs().max().item() for k in weights) <= tol


def _offload_config(path: Path, optimizer: bool, blocks: int) -> Path:
    changes = {"qwen_edit.output.log_every_steps": 1, "qwen_edit.output.save_every_steps": 2}
    if optimizer:
        changes["zero_optimization.offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if blocks:
        changes.update({"qwen_edit.train.gradient_checkpointing": True, "qwen_edit.train.offload_blocks": blocks})
    return write_config(path, **changes)


def test_optimizer_offload_trains_like_the_plain_run_and_resumes_exactly(tiny_edit, tmp_path, plain_run):
    """zero_optimization.offload_optimizer as the memory plan writes it ({device: cpu, pin_memory: true}), with both
    blocks offloaded: DeepSpeed keeps the fp32 master weights, gradients and Adam moments in host memory and steps
    there (on CPU with torch's AdamW, tiny_cpu.json's torch_adam; on a GPU with DeepSpeedCPUAdam). 3 steps train like
    the plain run; resumed from global_step2, step 3's loss and the exported LoRA are exactly the uninterrupted run's.
    Resumed once more from global_step2 with both offloads off (what a new plan on a bigger GPU chooses), the run
    continues like the uninterrupted one: the checkpoint holds the same optimizer partition either way."""
    cfg = _offload_config(tmp_path / "cfg.json", optimizer=True, blocks=2)
    out = tmp_path / "run"
    proc = run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "3"))
    check(proc)
    assert "optimizer offload: fp32 master weights, gradients and AdamW's state in host memory" in proc.stdout
    assert "offloaded blocks: 2 blocks' frozen weights in host memory" in proc.stdout
    losses, weights = [r["loss"] for r in metrics(out)], load_file(out / "export" / LORA_FILE)
    plain_losses, plain_weights, _ = plain_run
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert max((weights[k] - plain_weights[k]).abs().max().item() for k in weights) < 1e-5
    saved = json.loads((out / "config.json").read_text())["zero_optimization"]["offload_optimizer"]
    assert saved == {"device": "cpu", "pin_memory": True}
    check(run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "3", "--resume", "global_step2")))
    _continues(out, losses, weights, tol=0)
    off = _offload_config(tmp_path / "off.json", optimizer=False, blocks=0)
    proc = run_trainer(tiny_edit, out, config=off, extra=("--max_steps", "3", "--resume", "global_step2"))
    check(proc)
    assert "optimizer offload:" not in proc.stdout and "offloaded blocks:" not in proc.stdout
    _continues(out, losses, weights)
    changes = json.loads((out / "config_changes.jsonl").read_text().splitlines()[-1])["changes"]
    assert changes["zero_optimization.offload_optimizer.device"] == ["cpu", None]
    assert changes["qwen_edit.train.offload_blocks"] == [2, 0]


def test_a_plain_checkpoint_resumes_with_both_offloads(tiny_edit, tmp_path, plain_run):
    """The other way: a checkpoint saved without any offload, resumed with DeepSpeed's optimizer offload and one
    block offloaded (a smaller GPU's plan), continues like the uninterrupted plain run; the change is recorded."""
    import shutil

    plain_losses, plain_weights, plain_dir = plain_run
    out = tmp_path / "run"
    shutil.copytree(plain_dir, out)
    cfg = _offload_config(tmp_path / "cfg.json", optimizer=True, blocks=1)
    proc = run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "3", "--resume", "global_step2"))
    check(proc)
    assert "optimizer offload:" in proc.stdout and "offloaded blocks: 1 blocks'" in proc.stdout
    assert "the dataset changed" not in proc.stdout  # the same rows
    _continues(out, plain_losses, plain_weights)
    changes = json.loads((out / "config_changes.jsonl").read_text())["changes"]
    assert changes["zero_optimization.offload_optimizer.device"] == [None, "cpu"]
    assert changes["qwen_edit.train.offload_blocks"] == [0, 1]


def test_a_resume_over_changed_rows_says_so_and_goes_on(tiny_edit, tmp_path, plain_run):
    """A checkpoint records the rows it trained on; resumed over a dataset with a row removed, the run says so with
    both counts, goes on at the checkpoint's step with the rows as they are, and records the change."""
    import shutil

    out, data = tmp_path / "run", tmp_path / "tiny"
    shutil.copytree(plain_run[2], out)
    shutil.copytree(tiny_edit / "data", data / "data")
    (data / "model").symlink_to(tiny_edit / "model")
    meta = data / "data" / "metadata.jsonl"
    meta.write_text("".join(meta.read_text().splitlines(keepends=True)[:-1]))
    proc = run_trainer(data, out, extra=("--max_steps", "3", "--resume", "global_step2"))
    check(proc)
    assert ("warning: the dataset changed since global_step2: 32 rows then, 31 now (rows added, removed or edited). "
            "The run goes on at step 2 with the rows as they are now") in proc.stdout
    changes = json.loads((out / "config_changes.jsonl").read_text())["changes"]
    assert [counts["rows"] for counts in changes["data rows"]] == [32, 31]
    assert json.loads((out / "global_step3" / "trainer_state.json").read_text())["data"]["rows"] == 31
