"""One run per output directory, and nothing of an earlier run lost to a start that fails.

- A lock: the process that writes the run's files (rank 0; with DeepSpeed's node-local checkpoint storage, every
  node's local rank 0) holds an exclusive `flock` on OUTPUT/.lock for the run's life. The kernel drops it when
  the process ends, however it ends, so a killed run never leaves the directory locked. A second run on the same
  directory is refused, naming the holder.
- A fresh run (no --resume) refuses a directory that holds another run's checkpoints, metrics or exports:
  resume it, pick a new directory, or pass --overwrite to delete that run's files first.
- The run's own files (config.json, metrics, the deletion asked for by --overwrite) are written only once every
  check has passed and the model, data and engine are built (`start_writing`); a start that fails leaves the
  directory as it was (the pre-flight's bad_rows.txt and misaligned_rows.txt reports aside).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from train.runtime import engine

LOCK_FILE = ".lock"
# What a run leaves in its directory (besides global_step*); the cache (OUTPUT/cache, built beforehand by
# python -m train.cache) and the pre-flight's reports (bad_rows.txt, misaligned_rows.txt) do not make a directory
# used.
RUN_FILES = ("latest", "config.json", "metrics.jsonl", "summary.json", "export", "tensorboard", "validation")


class OutputDirError(ValueError):
    """The output directory cannot take this run; the message says what to do."""


def _acquire(out_dir: Path, created: list[Path]) -> int:
    """The open, flock-ed lock file's descriptor; OutputDirError when another process holds it. `created` gets
    what this makes that was not there (folders, then the lock file), for _leave_no_trace."""
    created += reversed([d for d in (out_dir, *out_dir.parents) if not d.exists()])  # the outermost first
    if not (out_dir / LOCK_FILE).exists():
        created.append(out_dir / LOCK_FILE)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):  # its files may still be writable, a new one is not
            code = errno.EROFS if os.statvfs(out_dir).f_flag & os.ST_RDONLY else errno.EACCES
            raise OSError(code, os.strerror(code))
        fd = os.open(out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputDirError(f"--output_dir {out_dir}: cannot be used ({e.strerror or e}); point it at a writable "
                             "directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 300).decode(errors="replace").strip()
        os.close(fd)
        raise OutputDirError(f"--output_dir {out_dir}: another run is using it ({holder or 'holder unknown'}); one "
                             "run per output directory: wait for it to end or choose another --output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    return fd


def previous_run(out_dir: Path) -> list[str]:
    """Names of the files of an earlier run in `out_dir` (empty for a fresh or cache-only directory)."""
    found = sorted(p.name for p in out_dir.glob("global_step*"))
    return found + [name for name in RUN_FILES if (out_dir / name).exists()]


def _problem(out_dir: Path, resume: bool, overwrite: bool) -> str | None:
    found = [] if resume or overwrite else previous_run(out_dir)
    if not found:
        return None
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    return (f"--output_dir {out_dir} holds another run ({shown}); continue it with --resume, choose a new "
            "--output_dir, or pass --overwrite to delete that run's checkpoints, metrics and exports and start anew")


@contextmanager
def claim(out_dir: str | os.PathLike, resume: bool, overwrite: bool, holder: bool):
    """Hold the directory's lock for the `with` block (on the `holder` processes) and refuse a used directory for
    a fresh run. A collective: every rank learns the verdict, and every rank raises OutputDirError together."""
    out_dir = Path(out_dir)
    fd, problem, created = None, None, []
    if holder:
        try:
            fd = _acquire(out_dir, created)
            problem = _problem(out_dir, resume, overwrite)
        except OutputDirError as e:
            problem = str(e)
    problems = [p for p in engine.all_gather_objects(problem) if p]
    try:
        if problems:
            raise OutputDirError(problems[0])
        yield
    except BaseException:
        _leave_no_trace(created)
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def _leave_no_trace(created: list[Path]) -> None:
    """A start that failed takes back the lock file and the folders its claim made, when nothing else came into them
    (a pre-flight report or a cache that it wrote stays, and with them their folder)."""
    for path in reversed(created):
        try:
            path.unlink() if path.name == LOCK_FILE else path.rmdir()
        except OSError:  # not empty, or gone
            pass


def is_holder(ds: dict, d: engine.Dist) -> bool:
    """Whether this process holds the lock and writes the run's files: rank 0, and with node-local checkpoint
    storage (DeepSpeed's checkpoint.use_node_local_storage: each node its own disk) every node's local rank 0."""
    node_local = ds.get("checkpoint", {}).get("use_node_local_storage") or ds.get("use_node_local_storage")
    return d.is_main or (bool(node_local) and d.local_rank == 0)


def overwritten(out_dir: str | os.PathLike) -> list[Path]:
    """What --overwrite deletes: the earlier run's files (not the cache or the pre-flight's reports)."""
    out_dir = Path(out_dir)
    return [out_dir / name for name in previous_run(out_dir) + [p.name for p in out_dir.glob("gpu_metrics*.jsonl")]]


def overwritten_bytes(out_dir: str | os.PathLike) -> int:
    """Bytes on disk of the files --overwrite deletes (links not followed), which the deletion frees."""
    total = 0
    for path in overwritten(out_dir):
        total += path.lstat().st_blocks * 512
        if path.is_dir() and not path.is_symlink():
            total += sum(os.lstat(os.path.join(root, name)).st_blocks * 512 for root, dirs, files in os.walk(path)
                         for name in dirs + files)
    return total


def start_writing(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Every check has passed: with --overwrite, delete the earlier run's files (not the cache) before this run
    writes its own."""
    if not overwrite:
        return
    for path in overwritten(out_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
