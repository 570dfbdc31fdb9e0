"""Fault tolerance on the tiny model: a killed rank, a failed save, NaN steps, OOM, resume checks."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import warm
from conftest import (
    REFERENCE_STEPS,
    REPO,
    free_port,
    launcher_command,
    metrics,
    run_trainer,
    small_tmpfs,
    start_refused,
    write_config,
)

pytestmark = pytest.mark.slow

MAX_STEPS = REFERENCE_STEPS  # the uninterrupted reference run's (conftest.reference_run)


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


@pytest.fixture(scope="module")
def reference_losses(reference_run) -> list[float]:
    """Per-step losses of the uninterrupted 2-process run."""
    return [r["loss"] for r in metrics(reference_run)]


def launch(tiny: Path, out: Path, config: Path, env_extra: dict | None = None) -> subprocess.Popen:
    cmd = [*launcher_command(2), str(REPO / "train" / "main.py"), "--ds_config", str(config), "--model",
           str(tiny / "model"), "--data", str(tiny / "data"), "--output_dir", str(out), "--max_steps", str(MAX_STEPS)]
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and any(r["step"] >= step for r in metrics(out)):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The rank's own process: a child of deepspeed's launch.py (its DataLoader workers share its command line)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        parent = child.parent()
        if f"--local_rank={rank}" in " ".join(child.cmdline()) and "launch" in " ".join(parent.cmdline()):
            return child
    raise LookupError(f"rank {rank} not found")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(processes: list[psutil.Process], grace_s: float = 10.0) -> list[int]:
    """Wait up to `grace_s` for a launch's process tree to end, then kill what is left; returns the pids that were
    still alive."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in processes):
        time.sleep(0.2)
    alive = [p for p in processes if _alive(p)]
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


def test_killed_rank_ends_the_job_and_resume_matches(tiny_edit, fault_config, reference_losses, tmp_path):
    """SIGKILL one rank after step 6: the launcher exits non-zero within 60 s; resuming from global_step4
    reproduces the uninterrupted run's losses exactly (fp32 on CPU). Step 7 hangs (QWEN_EDIT_HOLD_AT), so that the
    kill lands before step 8's save however fast the steps run (a race the suite once lost on a loaded machine)."""
    out = tmp_path / "run"
    launcher = launch(tiny_edit, out, fault_config, {"QWEN_EDIT_HOLD_AT": "7"})
    wait_for_step(out, 6, launcher)
    tree = psutil.Process(launcher.pid).children(recursive=True)
    killed_at = time.monotonic()
    rank_process(launcher, 1).send_signal(signal.SIGKILL)
    launcher.wait(timeout=120)
    exit_s = time.monotonic() - killed_at
    leftovers = reap(tree)  # DataLoader workers notice their parent is gone within 5 s
    assert launcher.returncode != 0
    assert exit_s < 60, f"launcher took {exit_s:.1f} s to exit after a rank died"
    assert not leftovers, f"processes outlived the job: {leftovers}"
    assert (out / "latest").read_text().strip() == "global_step4"
    check(run_trainer(tiny_edit, out, config=fault_config, num_procs=2,
                      extra=("--max_steps", str(MAX_STEPS), "--resume")))
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert [r["loss"] for r in records] == reference_losses
    kept = sorted(p.name for p in out.glob("global_step*"))
    assert kept == ["global_step12", "global_step8"], kept  # keep_last = 2


def test_failed_save_keeps_latest_resumable(tiny_edit, fault_config, reference_losses, tmp_path):
    """A save that fails after every rank wrote its files (injected ENOSPC at step 8) stops the run with a clear
    message; 'latest' still names global_step4, and resuming from it reproduces the reference losses."""
    out = tmp_path / "run"
    launcher = launch(tiny_edit, out, fault_config, {"QWEN_EDIT_FAIL_SAVE_AT": "8"})
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode != 0
    assert "saving checkpoint global_step8" in output and "free disk space" in output, output[-3000:]
    assert (out / "latest").read_text().strip() == "global_step4"
    assert (out / "global_step8.partial").is_dir() and not (out / "global_step8").exists()
    check(run_trainer(tiny_edit, out, config=fault_config, num_procs=2,
                      extra=("--max_steps", str(MAX_STEPS), "--resume")))
    assert [r["loss"] for r in metrics(out)] == reference_losses
    assert not (out / "global_step8.partial").exists()


def test_zero1_run_resumes_like_the_zero2_reference(tiny_edit, fault_config, reference_losses, tmp_path):
    """ds_configs/lora_fast.json's ZeRO setting (stage 1, no gradient hooks): 4 steps, then --resume to the end;
    every step's loss matches the uninterrupted ZeRO-2 run within fp32 summation order."""
    config = write_config(tmp_path / "z1.json", base=fault_config,
                          zero_optimization={"stage": 1, "overlap_comm": False, "contiguous_gradients": False})
    out = tmp_path / "run"
    check(run_trainer(tiny_edit, out, config=config, num_procs=2, extra=("--max_steps", "4")))
    assert (out / "latest").read_text().strip() == "global_step4"
    proc = run_trainer(tiny_edit, out, config=config, num_procs=2, extra=("--max_steps", str(MAX_STEPS), "--resume"))
    check(proc)
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(reference_losses, rel=1e-5)
    # the schedule was 4 steps long and is now MAX_STEPS long: the run says so (inside the warmup, no jump here)
    assert (f"resume: train.max_steps is {MAX_STEPS}, the checkpoint's run had 4; DeepSpeed's WarmupCosineLR is "
            f"re-stretched over {MAX_STEPS} steps") in proc.stdout, proc.stdout[-3000:]


def _cosine(total_num_steps: int, position: int):
    """DeepSpeed's WarmupCosineLR (lr 1e-4, 10 warmup steps, end at 0.1 x) after `position` optimizer steps."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    scheduler = WarmupCosineLR(optimizer, total_num_steps=total_num_steps, warmup_num_steps=10, cos_min_ratio=0.1)
    for _ in range(position):
        scheduler.step()
    return scheduler


def test_schedule_note_warns_with_both_rates():
    """A 100-step cosine run resumed at its end with --max_steps 200: DeepSpeed's scheduler (its saved position
    loaded, as checkpoint.load does) is re-stretched, the rate jumps from the end value 1e-5 to about 5.9e-5; the
    warning gives both from the scheduler's own formula, and leaves the scheduler as it found it."""
    from train.runtime.resume_changes import schedule_note

    state = {"config": {"scheduler": {"type": "WarmupCosineLR"}, "qwen_edit": {"train": {"max_steps": 100}}}}
    resumed = _cosine(200, 0)
    resumed.load_state_dict(_cosine(100, 100).state_dict())  # what DeepSpeed's load_checkpoint restores
    now = resumed.get_lr()[0]
    assert 5e-5 < now < 6e-5
    note = schedule_note(state, 200, 100, resumed)
    assert note == ("warning: resume: train.max_steps is 200, the checkpoint's run had 100; DeepSpeed's "
                    "WarmupCosineLR is re-stretched over 200 steps, so the learning rate of step 101 is "
                    f"{now:.3g} instead of 1e-05 on the saved curve ({now / 1e-5:.3g}x). To keep the saved curve, "
                    "resume with the old --max_steps; to go on at a fixed rate, see docs/checkpoints.md, "
                    "'Extending a run'")
    assert resumed.total_num_steps == 200 and resumed.get_lr()[0] == now
    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md").read_text().split())
    assert f"`{note[:note.index('. To keep')]}`" in page  # the page the warning points at quotes it
    assert schedule_note(state, 100, 50, _cosine(100, 50)) is None  # same length
    constant = {"config": {**state["config"], "scheduler": {"type": "WarmupLR"}}}
    assert schedule_note(constant, 200, 100, resumed) is None  # its rate does not depend on max_steps
    assert schedule_note(state, 200, 100, None) is None  # no scheduler


def test_readme_fixed_rate_extension_resumes_at_that_rate():
    """docs/checkpoints.md 'Extending a run': resuming a cosine run with WarmupLR (min = max = R, 1 warmup step) in
    its place loads the saved position and trains on at R (the end rate of the saved curve here)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    saved = _cosine(100, 100)
    end = saved.get_lr()[0]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    fixed = WarmupLR(optimizer, warmup_min_lr=end, warmup_max_lr=end, warmup_num_steps=1)
    fixed.load_state_dict(saved.state_dict())
    rates = []
    for _ in range(3):
        fixed.step()
        rates.append(fixed.get_lr()[0])
    assert rates == [pytest.approx(end)] * 3 and end == pytest.approx(1e-5)


def test_resume_refuses_another_world_size(tiny_edit, fault_config, reference_run, tmp_path):
    """A 2-process checkpoint (a copy of the reference run's) resumed by 1 process stops with exit 2 and says how to
    proceed; a fresh run into the finished run's directory, and a resume with a DeepSpeed key typo, stop without
    changing its files."""
    import shutil

    out = shutil.copytree(reference_run, tmp_path / "run")
    code, err = start_refused(tiny_edit, out, config=fault_config, extra=("--max_steps", "16", "--resume"))
    assert code == 2, err[-3000:]
    assert "saved by 2 processes, resumed by 1" in err and "python -m train.export" in err
    kept = {name: (out / name).read_bytes() for name in ("config.json", "metrics.jsonl", "latest")}
    code, err = start_refused(tiny_edit, out, config=fault_config, extra=("--max_steps", "16"))  # a fresh run
    assert code == 2 and "holds another run (global_step12, global_step8, latest" in err, err[-3000:]
    typo = write_config(tmp_path / "typo.json", base=fault_config, zero_optimization={"stage": 2, "overlap_comn": 1})
    proc = run_trainer(tiny_edit, out, config=typo, num_procs=2, extra=("--max_steps", "16", "--resume"))
    assert proc.returncode == 2 and "zero_optimization.overlap_comn: Extra inputs are not permitted" in (
        proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    assert {name: (out / name).read_bytes() for name in kept} == kept, "a failed start changed the finished run"


def test_resume_errors(tiny_edit, fault_config, tmp_path):
    """--resume with no checkpoint, and with a tag that is not complete, exit 2 naming the fix."""
    code, err = start_refused(tiny_edit, tmp_path / "empty", config=fault_config, extra=("--resume",))
    assert code == 2 and "has no 'latest' checkpoint" in err, err[-2000:]
    assert not (tmp_path / "empty").exists()  # nor its lock: a refused start leaves nothing it made
    (tmp_path / "partial" / "global_step4.partial").mkdir(parents=True)
    code, err = start_refused(tiny_edit, tmp_path / "partial", config=fault_config, extra=("--resume", "global_step4"))
    assert code == 2 and "its save was interrupted" in err, err[-2000:]


def test_nonfinite_steps_are_skipped_then_stop(tiny_edit, tmp_path):
    """NaN losses at steps 2 and 3: skipped with warnings under the limit (weights stay finite); over it, stop."""
    cfg = write_config(tmp_path / "nan.json", **{"qwen_edit.output.log_every_steps": 1,
                                                 "qwen_edit.train.max_nonfinite_steps": 2})
    env = {**os.environ, "QWEN_EDIT_NAN_LOSS_AT": "2,3"}
    out = tmp_path / "ok"
    args = [str(REPO / "train" / "main.py"), "--ds_config", str(cfg), "--model", str(tiny_edit / "model"), "--data",
            str(tiny_edit / "data"), "--max_steps", "5"]
    proc = warm.run([*args, "--output_dir", str(out)], cwd=REPO, env=env)
    check(proc)
    assert "step 2 skipped: non-finite" in proc.stdout + proc.stderr
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 4, 5] and records[-1]["skipped_steps"] == 2
    from safetensors.torch import load_file

    assert all(t.isfinite().all() for t in load_file(out / "export" / "pytorch_lora_weights.safetensors").values())
    cfg = write_config(tmp_path / "nan1.json", base=cfg, **{"qwen_edit.train.max_nonfinite_steps": 1})
    proc = warm.run([*args[:2], str(cfg), *args[3:], "--output_dir", str(tmp_path / "stop")], cwd=REPO, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (  # the trainer's own stop: its line, no traceback
        "error: 2 optimizer steps had a NaN/inf loss or gradient norm (last at step 3); stopping. Lower the learning "
        "rate, check the data, or raise qwen_edit.train.max_nonfinite_steps")
    assert "Traceback" not in proc.stderr


def test_oom_names_the_settings_that_help(tiny_edit, tmp_path):
    """An out-of-memory error reports the step, micro-batch, resolution and the memory knobs."""
    env = {**os.environ, "QWEN_EDIT_OOM_AT": "2"}
    proc = warm.run([str(REPO / "train" / "main.py"), "--ds_config", str(REPO / "ds_configs" / "tiny_cpu.json"),
                     "--model", str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--output_dir",
                     str(tmp_path / "out"), "--max_steps", "3"], cwd=REPO, env=env)
    assert proc.returncode != 0
    msg = proc.stderr
    assert "CUDA out of memory at step 2: micro-batch 1, target 128x128 px (64 tokens)" in msg, msg[-3000:]
    assert "gradient_checkpointing = true" in msg and "qwen_edit.data.area" in msg


def test_bf16_resume_reproduces_losses(tiny_edit, fault_config, tmp_path):
    """DeepSpeed bf16 (on CPU here): a run resumed from step 4 repeats the uninterrupted run's losses exactly (a torn
    last line in metrics.jsonl is dropped)."""
    import shutil

    cfg = write_config(tmp_path / "bf16.json", base=fault_config, **{"bf16.enabled": True})
    full, cut = tmp_path / "full", tmp_path / "cut"
    check(run_trainer(tiny_edit, full, config=cfg, extra=("--max_steps", "8")))
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "global_step8")
    (cut / "latest").write_text("global_step4")
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 0.5')  # the torn last line of a run killed while writing it
    check(run_trainer(tiny_edit, cut, config=cfg, extra=("--max_steps", "8", "--resume")))
    assert json.loads((cut / "config.json").read_text())["bf16"]["enabled"]
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB tmpfs (root only; skipped where mounting is not permitted), unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        yield disk


def test_real_full_disk_during_a_save(tiny_edit, fault_config, small_disk):
    """A save that fills a real file system (torch reports it as an errno-less RuntimeError from inline_container)
    ends with the documented message and no traceback; 'latest' stays on the previous checkpoint; a read-only
    output directory is refused at start. The room check before step 1 (tests/test_diskspace.py) would refuse the
    resumed run: it is switched off, as when the disk fills up during the run."""
    out = small_disk / "run"
    check(run_trainer(tiny_edit, out, config=fault_config, extra=("--max_steps", "4")))
    used_kb = int(subprocess.run(["du", "-sk", str(small_disk)], capture_output=True, text=True).stdout.split()[0])
    subprocess.run(["mount", "-o", f"remount,size={used_kb + 512}k", str(small_disk)], check=True)  # no room for 1.3 MB
    proc = run_trainer(tiny_edit, out, config=fault_config, extra=("--max_steps", "8", "--resume"),
                       prelude="from train.runtime import diskspace\ndiskspace.check = lambda *args, **kwargs: None")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"error: saving checkpoint global_step8 into {out} failed (No space left on device); free disk space. "
            "'latest' still names the previous complete checkpoint") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "inline_container" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "latest").read_text().strip() == "global_step4"
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code, err = start_refused(tiny_edit, out, config=fault_config, extra=("--max_steps", "8", "--resume"))
    assert code == 2 and f"--output_dir {out}: cannot be used (Read-only file system)" in err, err[-3000:]


def _without_dac_override() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that root's program
    (its capabilities on exec come from that set) meets file permissions as any owner does."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def permission_checked():
    """Popen keyword arguments for a process that a chmod really stops: as root, one without the capability to
    override file permissions (a real EACCES from the kernel, not an injected error); otherwise none needed."""
    return {"preexec_fn": _without_dac_override} if os.geteuid() == 0 else {}


def test_save_into_an_unwritable_directory(tiny_edit, tmp_path, permission_checked):
    """The output directory stops being writable during a run (chmod 555, for a process that meets file
    permissions: a real EACCES, which torch reports as 'Parent directory ... does not exist'): the save ends the
    run with the documented message naming the directory and no traceback; the previous checkpoint, 'latest'
    and every logged step are kept and the checkpoint is still resumable; a start in the unwritable directory is
    refused before anything runs. Model-parallel mode, whose test hook slows the decoder to 0.5 s a step, so the
    chmod surely comes between the save of step 3 and that of step 6."""
    from test_model_parallel import mp_config

    from train.runtime import checkpoint

    out = tmp_path / "run"
    cfg = mp_config(tmp_path / "mp.json", **{"qwen_edit.output.save_every_steps": 3})
    cmd = [*launcher_command(2), str(REPO / "train" / "main.py"), "--ds_config", str(cfg), "--model",
           str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--output_dir", str(out), "--max_steps", "6"]
    env = {**os.environ, "QWEN_EDIT_SLOW_STAGE": "decoder:0.5", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **permission_checked)
    wait_for_step(out, 4, proc)
    assert (out / "latest").read_text().strip() == "global_step3"
    out.chmod(0o555)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, output[-4000:]
    assert (f"error: saving checkpoint global_step6 into {out} failed (Permission denied); make {out} writable for "
            "this user and resume. 'latest' still names the previous complete checkpoint") in output, output[-4000:]
    assert "Traceback" not in output and "does not exist" not in output, output[-4000:]
    assert (out / "latest").read_text().strip() == "global_step3"
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
    assert checkpoint.resolve_tag(out, "latest")[0] == "global_step3"  # its files checked too
    kept = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cmd[cmd.index("--max_steps") + 1: cmd.index("--max_steps") + 2] = ["8", "--resume"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                              **permission_checked)
        assert proc.returncode == 2 and f"--output_dir {out}: cannot be used (Permission denied)" in proc.stderr, \
            proc.stderr[-3000:]
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == kept
    finally:
        out.chmod(0o755)


def stop_with_sigterm(cmd: list[str], out: Path, signal_pid, min_step: int, timeout: float = 120):
    """Start `cmd`, wait for step `min_step` in metrics.jsonl, SIGTERM the pid `signal_pid(proc)` picks; returns
    (exit code, output, seconds to exit, pids of the tree still alive 10 s after the exit)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "QWEN_EDIT_VENV": str(Path(sys.executable).parent.parent)})
    wait_for_step(out, min_step, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    sent = time.monotonic()
    os.kill(signal_pid(proc), signal.SIGTERM)
    output, _ = proc.communicate(timeout=timeout)
    exit_s = time.monotonic() - sent
    return proc.returncode, output, exit_s, reap(tree)


def test_sigterm_saves_and_stops_the_whole_job(tiny_edit, tmp_path):
    """SIGTERM to `bash launch.sh` (forwarded to the runner's process group) and to a bare deepspeed runner (the
    ranks see their launcher orphaned): every rank saves the step it finished and the job ends with 143, leaving
    no process behind; the second run resumes from the first one's checkpoint."""
    cfg = write_config(tmp_path / "cfg.json", **{"qwen_edit.output.log_every_steps": 1,
                                                 "qwen_edit.output.save_every_steps": 0})
    out = tmp_path / "run"
    args = ["train/main.py", "--ds_config", str(cfg), "--model", str(tiny_edit / "model"), "--data",
            str(tiny_edit / "data"), "--output_dir", str(out), "--max_steps", "100000"]
    launch_sh = ["bash", str(REPO / "launch.sh"), "--num_gpus", "2", "--master_port", str(free_port()), *args]
    code, output, exit_s, left = stop_with_sigterm(launch_sh, out, lambda p: p.pid, 2)
    assert code == 143 and not left and exit_s < 60, (code, left, exit_s, output[-3000:])
    first = (out / "latest").read_text().strip()
    step = int(first.removeprefix("global_step"))
    assert f"stopped by SIGTERM after saving the checkpoint of step {step}" in output, output[-3000:]
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
              *args[:-2], "--max_steps", "100000", "--resume"]
    code, output, exit_s, left = stop_with_sigterm(runner, out, lambda p: p.pid, step + 2)
    assert not left and exit_s < 60, (code, left, exit_s, output[-3000:])
    second = (out / "latest").read_text().strip()
    assert int(second.removeprefix("global_step")) > step, (first, second, output[-3000:])


def test_a_leftover_partial_that_cannot_be_removed_is_a_named_save_error(tmp_path, monkeypatch):
    """An interrupted save of the same step left global_stepN.partial/; when it cannot be deleted (a file held by
    another user, a read-only mount) the save ends with the documented message, not shutil's raw error, before
    DeepSpeed writes anything."""
    from train.runtime import checkpoint

    class Engine:
        def use_node_local_storage(self):
            return False

        def save_checkpoint(self, *args, **kwargs):
            raise AssertionError("nothing may be written after the leftover could not be removed")

    (tmp_path / "global_step5.partial").mkdir()

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", refuse)
    with pytest.raises(checkpoint.SaveError) as e:
        checkpoint.save(Engine(), tmp_path, 5, {"config": {}})
    assert str(e.value) == (f"saving checkpoint global_step5 into {tmp_path} failed (Permission denied); make "
                            f"{tmp_path} writable for this user and resume. 'latest' still names the previous "
                            "complete checkpoint")


def test_a_write_that_a_full_disk_stops_anywhere_is_named(tmp_path):
    """Beyond checkpoints and the cache, any write of the run's own files that a real full file system stops (a
    plain file, a safetensors export) becomes one line naming the file or the output directory, the cause and the
    fix (train/main.py prints it on the rank that met it); an error that is no such write is left alone."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from train.runtime import write_failures

    with small_tmpfs(tmp_path / "disk", "8k") as disk:
        with pytest.raises(OSError) as e:
            (disk / "metrics.jsonl").write_text("x" * 100_000)
        assert write_failures.disk_failure(e.value, disk) == (
            f"writing into {disk} failed (No space left on device); free disk space there. --resume continues from "
            "the last complete checkpoint")
        with pytest.raises(SafetensorError) as e:
            save_file({"w": torch.zeros(100_000)}, str(disk / "export.safetensors"))
        assert write_failures.disk_failure(e.value, disk).startswith(f"writing into {disk} failed (No space left")
    denied = PermissionError(13, "Permission denied", str(tmp_path / "out" / "export"))
    assert write_failures.disk_failure(denied, tmp_path / "out").startswith(
        f"writing {tmp_path / 'out' / 'export'} failed (Permission denied); make {tmp_path / 'out'} writable")
    assert write_failures.disk_failure(PermissionError(13, "Permission denied", "/data/a.png"), tmp_path) is None
    assert write_failures.disk_failure(ValueError("not a write"), tmp_path) is None
