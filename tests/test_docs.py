"""The README matches the code: every config key is documented, and the commands it gives exist."""

from __future__ import annotations

from pathlib import Path

from train.config import field_docs

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_every_config_key_is_in_the_readme_table():
    """Each qwen_edit field appears in the configuration table as `section.name`."""
    missing = [key for key in field_docs() if f"| `{key}` |" not in README]
    assert not missing, f"README configuration table lacks {missing}"


def test_readme_commands_match_launch_sh_and_ci():
    """The two README commands are launch.sh subcommands, and CI runs the test one."""
    launch = (REPO / "launch.sh").read_text()
    assert "bash launch.sh demo" in README and "bash launch.sh test" in README
    assert "\n  demo)" in launch and "\n  test)" in launch
    assert "bash launch.sh test" in (REPO / ".ci" / "run").read_text()


def test_readme_explains_extending_a_run():
    """The resume note (checkpoint.schedule_note) points at this README paragraph."""
    assert "- Extending a run: `--resume --max_steps N`" in README and "re-stretched" in README


def test_launch_sh_help_prints_usage_not_script_lines():
    import subprocess

    out = subprocess.run(["bash", str(REPO / "launch.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("Usage:\n  bash launch.sh demo")
    assert not any(line.startswith("#") for line in out.stdout.splitlines()) and "set -euo" not in out.stdout


def test_readme_tells_a_newcomer_the_basics():
    """A newcomer's first hour: how the commands find Python, make_tiny's required --out, how relative paths in
    the JSON resolve, --master_port, F2P in words, and why no CPU torch build is installed by default."""
    assert "source .venv/bin/activate" in README and "python -m train.make_tiny --out DIR" in README
    assert "relative to the directory you start the command" in README and "--master_port" in README
    assert 'F2P, "face to photo"' in README and "download.pytorch.org/whl/cpu" in README


def test_cpu_setup_note_runs_only_without_a_gpu_driver(tmp_path):
    """launch.sh's cpu_torch_note (run as in setup) names README's "Set-up without a GPU", which exists and says
    why no CPU build is installed; with nvidia-smi on PATH, or a pin of one's own, it says nothing."""
    import re
    import subprocess

    launch = (REPO / "launch.sh").read_text()
    func = re.search(r"^cpu_torch_note\(\) \{\n.*?^\}\n", launch, re.S | re.M).group(0)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "nvidia-smi").write_text("#!/bin/sh\n")
    (tmp_path / "gpu" / "nvidia-smi").chmod(0o755)

    def note(path: str, pin: str = "") -> str:
        env = {"PATH": path, **({"QWEN_EDIT_TORCH": pin} if pin else {})}
        return subprocess.run(["/bin/bash", "-c", f"set -euo pipefail\n{func}cpu_torch_note"], env=env,
                              capture_output=True, text=True, timeout=30, check=True).stderr

    assert 'see README "Set-up without a GPU"' in note("/nonexistent")
    assert note(str(tmp_path / "gpu")) == "" and note("/nonexistent", pin="torch==2.14.1+cpu") == ""
    words = " ".join(README.split())
    assert "### Set-up without a GPU" in README and "operator torchvision::nms does not exist" in words


def test_readme_quotes_make_tiny_with_its_own_choices(capsys):
    """README's make_tiny line lists the variants make_tiny accepts, and --out is what it requires."""
    import pytest

    from train import make_tiny
    from train.model.qwen_image.tiny import VARIANTS

    assert f"python -m train.make_tiny --out DIR [--variant {'|'.join(VARIANTS)}]" in README
    with pytest.raises(SystemExit):
        make_tiny.main([])
    assert capsys.readouterr().err.strip().endswith("the following arguments are required: --out")


def test_launch_sh_refuses_a_mistyped_subcommand():
    """`bash launch.sh tset` (or a script that does not exist) stops at once with exit 2 and a line pointing at
    --help, before any set-up, instead of reaching deepspeed as a script to run."""
    import subprocess

    for word in ("tset", "train/mian.py"):
        out = subprocess.run(["bash", str(REPO / "launch.sh"), word, "--max_steps", "1"], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == f"launch.sh: '{word}' is neither a subcommand (demo, test) nor a script file; " \
                             "see bash launch.sh --help\n"
