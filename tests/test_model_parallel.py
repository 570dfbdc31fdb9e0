"""The model-parallel mode: the placement plan, the cut transformer, and end-to-end runs over CPU processes.

Reference for every comparison: the ZeRO-2 mode on the same config (fp32 on CPU). The stages move the same
tensors through the same kernels, so losses, gradient norms and LoRA weights agree to fp32 summation order
(tolerance 1e-6 relative; on this machine they are bitwise equal).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import metrics, run_trainer, write_config

from model_parallel.plan import PlanError, build_plan

TOL = 1e-6


# --- the plan (no processes) ----------------------------------------------------------------------------------------


def test_plan_two_stages_one_pipeline():
    """2 processes: encoder on cuda:0, every block on cuda:1; role ranks 0 in both worlds."""
    plan = build_plan(["cuda:0", "cuda:1"], [], world_size=2, num_blocks=60, num_gpus=2)
    enc, dec = plan.placements
    assert (enc.is_encoder, enc.device, enc.blocks, enc.role_rank) == (True, "cuda:0", None, 0)
    assert (dec.is_last_decoder, dec.device, dec.blocks, dec.role_rank) == (True, "cuda:1", (0, 60), 0)


def test_plan_replicas_take_the_next_devices():
    """4 processes = 2 pipelines; the second on cuda:2/3; decoders are ranks 0 and 1 of the decoder world."""
    plan = build_plan(["cuda:0", "cuda:1"], [], world_size=4, num_blocks=60, num_gpus=4)
    assert [p.device for p in plan.placements] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [(p.pipeline, p.stage, p.role_rank) for p in plan.placements] == [(0, 0, 0), (0, 1, 0), (1, 0, 1),
                                                                              (1, 1, 1)]
    assert plan.role_world_size(encoder=False) == 2


def test_plan_decoder_cut():
    """3 stages with a cut at 30: blocks 0-29 and 30-59; the last stage is decoder rank 0 (it logs)."""
    plan = build_plan(["cuda:0", "cuda:1", "cuda:2"], [30], world_size=6, num_blocks=60, num_gpus=0)
    assert [p.blocks for p in plan.placements[:3]] == [None, (0, 30), (30, 60)]
    assert all(p.device == "cpu" for p in plan.placements)
    assert [p.role_rank for p in plan.placements] == [0, 1, 0, 1, 3, 2]
    assert "rank 2: pipeline 0 stage 2 decoder blocks 30-59 on cpu" in plan.describe()


def test_plan_refuses_a_pipeline_across_nodes():
    """3 processes per node cannot hold whole 2-stage pipelines."""
    with pytest.raises(PlanError, match="3 processes per node do not hold whole pipelines of 2 stages"):
        build_plan(["cuda:0", "cuda:1"], [], world_size=6, num_blocks=60, num_gpus=3, local_world_size=3)


# --- the cut transformer, in one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("tiny_name", ["tiny_edit", "tiny_2511"])
def test_cut_transformer_matches_the_whole(tiny_name, request):
    """Two DecoderStages chained by hand (activations forward, their gradients back through the surrogate) give the
    whole transformer's loss and LoRA gradients, with and without gradient checkpointing; also for 2511, whose
    timestep embedding crosses the cut doubled ([t, 0]) and whose stages rebuild the reference modulation index."""
    from diffusers import QwenImageTransformer2DModel

    from model_parallel.split import DecoderStage
    from train.config import LoraConfig
    from train.model import prepare
    from train.model.qwen_image import conditioning

    tiny_edit = request.getfixturevalue(tiny_name)

    def lora_model(checkpointing: bool):
        torch.manual_seed(0)
        t = QwenImageTransformer2DModel.from_pretrained(tiny_edit / "model", subfolder="transformer")
        assert t.config.zero_cond_t == (tiny_name == "tiny_2511")
        targets = ["attn.to_q", "img_in", "proj_out", "txt_mlp.net.2"]
        prepare.prepare_for_training(t, "lora", LoraConfig(rank=4, alpha=4, target_modules=targets), checkpointing,
                                    False)
        for n, p in t.named_parameters():  # LoRA B starts at zero: make gradients reach A too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
        return t

    gen = torch.Generator().manual_seed(1)
    target = torch.randn(1, 64, 64, generator=gen)
    width = json.loads((tiny_edit / "model" / "transformer" / "config.json").read_text())["joint_attention_dim"]
    kwargs = dict(hidden_states=torch.randn(1, 128, 64, generator=gen), timestep=torch.tensor([0.4]),
                  encoder_hidden_states=torch.randn(1, 7, width, generator=gen),
                  encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0]]),
                  img_shapes=conditioning.img_shapes((16, 16), [(1, 8, 8)], 1), return_dict=False)
    for checkpointing in (False, True):
        whole = lora_model(checkpointing)
        loss_whole = ((whole(**kwargs)[0][:, :64] - target) ** 2).mean()
        loss_whole.backward()
        first = DecoderStage(lora_model(checkpointing), (0, 1), True, False)
        last = DecoderStage(lora_model(checkpointing), (1, 2), False, True)
        x = first(**kwargs)
        last.inbox = tuple(t.detach().requires_grad_() for t in x)
        received = last.inbox
        loss_cut = ((last(**kwargs)[0][:, :64] - target) ** 2).mean()
        loss_cut.backward()
        sum((o * r.grad).sum() for o, r in zip(x, received, strict=True) if o.requires_grad).backward()
        assert loss_cut.item() == pytest.approx(loss_whole.item(), rel=TOL)
        def grads_of(module) -> dict[str, torch.Tensor]:
            return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in module.named_parameters()
                    if p.requires_grad}

        grads = {**grads_of(first.transformer), **grads_of(last.transformer)}
        expected = grads_of(whole)
        assert grads.keys() == expected.keys()
        # (the last block's text-stream LoRA feeds nothing the loss sees: zero gradient in both)
        assert sum(bool(g.abs().max() > 0) for g in expected.values()) > len(expected) // 2
        scale = max(g.abs().max().item() for g in expected.values())
        worst = max((grads[n] - g).abs().max().item() for n, g in expected.items()) / scale
        assert worst < 1e-5, f"checkpointing={checkpointing}: worst gradient difference {worst:.3g} of the largest"


# --- end-to-end over the launcher (CPU processes, gloo) -------------------------------------------------------------


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


def mp_config(path: Path, stages: int = 2, cuts: list[int] | None = None, **changes) -> Path:
    return write_config(path, **{"qwen_edit.output.log_every_steps": 1,
                                 "qwen_edit.parallel": {"mode": "model_parallel", "stages": ["cpu"] * stages,
                                                        "decoder_cuts": cuts or []}, **changes})


def records(out: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in metrics(out)]


def lora(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "export" / "pytorch_lora_weights.safetensors")


def assert_same_training(out: Path, ref: Path) -> None:
    got, want = records(out), records(ref)
    assert len(got) == len(want), (got, want)
    assert [x for r in got for x in r] == pytest.approx([x for r in want for x in r], rel=TOL), (got, want)
    a, b = lora(out), lora(ref)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < TOL
    assert max(b[k].abs().max().item() for k in b if "lora_B" in k) > 1e-3  # the LoRA moved: not vacuous


@pytest.fixture(scope="module")
def reference(online_run) -> Path:
    """One process, ZeRO-2 mode, 6 steps logged every step (conftest.online_run)."""
    return online_run


@pytest.fixture(scope="module")
def two_stage_run(tiny_edit, tmp_path_factory) -> Path:
    """Encoder process + decoder process (overlapped schedule), 6 steps, a checkpoint at step 3."""
    out = tmp_path_factory.mktemp("mp_two_stages")
    cfg = mp_config(out.parent / f"{out.name}.json", **{"qwen_edit.output.save_every_steps": 3})
    check(run_trainer(tiny_edit, out, config=cfg, num_procs=2, extra=("--max_steps", "6")))
    return out


@pytest.mark.slow
def test_two_stages_train_like_one_process_and_resume(tiny_edit, reference, two_stage_run, tmp_path):
    """Encoder process + decoder process: the one-process run's losses, gradient norms and LoRA export; the
    checkpoint at step 3 resumes to the same losses; the summary reports both stages' busy/idle times."""
    cfg = mp_config(tmp_path / "mp.json", **{"qwen_edit.output.save_every_steps": 3})
    out = two_stage_run
    assert_same_training(out, reference)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parallel"] == {"mode": "model_parallel", "world_size": 2, "stages": 2, "decoder_cuts": []}
    assert summary["overlap"] is True
    assert 0 < summary["decoder_busy_fraction"] <= 1 and summary["encoder"]["micro_batches"] == 6
    assert "data_wait_fraction" in metrics(out)[-1]
    assert sorted(p.name for p in (out / "global_step3").glob("*.pt")) == [
        "mp_rank_00_model_states.pt", "rng_state_rank0.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "global_step6")
    (cut / "latest").write_text("global_step3")
    check(run_trainer(tiny_edit, cut, config=cfg, num_procs=2, extra=("--max_steps", "6", "--resume")))
    assert records(cut) == records(out)


@pytest.mark.slow
def test_decoder_cut_in_two_trains_like_one_process_and_exports(tiny_edit, reference, tmp_path):
    """Encoder + blocks 0-0 + blocks 1-1 (3 processes): the one-process run's losses, norms and LoRA export;
    `python -m train.export` of the last checkpoint (one file set per stage) merges the stages into the
    end-of-training export, tensor for tensor (fp32 on CPU: the module weights are the fp32 masters)."""
    from train import export
    from train.model import family
    from train.runtime import exports

    out = tmp_path / "out"
    run = run_trainer(tiny_edit, out, config=mp_config(tmp_path / "cut.json", 3, [1]), num_procs=3,
                      extra=("--max_steps", "6"))
    check(run)
    assert_same_training(out, reference)
    # the room on disk was counted before step 1: both decoder stages' files and the export of both stages' LoRA
    assert "disk: one checkpoint of " in run.stdout and "optimizer state from 2 ranks) and the export of" in run.stdout
    assert len(list((out / "global_step6").glob("*mp_rank_01_optim_states.pt"))) == 1
    assert export.main(["--checkpoint", str(out / "global_step6"), "--out", str(tmp_path / "exported")]) == 0
    from safetensors.torch import load_file

    merged, trained = load_file(tmp_path / "exported" / "pytorch_lora_weights.safetensors"), lora(out)
    assert merged.keys() == trained.keys() and all(torch.equal(merged[k], trained[k]) for k in trained)
    assert any(".transformer_blocks.0." in k for k in merged) and any(".transformer_blocks.1." in k for k in merged)
    (out / "global_step6" / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(ValueError, match="a decoder cut over 2 stages saves"):
        exports.export(out / "global_step6", tmp_path / "broken", family_of=family.family_for)


@pytest.mark.slow
def test_a_run_without_room_on_disk_stops_before_its_first_step(tiny_edit, tmp_path, monkeypatch):
    """Encoder + decoder with 1 kB free in the output directory (shutil.disk_usage faked there through a
    sitecustomize on PYTHONPATH): both exit 2 before step 1 with the disk check's line, no traceback, and nothing
    left in its place, nor the folder and lock that its start made."""
    out, site = tmp_path / "out", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import shutil\nreal = shutil.disk_usage\nshutil.disk_usage = lambda p: real(p)._replace(free=1000) if "
        f"str(p).startswith({str(out)!r}) else real(p)\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{__import__('os').environ.get('PYTHONPATH', '')}")
    run = run_trainer(tiny_edit, out, config=mp_config(tmp_path / "mp.json"), num_procs=2, extra=("--max_steps", "2"))
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"error: --output_dir {out}: 1e-06 GB free, the run needs " in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_two_pipelines_train_like_zero2_on_two_ranks(tiny_edit, validated_zero2, tmp_path):
    """4 processes = 2 pipelines whose decoders form a ZeRO-2 group: the 2-process ZeRO-2 run (the validated run of
    the validation tests, same config), step for step. With validation images in both runs: each pipeline renders
    its share (items p::2, as ZeRO-2 rank p), and the grids are the ZeRO-2 run's, pixel for pixel (conditioning
    recorded on the encoder stages, replayed on the decoders; model_parallel/validation.py)."""
    from test_validation import run_changes

    ref, out = validated_zero2["validated"], tmp_path / "out"
    check(run_trainer(tiny_edit, out, config=mp_config(tmp_path / "mp.json", **run_changes(validated_zero2["edits"])),
                      num_procs=4, extra=("--max_steps", "4")))
    assert_same_training(out, ref)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["replica_digests"]) == 2 and len(set(summary["replica_digests"])) == 1
    import numpy as np
    from PIL import Image

    for step in (2, 4):
        grids = [np.asarray(Image.open(run / "validation" / f"step_00000{step}.png").convert("RGB"))
                 for run in (ref, out)]
        assert grids[0].shape[0] > 3 * 16 and np.array_equal(*grids), step


@pytest.mark.slow
@pytest.mark.parametrize("slow", ["encoder", "decoder"])
def test_idle_time_follows_the_schedule(tiny_edit, tmp_path, slow):
    """One stage made 1 s per micro-batch slower: the other stage idles what the pipeline predicts from the two
    stages' measured busy times per micro-batch, Te (encoder) and Td (decoder). Slow encoder: the decoder waits
    max(0, Te - Td) per micro-batch after the first, the encoder hardly idles. Slow decoder: the decoder never
    waits (the queue is full) and the encoder idles max(0, Td - Te) per micro-batch once it is queue_depth + 2
    micro-batches ahead. Tolerance: 35 % + 0.5 s (a loaded 2-core machine)."""
    delay, n, depth = 1.0, 10, 2
    s = run_slowed(tiny_edit, tmp_path / "out", f"{slow}:{delay}", n, **{"qwen_edit.parallel.queue_depth": depth})
    te = s["encoder"]["busy_s"] / n
    td = (s["decoder_wall_s"] - s["decoder_wait_s"]) / n
    decoder_wait, encoder_idle = s["decoder_wait_after_first_s"], s["encoder"]["idle_s"]
    if slow == "encoder":
        assert te > td + 0.3, s
        predicted = (n - 1) * (te - td)
        assert abs(decoder_wait - predicted) < 0.35 * predicted + 0.5, (predicted, s)
        assert encoder_idle < 0.2 * n * delay, s
    else:
        assert td > te + 0.3, s
        predicted = (n - depth - 2) * (td - te)
        assert abs(encoder_idle - predicted) < 0.35 * predicted + 0.5, (predicted, s)
        assert decoder_wait < 0.2 * n * delay, s


@pytest.mark.slow
def test_sequential_schedule_trains_like_the_overlapped_one(slowed_schedules):
    """parallel.overlap false (the encoder encodes a micro-batch only when the decoder asks for it): the same
    losses, gradient norms and LoRA export as the overlapped run, bit for bit (the two runs of slowed_schedules: a
    stage's sleep changes no number); the summary names the schedule."""
    sequential, overlapped = slowed_schedules[False], slowed_schedules[True]
    assert records(sequential) == records(overlapped) and len(records(sequential)) == SLOWED_STEPS
    a, b = lora(sequential), lora(overlapped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((sequential / "summary.json").read_text())
    assert summary["overlap"] is False and summary["encoder"]["micro_batches"] == SLOWED_STEPS


def run_slowed(tiny_edit, out: Path, slow: str, num_steps: int, **changes) -> dict:
    """A 2-stage run with QWEN_EDIT_SLOW_STAGE=slow; returns its summary.json."""
    import os

    os.environ["QWEN_EDIT_SLOW_STAGE"] = slow
    try:
        check(run_trainer(tiny_edit, out, config=mp_config(out.parent / f"{out.name}.json", **changes),
                          num_procs=2, extra=("--max_steps", str(num_steps))))
    finally:
        del os.environ["QWEN_EDIT_SLOW_STAGE"]
    return json.loads((out / "summary.json").read_text())


SLOWED_STEPS = 8


@pytest.fixture(scope="module")
def slowed_schedules(tiny_edit, tmp_path_factory) -> dict[bool, Path]:
    """Both stages made slower per micro-batch (encoder 1 s, decoder 1.3 s), SLOWED_STEPS steps, once with
    parallel.overlap false and once true: {overlap: output directory}."""
    runs = {}
    for overlap in (False, True):
        runs[overlap] = tmp_path_factory.mktemp(f"overlap_{overlap}")
        run_slowed(tiny_edit, runs[overlap], "encoder:1.0,decoder:1.3", SLOWED_STEPS,
                   **{"qwen_edit.parallel.overlap": overlap})
    return runs


@pytest.mark.slow
def test_sequential_schedule_costs_both_stages_times(slowed_schedules):
    """Both stages made slower per micro-batch (slowed_schedules; encoder 1 s, decoder 1.3 s: about equal with the
    tiny encoders' own CPU time), run with parallel.overlap false and true. Te, Td: the encoder's and decoder's
    measured busy times per micro-batch. Sequential: the decoder idles Te every micro-batch (it asks, then waits
    for the encoding) and the encoder idles Td, so a step takes Te + Td. Overlapped: a step takes max(Te, Td), and
    the decoder idles far less than Te per micro-batch. Tolerances for a loaded 2-core machine: 35 % + 0.5 s on
    totals; the sequential step at least 1.5x the overlapped one (about 1.9x expected)."""
    n = SLOWED_STEPS
    step_s = {}
    for overlap, out in slowed_schedules.items():
        s = json.loads((out / "summary.json").read_text())
        assert s["overlap"] is overlap
        te = s["encoder"]["busy_s"] / n
        td = (s["decoder_wall_s"] - s["decoder_wait_s"]) / n
        assert min(te, td) > 0.9, s
        step_s[overlap] = s["decoder_wall_s"] / n
        predicted_step = max(te, td) if overlap else te + td
        assert abs(step_s[overlap] - predicted_step) < 0.35 * predicted_step + 0.5 / n, (predicted_step, s)
        decoder_wait, encoder_idle = s["decoder_wait_after_first_s"], s["encoder"]["idle_s"]
        if overlap:
            assert decoder_wait < 0.5 * (n - 1) * te, s
        else:
            for measured, predicted in ((decoder_wait, (n - 1) * te), (encoder_idle, (n - 1) * td)):
                assert abs(measured - predicted) < 0.35 * predicted + 0.5, (predicted, s)
    assert step_s[False] > 1.5 * step_s[True], step_s


def test_store_host_leaves_last():
    """worlds.leave: launch rank 0 (which hosts the TCPStore every group uses) waits until every process checked
    out, so a fast encoder no longer takes the store away from decoders still saving (seen on GPUs)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from model_parallel import worlds
    from tests.conftest import free_port

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    left_at = {}

    def decoder():
        time.sleep(0.5)  # still saving its checkpoint
        worlds.leave(worlds.Links(None, None, store=client, launch_world_size=2, launch_rank=1), 30)
        left_at["decoder"] = time.monotonic()

    thread = threading.Thread(target=decoder)
    thread.start()
    worlds.leave(worlds.Links(None, None, store=host, launch_world_size=2, launch_rank=0), 30)
    left_at["host"] = time.monotonic()
    thread.join()
    assert left_at["host"] >= left_at["decoder"] - 0.05


@pytest.mark.slow
def test_sigterm_saves_and_stops_every_stage(tiny_edit, tmp_path):
    """SIGTERM to the encoder process alone (DeepSpeed's launch.py terminates launch rank 0 first): the request
    reaches the decoder through the store, which saves the step it finished; the streams close and the job ends
    with 143, leaving no process. Then the sequential schedule (the decoder tells the encoder to stop), stopped
    through `bash launch.sh` (SIGTERM to every process at once), resumes from that checkpoint and stops again
    with a later one."""
    import sys

    from conftest import REPO, free_port
    from test_faults import rank_process, stop_with_sigterm

    out = tmp_path / "run"
    args = ["--model", str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--output_dir", str(out),
            "--max_steps", "100000"]
    cfg = mp_config(tmp_path / "mp.json", **{"qwen_edit.output.save_every_steps": 0})
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
              str(REPO / "train" / "main.py"), "--ds_config", str(cfg), *args]
    code, output, exit_s, left = stop_with_sigterm(runner, out, lambda p: rank_process(p, 0).pid, 2)
    assert code == 143 and not left and exit_s < 60, (code, left, exit_s, output[-4000:])
    step = int((out / "latest").read_text().strip().removeprefix("global_step"))
    assert step >= 2 and f"stopped by SIGTERM after saving the checkpoint of step {step}" in output, output[-4000:]
    assert metrics(out)[-1]["step"] == step
    seq = mp_config(tmp_path / "seq.json", **{"qwen_edit.output.save_every_steps": 0,
                                              "qwen_edit.parallel.overlap": False})
    launch_sh = ["bash", str(REPO / "launch.sh"), "--num_gpus", "2", "--master_port", str(free_port()),
                 "train/main.py", "--ds_config", str(seq), *args, "--resume"]
    code, output, exit_s, left = stop_with_sigterm(launch_sh, out, lambda p: p.pid, step + 2)
    assert code == 143 and not left and exit_s < 60, (code, left, exit_s, output[-4000:])
    second = int((out / "latest").read_text().strip().removeprefix("global_step"))
    assert second >= step + 2 and f"after saving the checkpoint of step {second}" in output, output[-4000:]
    assert [r["step"] for r in metrics(out)] == list(range(1, second + 1))
