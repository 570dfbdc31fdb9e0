"""Shared fixtures: tiny checkpoints built once per session, and a runner for the real entry points."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import warm

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "ds_configs" / "tiny_cpu.json"


@pytest.fixture(scope="session")
def tiny_edit(tmp_path_factory) -> Path:
    """Tiny Qwen-Image-Edit (v1) checkpoint + synthetic dataset: DIR/model, DIR/data."""
    from train.model.qwen_image.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_edit"), "edit", num_samples=32)


@pytest.fixture(scope="session")
def tiny_plus(tmp_path_factory) -> Path:
    """Tiny Qwen-Image-Edit-2509 checkpoint; its dataset has two references per row."""
    from train.model.qwen_image.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_plus"), "edit_plus", num_samples=16)


@pytest.fixture(scope="session")
def tiny_2511(tmp_path_factory) -> Path:
    """Tiny Qwen-Image-Edit-2511: the 2509 checkpoint (same seed, so the same weights) with zero_cond_t set."""
    from train.model.qwen_image.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_2511"), "edit_plus_2511", num_samples=16)


@pytest.fixture(scope="session")
def tiny_t2i(tmp_path_factory) -> Path:
    """Tiny Qwen-Image (text-to-image, QwenImagePipeline, no processor/); its rows have no edit_image."""
    from train.model.qwen_image.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_t2i"), "t2i", num_samples=16)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real tmpfs of `size` (e.g. "16m") mounted at `path` for the `with` block (root only; the test is skipped
    where mounting is not permitted), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and a mount permission")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="session")
def tiny_21_edits(tmp_path_factory) -> Path:
    """Tiny Qwen-Image-2.1 checkpoint + its synthetic dataset (rows of 0, 1 and 2 references, RGBA ones among them):
    DIR/model, DIR/data."""
    from train.model.qwen_image21.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_21"), num_samples=16)


@pytest.fixture(scope="session")
def tiny_21(tiny_21_edits) -> Path:
    """The tiny Qwen-Image-2.1 checkpoint alone (QwenImage21Pipeline layout): DIR is the model directory."""
    return tiny_21_edits / "model"


@pytest.fixture(scope="session")
def tiny_21_recolour(tiny_21, tmp_path_factory) -> Path:
    """DIR/model (the tiny 2.1 checkpoint) and DIR/data: 16 recolour edits of one RGB reference at 128 x 128 px,
    the rows the demo trains 2.1 on (the MMDiT tiny dataset's: the dataset format is every family's)."""
    from train.model.qwen_image.tiny import make_dataset

    out = tmp_path_factory.mktemp("tiny_21_recolour")
    (out / "model").symlink_to(tiny_21)
    make_dataset(out / "data", "edit", 16, 128)
    return out


@pytest.fixture(scope="session")
def online_run(tiny_edit, tmp_path_factory) -> Path:
    """One process on one CPU thread, ZeRO-2, 6 steps of the tiny config logged every step, the encoders online: the
    reference of the model-parallel runs and of training from the cache (whose module runs on one thread)."""
    from unittest import mock

    out = tmp_path_factory.mktemp("online_run")
    cfg = write_config(out.parent / f"{out.name}.json", **{"qwen_edit.output.log_every_steps": 1})
    with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):
        proc = run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "6"))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out


REFERENCE_STEPS = 12


@pytest.fixture(scope="session")
def fault_config(tmp_path_factory) -> Path:
    """Tiny config that saves every 4 steps (the last 2 checkpoints kept) and logs every step."""
    path = tmp_path_factory.mktemp("fault_cfg") / "faults.json"
    return write_config(path, **{"qwen_edit.output.save_every_steps": 4, "qwen_edit.output.log_every_steps": 1,
                                 "qwen_edit.output.keep_last": 2})


@pytest.fixture(scope="session")
def reference_run(tiny_edit, fault_config, tmp_path_factory) -> Path:
    """ZeRO-2 on 2 processes through the launcher, REFERENCE_STEPS steps of fault_config uninterrupted: the reference
    of the fault tests' resumed runs and of training on 1 process with gradient accumulation (tests that change its
    directory work on a copy)."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_trainer(tiny_edit, out, config=fault_config, num_procs=2, extra=("--max_steps", str(REFERENCE_STEPS)))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert [r["step"] for r in metrics(out)] == list(range(1, REFERENCE_STEPS + 1))
    return out


@pytest.fixture(scope="session")
def validated_zero2(tiny_edit, tmp_path_factory) -> dict[str, Path]:
    """ZeRO-2 on 2 processes, 4 steps, once plain and once validating 3 edits every 2 steps
    (test_validation.validated_runs; "edits": their file): the validation checks' runs and the reference of the
    model-parallel pipelines' training and grids."""
    from test_validation import edits_file, validated_runs

    tmp = tmp_path_factory.mktemp("validated_zero2")
    edits = edits_file(tiny_edit, tmp / "validation.jsonl")
    return {**validated_runs(tiny_edit, tmp, edits), "edits": edits}


@pytest.fixture(scope="session")
def released_model(tmp_path_factory) -> Path:
    """A Qwen-Image-Edit-2509 model directory with the released architectures' configs and no weights (the
    transformer counts on the meta device)."""
    from train.model.qwen_image.tiny import make_tiny, write_full_size_configs

    out = make_tiny(tmp_path_factory.mktemp("released"), "edit_plus", num_samples=2, size=64)
    write_full_size_configs(out / "model")
    return out / "model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformer_inputs(model, h: int = 8, w: int = 8, text_tokens: int = 16, generator=None) -> dict:
    """Keyword arguments for one forward of a (tiny) QwenImageTransformer2DModel: a target and one reference of h x w
    latent patches, `text_tokens` prompt embeddings, no text mask, timestep 0.5 (with zero_cond_t the reference
    tokens are modulated at 0)."""
    import torch

    hidden = torch.randn(1, 2 * h * w, model.config.in_channels, generator=generator)
    text = torch.randn(1, text_tokens, model.config.joint_attention_dim, generator=generator)
    return dict(hidden_states=hidden, timestep=torch.tensor([0.5]), encoder_hidden_states=text,
                encoder_hidden_states_mask=None, img_shapes=[[(1, h, w), (1, h, w)]], return_dict=False)


def write_config(path: Path, base: Path = TINY_CONFIG, **changes) -> Path:
    """Copy a config with dotted-key changes, e.g. {"qwen_edit.train.mode": "full"}."""
    cfg = json.loads(base.read_text())
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path.write_text(json.dumps(cfg, indent=2))
    return path


def launcher_command(num_procs: int, port: int | None = None) -> list[str]:
    """What `deepspeed --num_gpus N` runs on one node: DeepSpeed's launch.py over N local ranks, its world encoded as
    the runner encodes it. The runner itself only parses its flags and starts this, after seconds of importing torch
    and before as many of tearing it down, on every launch; the tests of the runner's own part (launch.sh, signals to
    it, hostfiles, the scaling harness) start it."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_procs))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={port or free_port()}", "--log_level=info"]


def trainer_args(tiny: Path, out: Path, config: Path = TINY_CONFIG, extra: tuple[str, ...] = ()) -> list[str]:
    """train/main.py's arguments for the tiny checkpoint `tiny` (its model/ and data/), writing into `out`."""
    return ["--ds_config", str(config), "--model", str(tiny / "model"), "--data", str(tiny / "data"),
            "--output_dir", str(out), *extra]


def run_trainer(tiny: Path, out: Path, config: Path = TINY_CONFIG, num_procs: int | None = None,
                extra: tuple[str, ...] = (), timeout: int = 900, port: int | None = None,
                prelude: str = "") -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train/main.py ...` (num_procs given; launcher_command) or plain `python train/main.py
    ...` (started warm: tests/warm.py); `prelude`: Python code the plain process runs first (a fake or a
    switched-off check)."""
    args = trainer_args(tiny, out, config, extra)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if num_procs is None:
        return warm.run([str(REPO / "train" / "main.py"), *args], cwd=REPO, env=env, timeout=timeout, prelude=prelude)
    cmd = [*launcher_command(num_procs, port), str(REPO / "train" / "main.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def main_in_process(command, argv: list[str]) -> tuple[int, str, str]:
    """`command.main(argv)` (a module of train/: main, infer, ...) in this process: (exit code, stdout, stderr). The
    command's own code path without the seconds of a fresh Python's imports, for a start it refuses or a run of
    little work. What a world of one sets up is put back afterwards: the environment (RANK, MASTER_PORT, ...) and
    torch's thread count (engine.prepare_environment's); the command tears its process group down itself."""
    import io
    from contextlib import redirect_stderr, redirect_stdout
    from unittest import mock

    import torch

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ), redirect_stdout(out), redirect_stderr(err):
            code = command.main(argv)
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def start_refused(tiny: Path, out: Path, config: Path = TINY_CONFIG, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """train/main.py in this process (main_in_process), for a start that it refuses before anything trains (a bad
    config, resume point or output directory): (its exit code, its stderr)."""
    from train import main

    code, _, err = main_in_process(main, trainer_args(tiny, out, config, extra))
    return code, err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class FakeCudaCounter:
    """torch.cuda's allocation counters for one device, driven by the test: `allocate(n)` / `free(n)`, and `flush()`
    for the caching allocator meeting its cap. Reserved memory is a caching allocator's: it keeps what it took (the
    most allocated since the last flush) until a flush gives the unused part back."""

    def __init__(self):
        self.allocated = self.peak = self.reserved = self.reserved_peak = 0
        self.retries = 0  # cache flushes: torch.cuda.memory_stats()["num_alloc_retries"]

    def flush(self) -> None:
        """The allocator found no room under its cap: it gives its cached blocks back and retries."""
        self.retries += 1
        self.reserved = self.allocated

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch) -> None:
        import torch

        def reset(device=None):
            self.peak, self.reserved_peak = self.allocated, self.reserved

        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved_peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": self.retries})



def patch_family(monkeypatch, **changes) -> None:
    """Replace fields of the registered Qwen-Image family's record for one test (the record is frozen; the generic
    code finds it in train.model.family.FAMILIES), e.g. patch_family(monkeypatch, load_encoders=stub)."""
    import dataclasses

    from train.model import family

    monkeypatch.setattr(family, "FAMILIES", tuple(dataclasses.replace(f, **changes) if f.name == "qwen_image" else f
                                                  for f in family.FAMILIES))
