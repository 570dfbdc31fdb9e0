"""Process set-up helpers that need no process group."""

from __future__ import annotations

import json

import pytest

from train.runtime.engine import plain_arch_list


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),                       # what torch and some images preset on Hopper; DeepSpeed cannot parse it
    ("9.0a;8.0+PTX 10.0a", "9.0;8.0+PTX;10.0"),
    ("8.6", "8.6"),
    ("9.0;9.0a", "9.0"),
])
def test_plain_arch_list(value, expected):
    """Arch-specific suffixes are dropped, +PTX kept, duplicates merged."""
    assert plain_arch_list(value) == expected


def _fake_zero(grads: list) -> object:
    """The attributes of DeepSpeedZeroOptimizer that the two gradient checks read (one group, world of one)."""
    import types

    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return types.SimpleNamespace(bit16_groups=[grads], averaged_gradients={0: grads}, device=torch.device("cpu"),
                                 model_parallel_rank=0, dp_process_group=None,
                                 _model_parallel_all_reduce=lambda tensor, op: None,
                                 _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan)


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_multi_tensor_grad_checks_equal_deepspeeds(monkeypatch, poison):
    """train.runtime.ds_patches gives DeepSpeed's overflow flag and global norm (all-reduce of a world of one:
    identity)."""
    import deepspeed.comm
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from train.runtime import ds_patches

    monkeypatch.setattr(deepspeed.comm, "all_reduce", lambda tensor, op=None, group=None: None)
    assert ds_patches.apply()
    original = ds_patches._ORIGINAL
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((4096, 1e-3), (64, 10.0), (0, 1.0), (1000, 1.0))]
    if poison is not None:
        grads[1][7] = poison
    params = [torch.nn.Parameter(torch.empty_like(x)) for x in grads]
    fake = _fake_zero(grads)
    ours = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(fake)
    theirs = original["has_overflow_partitioned_grads_serial"](fake)
    assert bool(ours) == bool(theirs) == (poison is not None)
    norm = DeepSpeedZeroOptimizer.get_grad_norm_direct(fake, grads, params)
    reference = original["get_grad_norm_direct"](fake, grads, params)
    if poison is None:
        assert norm.item() == pytest.approx(reference.item(), rel=1e-6)
        assert reference.item() == pytest.approx(torch.cat(grads).double().norm().item(), rel=1e-6)
    else:
        assert norm.item() == reference.item() == -1.0  # DeepSpeed's mark of an invalid norm


MUON_CHECK = """
import sys
import torch
from train.runtime import ds_patches

assert ds_patches.import_muon_uncompiled()
assert "torch._inductor.compile_fx" not in sys.modules, "the import compiled (inductor loaded)"
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
assert issubclass(MuonWithAuxAdam, original_muon.MuonWithAuxAdam)
compiled = []
torch.compile = lambda fn, **kwargs: compiled.append(fn.__name__) or fn  # eager: records what was compiled
kernel = original_muon.zeropower_via_newtonschulz5
g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
assert torch.equal(kernel(g, 2), kernel.__wrapped__(g, 2)) and torch.equal(kernel(g, 3), kernel.__wrapped__(g, 3))
assert compiled == ["zeropower_via_newtonschulz5"], compiled  # compiled at its first call, once
assert not ds_patches.import_muon_uncompiled()  # imported already: nothing to do
"""


def test_muon_module_imports_without_compiling():
    """DeepSpeed's ZeRO optimizers import its Muon module for isinstance checks: imported through
    ds_patches.import_muon_uncompiled (a fresh process), its kernels are compiled with DeepSpeed's torch.compile at
    their first call instead of at the import, which loaded inductor (seconds of every rank's start)."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", MUON_CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _entry_point(name: str, tiny, tmp_path) -> tuple[object, list[str]]:
    """The command `name` and arguments that reach its rendezvous (train.main's model_parallel: a world of 2)."""
    from conftest import TINY_CONFIG, write_config

    from train import cache, infer, main

    common = ["--model", str(tiny / "model"), "--data", str(tiny / "data"), "--output_dir", str(tmp_path / "out")]
    if name == "infer":
        row = {"edit_image": str(tiny / "data" / "0000_ref.png"), "prompt": "make the circle red"}
        (tmp_path / "edits.jsonl").write_text(json.dumps(row) + "\n")
        return infer, ["--model", str(tiny / "model"), "--input", str(tmp_path / "edits.jsonl"),
                       "--out", str(tmp_path / "pictures")]
    if name == "model_parallel":
        mp = write_config(tmp_path / "mp.json", **{"qwen_edit.parallel": {"mode": "model_parallel",
                                                                         "stages": ["cpu", "cpu"]}})
        return main, ["--ds_config", str(mp), *common]
    return {"main": main, "cache": cache}[name], ["--ds_config", str(TINY_CONFIG), *common]


@pytest.mark.parametrize("name", ["main", "cache", "infer", "model_parallel"])
def test_taken_master_port_is_one_line_naming_the_fix(name, tiny_edit, tmp_path, monkeypatch, capsys):
    """A rendezvous port that another process holds ends train.main (both parallel modes), train.cache and
    train.infer with exit 2 and one line naming --master_port, not a c10d traceback."""
    import socket

    command, argv = _entry_point(name, tiny_edit, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # as the launcher sets them (monkeypatch restores them: init_distributed fills them in otherwise)
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2" if name == "model_parallel" else "1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            monkeypatch.setenv(key, value)
        code = command.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith(f"error: port {port} (the launcher's --master_port, default 29500) is already in use")
    assert "deepspeed --master_port " in err[-1] and "Traceback" not in "\n".join(err)


def test_taken_port_without_the_launcher_names_master_port(monkeypatch):
    """A plain `python train/main.py` takes its port from MASTER_PORT: the line names that variable instead."""
    import socket

    import torch.distributed as dist

    from train.runtime import engine

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(engine.PortInUseError, match=rf"^port {port} \(MASTER_PORT\) is already in use.*"
                           r"MASTER_PORT=\d+ python \.\.\., or leave MASTER_PORT unset$"):
            with engine.rendezvous_port(launched=False):
                dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)


def test_a_taken_port_in_the_benchmarks_is_one_line_too():
    """train.bench / train.bench_data leave PortInUseError to engine.exit_with: it prints the message alone."""
    import subprocess
    import sys

    from conftest import REPO

    script = ("from train.runtime import engine\n"
              "def main():\n    raise engine.PortInUseError('port 1 (MASTER_PORT) is already in use')\n"
              "engine.exit_with(main)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == \
        "error: port 1 (MASTER_PORT) is already in use"
    assert "Traceback" not in proc.stderr


def test_a_probe_that_cannot_run_here_says_why():
    """A SystemExit with a message (a probe that needs a GPU, a kernel this machine lacks) reaches the user through
    engine.exit_with: the message on stderr, exit 1, no traceback."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU's refusal, on any machine
    proc = subprocess.run([sys.executable, "-m", "train.bench", "--tiny", "--attention_kernel", "fa4"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "--attention_kernel fa4: FlashAttention-4 needs a CUDA GPU of compute capability 9.0 or newer")


@pytest.mark.parametrize("name", ["main", "cache", "infer"])
def test_more_processes_than_gpus_are_refused_before_anything_loads(name, tiny_edit, tmp_path, monkeypatch, capsys):
    """`deepspeed --num_gpus 8` on a node whose torch sees 2 GPUs: every command that the launcher starts stops at
    once (exit 2) with both counts and the flag that fixes it, instead of 6 ranks failing to take a device."""
    import torch

    command, argv = _entry_point(name, tiny_edit, tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_SIZE="8").items():
        monkeypatch.setenv(key, value)
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert "8 processes on this node (deepspeed --num_gpus 8) but torch sees 2 GPU(s) here" in err, err
    assert "start at most 2 (deepspeed --num_gpus 2)" in err and "Traceback" not in err


def test_more_cpu_processes_than_cores_warn_once_with_the_figures(monkeypatch, capsys):
    """Without a GPU, 8 processes on 2 cores start (gloo runs any number), rank 0 warning once with the figures;
    as many processes as cores say nothing."""
    import torch

    from train.runtime import engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engine, "usable_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_SIZE", "8")
    for rank in (0, 1):
        engine.check_processes(rank)
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: 8 processes on this node share its 2 CPU core(s) (no GPU): each runs one thread and "
                   "they take turns on the cores, slower than 2 process(es) would be; start at most 2 (deepspeed "
                   "--num_gpus 2)"]
    monkeypatch.setenv("LOCAL_SIZE", "2")
    engine.check_processes(0)
    assert capsys.readouterr().err == ""
