"""Room on disk before the first step (train/runtime/diskspace.py): the counted checkpoint is what checkpoint.save
writes, a run without room for one checkpoint stops before step 1, and one without room for its peak is warned."""

from __future__ import annotations

import queue as queues
from pathlib import Path

import pytest
from conftest import run_trainer, write_config

from train.runtime import diskspace, outdir


def test_checkpoints_held_at_the_peak():
    """A save writes a whole checkpoint before keep_last deletes the oldest: a fresh run with keep_last 3 has 4 at
    once; a resume over 3 kept ones adds 1; keep_last 0 keeps every save; a single save is one."""
    assert diskspace.checkpoints_held(10, 0, 3) == 4
    assert diskspace.checkpoints_held(10, 3, 3) == 1 and diskspace.checkpoints_held(10, 5, 3) == 1
    assert diskspace.checkpoints_held(2, 1, 3) == 2 and diskspace.checkpoints_held(1, 0, 3) == 1
    assert diskspace.checkpoints_held(10, 2, 0) == 10
    assert diskspace.num_writes(500, 2000, 0) == 4 and diskspace.num_writes(500, 2000, 1000) == 2
    assert diskspace.num_writes(0, 2000, 0) == 1 and diskspace.num_writes(5, 10, 10) == 1


def test_overwrite_frees_the_earlier_runs_files(tmp_path):
    """--overwrite deletes the earlier run's checkpoints before this run writes: their bytes count as free; the cache
    and the pre-flight's report stay, and do not."""
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "optim.pt").write_bytes(b"x" * 2**20)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "shard.safetensors").write_bytes(b"x" * 4 * 2**20)
    (tmp_path / "bad_rows.txt").write_bytes(b"x" * 2**20)
    assert 2**20 <= outdir.overwritten_bytes(tmp_path) < 2 * 2**20


def _count_and_save(tiny: str, tmp: str, queue) -> None:
    """A world of one, for LoRA and full fine-tuning on the tiny model: the counted checkpoint and export bytes of
    the new engine, diskspace.check's verdicts with the free space faked, the count again after one step, and the
    bytes that checkpoint.save and the export then write."""
    import contextlib
    import io
    import shutil

    import torch

    from train import config
    from train.model import family
    from train.runtime import checkpoint, engine, exports
    from train.trainer import build

    d = engine.init_distributed()
    real, results = shutil.disk_usage, {}
    for mode in ("lora", "full"):
        out = Path(tmp) / mode
        out.mkdir()
        path = write_config(Path(tmp) / f"{mode}.json", **{"qwen_edit.train.mode": mode,
                                                           "qwen_edit.output.keep_last": 1,
                                                           "qwen_edit.output.save_every_steps": 1})
        cfg = config.load_config(config.parse_args(["--ds_config", str(path), "--model", f"{tiny}/model", "--data",
                                                    f"{tiny}/data", "--output_dir", str(out), "--max_steps", "4"]),
                                 1, has_gpu=False)
        eng, _ = engine.build_engine(build.build_transformer(cfg), cfg.deepspeed)
        weights, optimizer = diskspace.checkpoint_bytes(eng)
        export = exports.export_bytes(eng.module, mode)
        one, verdicts = weights + optimizer, []
        for free in (one + export - 1, 2 * one + export - 1, 2 * one + export):  # refused, warned, passed
            shutil.disk_usage = lambda p, free=free: real(p)._replace(free=free)
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    diskspace.check(eng, d, cfg.project.output, 4, 0, export, overwrite=False)
                verdicts.append(printed.getvalue())
            except outdir.OutputDirError as e:
                verdicts.append(f"error: {e}")
        shutil.disk_usage = real
        eng.backward(sum(p.float().square().sum() for p in eng.module.parameters() if p.requires_grad))
        eng.step()  # Adam's moments exist from here on
        final = checkpoint.save(eng, out, 1, {"config": config.to_dict(cfg)})
        keys = family.family_named("qwen_image").lora
        written = (exports.export_lora(eng.module, out / "export", 16, 16, keys=keys) if mode == "lora"
                   else exports.export_full(eng.module, out / "export"))
        results[mode] = {"counted": one, "after_step": sum(diskspace.checkpoint_bytes(eng)), "export": export,
                         "written": sum(f.stat().st_size for f in final.iterdir()),
                         "exported": sum(f.stat().st_size for f in [written, *written.rglob("*")] if f.is_file()),
                         "files": sorted(f.name for f in final.iterdir()), "verdicts": verdicts,
                         "trainable": sum(p.numel() for p in eng.module.parameters() if p.requires_grad),
                         "out": str(out)}
    queue.put(results)
    torch.distributed.destroy_process_group()


def count_and_save(tiny: Path, tmp: Path) -> dict:
    """_count_and_save in a spawned process (its process group and DeepSpeed's state stay out of pytest's)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_count_and_save, args=(str(tiny), str(tmp), queue))
    proc.start()
    while True:
        try:
            results = queue.get(timeout=2)
            break
        except queues.Empty:
            assert proc.is_alive(), f"the counting process died (exit code {proc.exitcode})"
    proc.join(60)
    return results


def test_counted_checkpoint_is_what_save_writes(tiny_edit, tmp_path):
    """For LoRA and full fine-tuning of the tiny model, the bytes counted before the first step are within 5% of
    the files one step's checkpoint.save writes (fp32 on the CPU: the weights, then the fp32 master and Adam's two
    moments, which the first step creates: 4 x 4 bytes per trainable parameter; what is left out is the pickled
    metadata and the small files, tens of kilobytes here) and the count after the step agrees with the probe; the
    export within 3% of its files. diskspace.check refuses below one checkpoint and the export, warns below the
    2 checkpoints that save_every_steps 1 with keep_last 1 holds at once, and prints its summary above."""
    for mode, seen in count_and_save(tiny_edit, tmp_path).items():
        assert seen["counted"] == pytest.approx(16 * seen["trainable"], rel=0.01), (mode, seen)
        assert 0.95 * seen["written"] <= seen["counted"] <= seen["written"], (mode, seen)
        assert seen["after_step"] == pytest.approx(seen["counted"], abs=64), (mode, seen)  # + the 'step' scalar
        assert seen["export"] == pytest.approx(seen["exported"], rel=0.03), (mode, seen)
        refused, warned, passed = seen["verdicts"]
        assert refused.startswith(f"error: --output_dir {seen['out']}: ") and ", the run needs " in refused, refused
        for part in ("Free disk space or choose another --output_dir; leave room for 2 checkpoints and the export",
                     "before keep_last (1) deletes the oldest", "GB of trainable weights, ", "state from 1 rank)"):
            assert part in refused, (part, refused)
        assert warned.startswith(f"warning: --output_dir {seen['out']}: "), warned
        assert "not the run's peak of 2 checkpoints and the export" in warned and "a later save will fail" in warned
        assert passed.startswith("disk: one checkpoint of "), passed


@pytest.mark.slow
def test_a_run_without_room_stops_before_its_first_step(tiny_edit, tmp_path):
    """The trainer with 1 kB free in its output directory (shutil.disk_usage faked there) exits 2 before step 1 with
    the one-line message, no traceback, and nothing left in its place: no checkpoint, config or metrics, nor the
    folder and lock that its start made."""
    out = tmp_path / "run"
    fake = (f"import shutil\nreal = shutil.disk_usage\nshutil.disk_usage = lambda p: real(p)._replace(free=1000) if "
            f"str(p).startswith({str(out)!r}) else real(p)")
    run = run_trainer(tiny_edit, out, extra=("--max_steps", "2"), timeout=600, prelude=fake)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"error: --output_dir {out}: 1e-06 GB free, the run needs " in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert not out.exists()  # nothing written, and the folder and lock its claim made taken back
