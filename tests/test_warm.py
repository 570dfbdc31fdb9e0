"""tests/warm.py, which starts the one-process commands of the other tests: each is its own process, as with
subprocess.run, and a fresh interpreter where the environment would reach the libraries as they load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import warm

SCRIPT = """import os, sys
print(sys.argv[1:], os.getcwd(), os.environ.get("QWEN_EDIT_PROBE"), "torch" in sys.modules, sys.path[0])
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["raise"]:
    raise RuntimeError("the command's own error")
if sys.argv[1:] == ["hang"]:
    import time
    time.sleep(600)
os._exit(3)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "bin" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_warm_command_is_its_own_process(script, tmp_path):
    """argv, working directory, environment, both streams and the exit code are the command's; the trainer's
    libraries are already loaded; the script's folder leads sys.path as for `python script.py`."""
    env = {**os.environ, "QWEN_EDIT_PROBE": "set"}
    proc = warm.run([str(script), "a", "b"], cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stderr) == (3, "to stderr\n")
    assert proc.stdout == f"['a', 'b'] {tmp_path} set True {script.parent}\n"
    assert "QWEN_EDIT_PROBE" not in os.environ and os.getcwd() != str(tmp_path)  # this process is left alone


def test_an_error_exits_1_with_its_traceback(script, tmp_path):
    proc = warm.run([str(script), "raise"], cwd=tmp_path)
    assert proc.returncode == 1 and "RuntimeError: the command's own error" in proc.stderr, proc.stderr


def test_a_module_runs_as_main(tmp_path):
    proc = warm.run(["-m", "train.export", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stdout + proc.stderr


def test_a_variable_read_while_libraries_load_starts_a_fresh_interpreter(script, tmp_path):
    """OpenMP reads OMP_NUM_THREADS when torch loads: a command with another value cannot be a fork of the server."""
    proc = warm.run([str(script), "x"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3 and proc.stdout == f"['x'] {tmp_path} None False {script.parent}\n"
    preluded = warm.run([str(script), "y"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                        prelude="print('prelude first')")
    assert preluded.stdout.startswith("prelude first\n['y']"), preluded.stdout


def test_a_command_past_its_timeout_is_killed(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as e:
        warm.run([str(script), "hang"], cwd=tmp_path, timeout=3)
    assert e.value.cmd == [sys.executable, str(script), "hang"]
