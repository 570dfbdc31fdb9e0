"""The docs match the code: every command in the README's and the docs pages' code blocks parses with its command's
own argument parser, docs/configuration.md is the page the schema generates, docs/architecture.md lists every module,
and the product speaks of itself (no development history outside docs/results/)."""

from __future__ import annotations

import argparse
import importlib
import io
import re
import shlex
from contextlib import nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))  # docs/results/ (dated history) is not among them
MAX_PAGE_LINES = 250

# Fenced code blocks, and the lines in them that start one of the project's commands (after NAME=value settings).
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"""^(?:\w+=(?:"[^"]*"|'[^']*'|\S+)\s+)*(?:python3?|deepspeed|bash\s+launch\.sh)\s""")
LAUNCH_SUBCOMMANDS = {"demo": "train.demo"}  # `bash launch.sh test [pytest args]` hands its arguments to pytest


def commands_in(markdown: str) -> list[list[str]]:
    """The argv of every project command in `markdown`'s fenced code blocks: continuation lines joined, comments and
    leading NAME=value settings dropped."""
    found = []
    for block in FENCE.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            if COMMAND.match(line.strip()):
                argv = shlex.split(line, comments=True)
                found.append(argv[next(i for i, a in enumerate(argv) if not re.match(r"\w+=", a)) :])
    return found


def _script_module(script: str) -> str | None:
    """train/main.py -> train.main; None for anything else."""
    match = re.fullmatch(r"train/(\w+)\.py", script)
    return f"train.{match.group(1)}" if match and (REPO / script).is_file() else None


def _without_placeholders(args: list[str]) -> list[str]:
    """The arguments with a prose `...` left out where it stands for more arguments (not where it is a flag's value,
    as in `--model ...`)."""
    return [a for i, a in enumerate(args) if a != "..." or (i and args[i - 1].startswith("-"))]


class _Parsed(Exception):
    """Raised right after a command's parser accepted its arguments, so that nothing of the command runs."""


def _parse_with_command(module_name: str, args: list[str]) -> str | None:
    """Run `module_name`'s main on `args` until its argument parser has parsed them; the parser's error, or None."""
    module = importlib.import_module(module_name)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        redirect_stderr(err),
        redirect_stdout(io.StringIO()),
    ):
        # prefix_rank_output would change this process's streams and the libraries' progress bars
        quiet = hasattr(module, "prefix_rank_output")
        with mock.patch.object(module, "prefix_rank_output", lambda: None) if quiet else nullcontext():
            try:
                module.main(_without_placeholders(args))
            except _Parsed:
                return None
            except SystemExit as e:
                return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return f"{module_name}.main returned without parsing its arguments"


def _launcher(args: list[str]) -> str | None:
    """The deepspeed launcher's own options, then the script and its arguments."""
    from deepspeed.launcher.runner import parse_args as launcher_args

    err = io.StringIO()
    try:
        with redirect_stderr(err):
            parsed = launcher_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    module = _script_module(parsed.user_script)
    if module is None:
        return f"{parsed.user_script} is not a command of this project"
    return _parse_with_command(module, parsed.user_args)


def refusal(argv: list[str]) -> str | None:
    """Why the project's command `argv` would be refused by its own argument parser, or None when it parses."""
    program, *args = argv
    if program in ("python", "python3"):
        if args[:1] == ["-m"] and args[1].startswith("train."):
            return _parse_with_command(args[1], args[2:])
        module = _script_module(args[0]) if args else None
        return _parse_with_command(module, args[1:]) if module else None  # python -m pytest etc.: not ours
    if program == "deepspeed":
        return _launcher(args)
    assert program == "bash" and args[0] == "launch.sh", argv
    sub, rest = (args[1], args[2:]) if len(args) > 1 else ("--help", [])
    if sub in LAUNCH_SUBCOMMANDS:
        return _parse_with_command(LAUNCH_SUBCOMMANDS[sub], rest)
    if sub in ("test", "-h", "--help"):
        return None
    return _launcher(args[1:])


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(path.name, argv) for path in [README, *PAGES] for argv in commands_in(path.read_text())]


def test_every_documented_command_parses():
    """The README's and every docs page's commands pass their command's argument parser (no flag it lacks, no
    missing required one, a value of the right type); nothing of them runs."""
    commands = documented_commands()
    problems = [f"{page}: {shlex.join(argv)}\n    {why}" for page, argv in commands if (why := refusal(argv))]
    assert not problems, "\n".join(problems)
    readme = [argv for page, argv in commands if page == "README.md"]
    assert ["bash", "launch.sh", "demo"] in readme and ["bash", "launch.sh", "test"] in readme
    assert any("train/main.py" in argv for argv in readme)


def test_a_command_with_a_flag_it_does_not_have_is_refused():
    planted = """
```bash
deepspeed --num_gpus 2 train/main.py --ds_config c.json \\
    --modle m   # a typo
```
"""
    assert commands_in(planted) == [
        ["deepspeed", "--num_gpus", "2", "train/main.py", "--ds_config", "c.json", "--modle", "m"]
    ]
    assert "unrecognized arguments: --modle m" in refusal(commands_in(planted)[0])
    assert "unrecognized arguments: --steps" in refusal(["bash", "launch.sh", "demo", "--steps", "3"])
    assert "the following arguments are required: --out" in refusal(["python", "-m", "train.make_tiny"])
    assert refusal(["python", "-m", "train.bench", "--block_probe", "--compile"])  # the probe has no --compile
    assert refusal(["bash", "launch.sh", "--gpus", "2", "train/main.py", "--ds_config", "c.json"])
    assert refusal(["deepspeed", "train/nope.py"]) == "train/nope.py is not a command of this project"
    assert refusal(["python", "-m", "train.export", "--checkpoint", "c", "--out", "o", "--dtype", "float64"])
    assert refusal(["bash", "launch.sh", "demo", "--variant", "t2i"]) is None


def test_the_configuration_page_is_the_generated_one():
    """docs/configuration.md is what train/config/reference.py makes of the schema's field docstrings."""
    from train.config import field_docs
    from train.config.reference import REGENERATE, reference_markdown

    assert all(field_docs().values()), [key for key, doc in field_docs().items() if not doc]
    assert (REPO / "docs" / "configuration.md").read_text() == reference_markdown(), f"regenerate it: {REGENERATE}"


def test_the_architecture_page_lists_every_module():
    page = (REPO / "docs" / "architecture.md").read_text()
    modules = [
        p.relative_to(REPO).as_posix()
        for top in ("train", "model_parallel")
        for p in sorted((REPO / top).rglob("*.py"))
        if p.name != "__init__.py"
    ]
    missing = [m for m in modules if m not in page]
    assert len(modules) > 50 and not missing, f"docs/architecture.md lacks {missing}"


def test_pages_are_short_and_the_readme_links_every_one():
    readme = README.read_text()
    long = [f"{p.name}: {n}" for p in [README, *PAGES] if (n := len(p.read_text().splitlines())) > MAX_PAGE_LINES]
    unlinked = [p.name for p in PAGES if f"(docs/{p.name})" not in readme]
    assert not long and not unlinked, (long, unlinked)


# Development history: what the product must not carry outside docs/results/ (dated, append-only measurements).
HISTORY = (
    ("a development session", re.compile(r"session[ _-]?\d", re.I)),
    ("an internal issue", re.compile(r"\bissues?[ _-]?#?\d+", re.I)),
    ("an internal issue", re.compile(r"(?<![\w/.-])#\d{1,5}\b")),  # owner/repo#N (upstream) is preceded by a name
    ("a commit hash", re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")),
    ("a date", re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")),
)
RESULTS_LINK = re.compile(r"results/[\w.-]+\.md")  # a results file's name carries its date
CHECKED = ("train", "model_parallel", "tests", "docs", "ds_configs", "README.md", "launch.sh")
SUFFIXES = (".py", ".md", ".json", ".sh", ".txt", ".toml", ".cfg")


def history_in(text: str) -> list[str]:
    """'what: match' for each piece of development history in `text`."""
    text = RESULTS_LINK.sub("results/FILE.md", text)
    return [f"{what}: {m.group(0)!r}" for what, pattern in HISTORY for m in pattern.finditer(text)]


def checked_files() -> list[Path]:
    files = [REPO / name for name in CHECKED if (REPO / name).is_file()]
    return files + [
        p
        for name in CHECKED
        if (REPO / name).is_dir()
        for p in sorted((REPO / name).rglob("*"))
        if p.is_file()
        and p.suffix in SUFFIXES
        and "__pycache__" not in p.parts
        and not p.is_relative_to(REPO / "docs" / "results")
    ]


def history_in_tree() -> list[str]:
    files = checked_files()
    return [
        f"{path.relative_to(REPO)}:{n}: {found}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for found in history_in(line)
    ]


def test_history_is_found_where_it_is_planted():
    """Each kind is found in a planted line (written in pieces, so that this file itself stays clean), and what
    is not history (upstream references, colours, numbers, words, a results file's name) is not."""

    def kinds(text: str) -> list[str]:
        return [found.split(":")[0] for found in history_in(text)]

    assert kinds("measured in " + "sess" + "ion 3 on the GPU") == ["a development session"]
    assert kinds("see " + "is" + "sue 15 and #" + "16") == ["an internal issue", "an internal issue"]
    assert kinds("since commit 48204" + "b7, on 2026" + "-12-04") == ["a commit hash", "a date"]
    upstream = (
        "pytorch/pytorch#189290, https://github.com/deepspeedai/DeepSpeed/issues/5758, colour #000000, "
        "1048576 pixels, a decade, [memory](results/memory_h200_2026" + "-12-04.md)"
    )
    assert history_in(upstream) == []


def test_the_product_speaks_of_itself():
    """No development session, internal issue, commit hash or date in the code, tests, configs or docs (outside
    docs/results/)."""
    found = history_in_tree()
    assert not found, f"{len(found)} pieces of development history:\n" + "\n".join(found)


def test_launch_sh_has_the_readme_subcommands_and_ci_runs_its_test():
    launch = (REPO / "launch.sh").read_text()
    assert "\n  demo)" in launch and "\n  test)" in launch
    assert "bash launch.sh test" in (REPO / ".ci" / "run").read_text()


def test_launch_sh_help_prints_usage_not_script_lines():
    import subprocess

    out = subprocess.run(["bash", str(REPO / "launch.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("Usage:\n  bash launch.sh demo")
    assert not any(line.startswith("#") for line in out.stdout.splitlines()) and "set -euo" not in out.stdout


def test_cpu_setup_note_runs_only_without_a_gpu_driver(tmp_path):
    """launch.sh's cpu_torch_note (run as in setup) points at the README's "Set-up without a GPU", which exists; with
    nvidia-smi on PATH, or a pin of one's own, it says nothing."""
    import subprocess

    launch = (REPO / "launch.sh").read_text()
    func = re.search(r"^cpu_torch_note\(\) \{\n.*?^\}\n", launch, re.S | re.M).group(0)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "nvidia-smi").write_text("#!/bin/sh\n")
    (tmp_path / "gpu" / "nvidia-smi").chmod(0o755)

    def note(path: str, pin: str = "") -> str:
        env = {"PATH": path, **({"QWEN_EDIT_TORCH": pin} if pin else {})}
        return subprocess.run(
            ["/bin/bash", "-c", f"set -euo pipefail\n{func}cpu_torch_note"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stderr

    assert 'see README "Set-up without a GPU"' in note("/nonexistent")
    assert note(str(tmp_path / "gpu")) == "" and note("/nonexistent", pin="torch==2.14.1+cpu") == ""
    assert re.search(r"^#+ Set-up without a GPU$", README.read_text(), re.M)


def test_launch_sh_refuses_a_mistyped_subcommand():
    """`bash launch.sh tset` (or a script that does not exist) stops at once with exit 2 and a line pointing at
    --help, before any set-up, instead of reaching deepspeed as a script to run."""
    import subprocess

    for word in ("tset", "train/mian.py"):
        out = subprocess.run(
            ["bash", str(REPO / "launch.sh"), word, "--max_steps", "1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2 and out.stdout == ""
        assert (
            out.stderr == f"launch.sh: '{word}' is neither a subcommand (demo, test) nor a script file; "
            "see bash launch.sh --help\n"
        )


def test_launch_sh_keeps_the_launchers_info_lines_out_and_refuses_a_missing_hostfile(tmp_path):
    """launch.sh hands the deepspeed launcher `--log_level error` (its command, world info and CUDA_VISIBLE_DEVICES
    lines stay out; its errors show) unless the user picks a level; a --hostfile that is not a file, with which the
    launcher would train on this node alone after a warning, stops it at once (exit 2)."""
    import hashlib
    import subprocess

    venv = tmp_path / "venv"  # an environment launch.sh takes as set up, whose deepspeed prints what it was given
    (venv / "bin").mkdir(parents=True)
    stamp = hashlib.sha256((REPO / "setup.cfg").read_bytes() + (REPO / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".qwen-edit-installed").write_text(stamp[:16] + "\n")
    for name, body in {"python": 'exec python3 "$@"', "deepspeed": 'echo "$@"'}.items():
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "QWEN_EDIT_VENV": str(venv), "HOME": str(tmp_path)}

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "launch.sh"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )

    assert (
        launch("--num_gpus", "2", "train/main.py", "--max_steps", "1").stdout
        == "--log_level error --num_gpus 2 train/main.py --max_steps 1\n"
    )
    assert launch("--log_level", "info", "train/main.py").stdout == "--log_level info train/main.py\n"
    out = launch("--hostfile", str(tmp_path / "hosts"), "train/main.py")
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr == f"launch.sh: --hostfile {tmp_path / 'hosts'} is not a file; write one line per node "
        "('node-a slots=8')\n"
    )
