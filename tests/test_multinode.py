"""Multi-node on one machine: two deepspeed launchers act as two nodes (hostfile, --no_ssh, node_rank 0/1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, metrics, run_trainer, write_config

pytestmark = pytest.mark.slow

STEPS = 6


def node_commands(tiny: Path, outs: list[Path], config: Path, hostfile: Path, extra: tuple[str, ...] = ()):
    port = str(free_port())
    for node, out in enumerate(outs):
        yield [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
               str(REPO / "train" / "main.py"), "--ds_config", str(config), "--model", str(tiny / "model"),
               "--data", str(tiny / "data"), "--output_dir", str(out), *extra]


def run_two_nodes(tiny: Path, outs: list[Path], config: Path, hostfile: Path, extra: tuple[str, ...] = ()) -> None:
    procs = [subprocess.Popen(cmd, cwd=REPO, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for cmd in node_commands(tiny, outs, config, hostfile, extra)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for node, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"node {node} exit {proc.returncode}\n{log[-5000:]}"
    return logs


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hosts") / "hostfile"
    path.write_text("node-a slots=2\nnode-b slots=2\n")
    return path


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "multinode.json"
    return write_config(path, **{"qwen_edit.output.log_every_steps": 1, "qwen_edit.output.save_every_steps": 3})


@pytest.fixture(scope="module")
def four_process_losses(tiny_edit, config, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single_launcher")
    proc = run_trainer(tiny_edit, out, config=config, num_procs=4, extra=("--max_steps", str(STEPS)))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [r["loss"] for r in metrics(out)]


def test_two_launchers_match_one_launcher(tiny_edit, config, hostfile, four_process_losses, tmp_path):
    """2 nodes x 2 processes on a shared output dir: the 4 ranks agree and the losses equal one 4-process launcher."""
    out = tmp_path / "shared"
    logs = run_two_nodes(tiny_edit, [out, out], config, hostfile, ("--max_steps", str(STEPS)))
    assert [r["loss"] for r in metrics(out)] == four_process_losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert len(summary["replica_digests"]) == 4 and len(set(summary["replica_digests"])) == 1
    assert "Traceback" not in logs[0] + logs[1]


def test_other_ranks_lines_carry_their_rank_and_node(monkeypatch, capsys):
    """Every line that a rank other than 0 prints starts with its rank and node (the launcher's CROSS_RANK), also a
    line written in pieces; rank 0's lines stay as they are. (A 2-node run's ranks print nothing else: the
    libraries' noise is filtered.)"""
    import sys

    from train.runtime.console import prefix_rank_output

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored afterwards: prefix_rank_output replaces them
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    prefix_rank_output({"RANK": "0"})
    print("rank zero")
    prefix_rank_output({"RANK": "3", "CROSS_RANK": "1"})
    print("one line\nand another", end="")
    print(" finished")
    print("warning", file=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == "rank zero\n[rank 3 node 1] one line\n[rank 3 node 1] and another finished\n"
    assert captured.err == "[rank 3 node 1] warning\n"


def test_node_local_storage_resume(tiny_edit, config, hostfile, four_process_losses, tmp_path):
    """checkpoint.use_node_local_storage with a separate output dir per node (as node-local disks): each node
    commits its own copy; resuming from step 3 on both nodes reproduces the losses of the uninterrupted run."""
    local_cfg = write_config(tmp_path / "local.json", base=config, **{"checkpoint.use_node_local_storage": True})
    outs = [tmp_path / "node0", tmp_path / "node1"]
    run_two_nodes(tiny_edit, outs, local_cfg, hostfile, ("--max_steps", "3"))
    for out in outs:
        assert (out / "latest").read_text().strip() == "global_step3", out
    run_two_nodes(tiny_edit, outs, local_cfg, hostfile, ("--max_steps", str(STEPS), "--resume"))
    assert [r["loss"] for r in metrics(outs[0])] == four_process_losses
