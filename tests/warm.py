"""Python commands started warm: `python train/main.py ...` (or `-m train.export ...`) as a child of a server that
imported the trainer's modules once, instead of a fresh interpreter that spends seconds importing torch,
diffusers, transformers and DeepSpeed before its first line.

The server is multiprocessing's forkserver with the trainer preloaded (`set_forkserver_preload`): each command is a
fork of it, so every run still has its own process (its own exit code through the trainer's `os._exit`, its own
environment, working directory, argv, stdout and stderr, its own torch and DeepSpeed state), and the command's
code runs as `__main__` by runpy as the interpreter would. What the fork cannot give is an environment that the
libraries read while they load (OpenMP's thread count, huggingface_hub's offline switch): the server loaded them
under the test session's environment. So a command goes warm only when its environment differs from the server's
in variables read at run time (RUN_TIME_VARIABLES); any other difference starts a fresh interpreter. The commands
launched by DeepSpeed (several ranks) are real processes; this serves the one-process runs.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

PRELOAD = ["train.main"]  # what the server imports once: the trainer, with torch, diffusers and transformers
# Names (prefixes) of the variables that no library reads while it loads, so a command may differ from the server
# in them: the trainer's test hooks, output buffering, pytest's marker, the terminal's size, and what torch sets in
# the test process itself once it compiles or asks for CUDA (read at each use; inductor sets its pointer again
# before it loads a compiled module).
RUN_TIME_VARIABLES = ("QWEN_EDIT_", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES",
                      "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
                      "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
SESSION_ENV = dict(os.environ)  # the server starts with the session's environment as it began (conftest imports this)
_server = None


def _warm_server(env: dict[str, str]):
    """The forkserver's context, or None where `env` differs from the server's environment in a variable that a
    library may read while it loads."""
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload(PRELOAD)
        with mock.patch.dict(os.environ, SESSION_ENV, clear=True):  # not what a test has set by then
            multiprocessing.forkserver.ensure_running()
    changed = {name for name in env.keys() | SESSION_ENV.keys() if env.get(name) != SESSION_ENV.get(name)}
    return _server if all(name.startswith(RUN_TIME_VARIABLES) for name in changed) else None


def _stream(fd: int, write_through: bool) -> io.TextIOWrapper:
    """A text stream on `fd` as the interpreter makes one for a file: stderr line-buffered, stdout block-buffered
    unless PYTHONUNBUFFERED is set."""
    binary = open(fd, "wb", buffering=0 if write_through else -1, closefd=False)
    return io.TextIOWrapper(binary, encoding="utf-8",
                            errors="backslashreplace" if fd == 2 else "strict", line_buffering=fd == 2,
                            write_through=write_through)


def _command(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, prelude: str) -> None:
    """The forked child: becomes `python *argv` in `cwd` with `env`, writing into the files `out` and `err`."""
    multiprocessing.set_start_method("fork", force=True)  # the child's own workers fork, as a plain python's do
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    write_through = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout, sys.stderr = _stream(1, write_through), _stream(2, write_through)
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), {"__name__": "__prelude__"})
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, cwd)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")  # a command that returns: multiprocessing flushes both streams


def run(argv: list[str], cwd: Path | str, env: dict[str, str] | None = None, timeout: float = 900,
        prelude: str = "") -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`
    for a command of this repository, started warm; `prelude`: Python code the process runs first (a fake or a
    switched-off check). A command that returns instead of exiting leaves with 0, one that raises with 1 (its
    traceback on stderr), as the interpreter would."""
    env = dict(os.environ if env is None else env)
    server = _warm_server(env)
    if server is None:
        return subprocess.run(_cold_command(argv, prelude), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="warm") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        child = server.Process(target=_command, args=(list(argv), env, str(cwd), out, err, prelude))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, _read(out), _read(err))
        return subprocess.CompletedProcess([sys.executable, *argv], child.exitcode, _read(out), _read(err))


def _cold_command(argv: list[str], prelude: str) -> list[str]:
    """The command for a fresh interpreter: `python *argv`, or with a prelude `python -c START *argv` where START
    runs the prelude, then the script as __main__."""
    if not prelude:
        return [sys.executable, *argv]
    assert argv[0] != "-m", "a prelude runs before a script, not a module"
    start = f"{prelude}\nimport runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')"
    return [sys.executable, "-c", start, *argv]


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="backslashreplace") if os.path.exists(path) else ""
