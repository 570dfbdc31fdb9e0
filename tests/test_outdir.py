"""One run per output directory (train/runtime/outdir.py): the lock, fresh runs in used directories, --overwrite."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest
from conftest import REPO

from train import config
from train.runtime import outdir
from train.runtime.record import Metrics


def test_second_claim_is_refused_until_the_first_ends(tmp_path):
    """A directory held by a run refuses a second one, naming the holder; released, it can be claimed again."""
    with outdir.claim(tmp_path, resume=False, overwrite=False, holder=True):
        with pytest.raises(outdir.OutputDirError, match=f"another run is using it \\(pid {os.getpid()} on "):
            with outdir.claim(tmp_path, resume=True, overwrite=False, holder=True):
                pass
    with outdir.claim(tmp_path, resume=True, overwrite=False, holder=True):
        pass


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    """SIGKILL the process holding the lock (no clean-up runs): the directory is free at once."""
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom train.runtime import outdir\n"
                               f"with outdir.claim({str(tmp_path)!r}, False, False, True):\n"
                               "    print('held', flush=True)\n    time.sleep(600)\n"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert first_line(holder, timeout=120) == "held"
        with pytest.raises(outdir.OutputDirError, match=f"pid {holder.pid} "):
            with outdir.claim(tmp_path, resume=True, overwrite=False, holder=True):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with outdir.claim(tmp_path, resume=True, overwrite=False, holder=True):
        pass


def test_a_refused_start_leaves_no_folder_or_lock_it_made(tmp_path):
    """A start that fails inside the claim (a resume point missing, a config refused) takes back the folders and the
    lock file the claim made; a report it wrote stays, and with it its folder; another run's lock is never touched."""
    out = tmp_path / "runs" / "new"
    with pytest.raises(ValueError, match="refused"):
        with outdir.claim(out, resume=True, overwrite=False, holder=True):
            assert (out / outdir.LOCK_FILE).is_file()
            raise ValueError("refused")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ValueError):
        with outdir.claim(out, resume=False, overwrite=False, holder=True):
            (out / "bad_rows.txt").write_text("row 3\n")
            raise ValueError("bad rows")
    assert sorted(p.name for p in out.iterdir()) == ["bad_rows.txt"]
    with outdir.claim(out, resume=False, overwrite=False, holder=True):
        with pytest.raises(outdir.OutputDirError, match="another run is using it"):
            with outdir.claim(out, resume=True, overwrite=False, holder=True):
                pass
        assert (out / outdir.LOCK_FILE).is_file()


def used_dir(path):
    """A directory as a finished run leaves it, plus a cache and a pre-flight report."""
    for name in ("global_step4", "global_step8", "export", "cache", "tensorboard"):
        (path / name).mkdir(parents=True)
    (path / "global_step8" / "trainer_state.json").write_text('{"step": 8}')
    for name, text in {"latest": "global_step8", "metrics.jsonl": '{"step": 1}\n', "config.json": "{}",
                       "bad_rows.txt": "row 3\n", "gpu_metrics.jsonl": "{}\n"}.items():
        (path / name).write_text(text)
    return path


def test_fresh_run_refuses_a_used_directory(tmp_path):
    """Without --resume a directory holding another run is refused, listing what is there, and nothing changes;
    one holding only a cache or a pre-flight report is fresh."""
    out = used_dir(tmp_path / "run")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(outdir.OutputDirError, match="holds another run \\(global_step4, global_step8, latest, "
                                                    "config.json, metrics.jsonl, export and 1 more\\); continue it "
                                                    "with --resume, choose a new --output_dir, or pass --overwrite"):
        with outdir.claim(out, resume=False, overwrite=False, holder=True):
            pass
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != outdir.LOCK_FILE} == before
    with outdir.claim(out, resume=True, overwrite=False, holder=True):
        pass
    fresh = tmp_path / "fresh"
    (fresh / "cache").mkdir(parents=True)
    (fresh / "bad_rows.txt").write_text("row 1\n")
    with outdir.claim(fresh, resume=False, overwrite=False, holder=True):
        pass
    with outdir.claim(tmp_path / "new" / "dir", resume=False, overwrite=False, holder=True):
        assert (tmp_path / "new" / "dir").is_dir()


def test_overwrite_deletes_the_earlier_run_but_not_the_cache(tmp_path):
    """--overwrite passes the check; once every check has passed, the earlier run's files go, the cache stays."""
    out = used_dir(tmp_path / "run")
    with outdir.claim(out, resume=False, overwrite=True, holder=True):
        outdir.start_writing(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "bad_rows.txt", "cache"]


def test_overwrite_and_resume_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(["--ds_config", "x.json", "--resume", "--overwrite"])
    assert "--overwrite deletes the run that --resume continues" in capsys.readouterr().err


def test_metrics_truncate_drops_a_torn_last_line(tmp_path, capsys):
    """A run killed while writing a record leaves half a line: resume keeps the complete records up to its step."""
    records = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 4, "lo')
    Metrics.truncate(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == records[0] + "\n" + records[1] + "\n"
    assert "line 4: not a complete record" in capsys.readouterr().out


@pytest.mark.slow
def test_two_runs_on_one_directory(tiny_edit, tmp_path):
    """While a run trains, a second one on its directory (even with --resume) exits 2 naming the first."""
    from conftest import start_refused, write_config
    from test_faults import wait_for_step

    cfg = write_config(tmp_path / "cfg.json", **{"qwen_edit.output.log_every_steps": 1})
    args = [sys.executable, str(REPO / "train" / "main.py"), "--ds_config", str(cfg), "--model",
            str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--output_dir", str(tmp_path / "run")]
    first = subprocess.Popen([*args, "--max_steps", "100000"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(tmp_path / "run", 1, first)
        code, err = start_refused(tiny_edit, tmp_path / "run", config=cfg, extra=("--resume",))
        assert first.poll() is None, "the first run ended before the second was refused"
    finally:
        first.kill()
        first.wait(timeout=60)
    assert code == 2, err[-3000:]
    assert f"another run is using it (pid {first.pid} on " in err, err[-3000:]


_NODE_RANK = """
import os, sys
import datetime
import torch, torch.distributed as dist
from train.runtime import engine, outdir
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(os.environ["RANK"]), world_size=4,
                        timeout=datetime.timedelta(seconds=120))  # a rank that never comes fails the test
d = engine.Dist(dist.get_rank(), 4, int(os.environ["LOCAL_RANK"]), torch.device("cpu"))
for storage in sys.stdin:  # one claim per storage line the test sends, until "end"
    if storage.strip() == "end":
        break
    ds = {"checkpoint": {"use_node_local_storage": storage.strip() == "node_local"}}
    try:
        with outdir.claim(sys.argv[2], resume=False, overwrite=False, holder=outdir.is_holder(ds, d)):
            print("held", flush=True)
            sys.stdin.readline()  # the test looks at the locks meanwhile
    except outdir.OutputDirError as e:
        print(f"refused: {e}", flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


def start_two_nodes(tmp_path) -> list[subprocess.Popen]:
    """4 ranks over gloo as two 'nodes' of 2 (ranks 0-1 and 2-3), each node's ranks given their own output
    directory (as node-local disks have one path but two contents); each claims it once per `claim` call. One
    process group for every claim: a start of Python and torch per rank, not per claim."""
    store = f"file://{tmp_path / 'rendezvous'}"
    return [subprocess.Popen([sys.executable, "-c", _NODE_RANK, store, str(tmp_path / f"node{rank // 2}")],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank),
                                  "LOCAL_RANK": str(rank % 2)}) for rank in range(4)]


def claim(procs: list[subprocess.Popen], storage: str) -> list[str]:
    """Every rank claims its directory with `storage` ("node_local" or "shared"); their first lines ("held" or the
    refusal). A held claim lasts until `release`."""
    for p in procs:
        p.stdin.write(f"{storage}\n")
        p.stdin.flush()
    return [first_line(p, timeout=300) for p in procs]


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The process's first line of output, or "" when it prints none in `timeout` s (it is then killed)."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        proc.kill()
        return ""
    return proc.stdout.readline().strip()


def release(procs: list[subprocess.Popen]) -> None:
    """The ranks leave their held claims."""
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()


def end(procs: list[subprocess.Popen]) -> None:
    """The ranks leave their process group and exit."""
    for p in procs:
        p.stdin.write("end\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=120) == 0


def test_node_local_storage_locks_every_nodes_directory(tmp_path):
    """Which process holds the lock (docs/checkpoints.md): with checkpoint.use_node_local_storage each node's
    local rank 0 holds its own disk's directory (rank 0's lock cannot be seen on another node's disk, and each
    node writes its own checkpoint copy there), so a second run on either node is refused; with shared storage
    only global rank 0 holds the one directory every node sees. A used directory on one node's disk alone
    refuses the fresh run on every rank."""
    procs = start_two_nodes(tmp_path)
    try:
        lines = claim(procs, "node_local")
        assert lines == ["held"] * 4, lines
        for node, rank in ((0, 0), (1, 2)):
            holder = (tmp_path / f"node{node}" / outdir.LOCK_FILE).read_text()
            assert holder.startswith(f"pid {procs[rank].pid} "), (node, holder)
            with pytest.raises(outdir.OutputDirError, match=f"another run is using it \\(pid {procs[rank].pid} "):
                with outdir.claim(tmp_path / f"node{node}", resume=True, overwrite=False, holder=True):
                    pass
        release(procs)
        (tmp_path / "node1" / "global_step4").mkdir()  # a finished run's checkpoint on node 1's disk only
        lines = claim(procs, "node_local")
        assert all(line.startswith(f"refused: --output_dir {tmp_path / 'node1'} holds another run (global_step4)")
                   for line in lines), lines
        (tmp_path / "node1" / "global_step4").rmdir()
        lines = claim(procs, "shared")
        assert lines == ["held"] * 4, lines
        assert (tmp_path / "node0" / outdir.LOCK_FILE).read_text().startswith(f"pid {procs[0].pid} ")
        with outdir.claim(tmp_path / "node1", resume=True, overwrite=False, holder=True):
            pass  # nobody on 'node 1' holds a lock: with shared storage node 1 sees node 0's directory
        release(procs)
        end(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
