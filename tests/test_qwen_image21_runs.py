"""Qwen-Image-2.1 through the real entry point, train/main.py, on the tiny 2.1 checkpoint and dataset (rows of 0, 1
and 2 references, RGBA ones): LoRA on the family's default targets, ZeRO-2 over 2 CPU processes from the latent cache
equal to 1 process with accumulation encoding online, an exact resume, and a full fine-tune's export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metrics, run_trainer, write_config
from safetensors.torch import load_file

from train.model import family

pytestmark = pytest.mark.slow
LORA_FILE = "pytorch_lora_weights.safetensors"
STEPS = ("--max_steps", "3")


def check(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )


def config(path: Path, **changes) -> Path:
    """tiny_cpu.json for 2.1: the family's LoRA targets (null), a record and a checkpoint every step or two."""
    common = {
        "qwen_edit.lora.target_modules": None,
        "qwen_edit.output.log_every_steps": 1,
        "qwen_edit.output.save_every_steps": 2,
    }
    return write_config(path, **common, **changes)


@pytest.fixture(scope="module")
def accumulated(tiny_21_edits, tmp_path_factory) -> tuple[Path, Path]:
    """3 steps of 1 process x 2 accumulated micro-batches, encoded online, a checkpoint at step 2: (output, config)."""
    tmp = tmp_path_factory.mktemp("accumulated_21")
    cfg = config(tmp / "cfg.json", gradient_accumulation_steps=2)
    check(run_trainer(tiny_21_edits, tmp / "run", config=cfg, extra=STEPS))
    return tmp / "run", cfg


def test_lora_trains_the_family_s_targets(accumulated):
    out, _ = accumulated
    resolved = json.loads((out / "config.json").read_text())["qwen_edit"]
    assert resolved["lora"]["target_modules"] == list(family.family_named("qwen_image21").lora.targets)
    lora = load_file(out / "export" / LORA_FILE)
    assert {k.split(".lora_")[0].split(".", 3)[-1] for k in lora} == set(resolved["lora"]["target_modules"])
    assert len(metrics(out)) == 3 and all(r["loss"] > 0 for r in metrics(out))


def test_two_ranks_from_the_cache_equal_one_rank_accumulating_online(tiny_21_edits, tmp_path, accumulated):
    """ZeRO-2 on 2 processes x micro-batch 1, trained from the latent cache (data.cache "auto" builds it), sees the
    samples and noise of 1 process x 2 accumulated micro-batches encoded online: the same losses and LoRA (fp32,
    summation order only). Either half broken (a rank's share, the cached conditioning) moves both."""
    out, _ = accumulated
    cfg = config(tmp_path / "cfg.json", **{"qwen_edit.data.cache": "auto"})
    proc = run_trainer(tiny_21_edits, tmp_path / "run", config=cfg, num_procs=2, extra=STEPS)
    check(proc)
    assert "the VL encoder and VAE are not loaded" in proc.stdout
    assert [r["loss"] for r in metrics(tmp_path / "run")] == pytest.approx([r["loss"] for r in metrics(out)], 1e-5)
    a, b = load_file(out / "export" / LORA_FILE), load_file(tmp_path / "run" / "export" / LORA_FILE)
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 1e-3, "LoRA B never moved: a vacuous comparison"
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_a_resumed_run_continues_exactly(tiny_21_edits, tmp_path, accumulated):
    """Resumed from global_step2, step 3 gives the uninterrupted run's loss and final LoRA, bit for bit."""
    import shutil

    out, cfg = accumulated
    resumed = tmp_path / "run"
    shutil.copytree(out, resumed)
    check(run_trainer(tiny_21_edits, resumed, config=cfg, extra=(*STEPS, "--resume", "global_step2")))
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3]
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(out)]
    a, b = load_file(out / "export" / LORA_FILE), load_file(resumed / "export" / LORA_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_fine_tune_exports_a_transformer_diffusers_loads(tiny_21_edits, tmp_path):
    """train.mode full, with checkpointed blocks: every weight that reaches the target's prediction trains, and the
    export is a QwenImage21Transformer2DModel directory."""
    from diffusers import QwenImage21Transformer2DModel

    cfg = config(
        tmp_path / "cfg.json",
        **{"qwen_edit.train.mode": "full", "qwen_edit.train.gradient_checkpointing": True, "optimizer.params.lr": 1e-3},
    )
    # 4 steps: a 2-step run (shorter than tiny_cpu.json's 5 warm-up steps) left every weight where it was
    check(run_trainer(tiny_21_edits, tmp_path / "run", config=cfg, extra=("--max_steps", "4")))
    trained = QwenImage21Transformer2DModel.from_pretrained(tmp_path / "run" / "export" / "transformer")
    base = dict(
        QwenImage21Transformer2DModel.from_pretrained(
            tiny_21_edits / "model", subfolder="transformer"
        ).named_parameters()
    )
    unchanged = [n for n, p in trained.named_parameters() if torch.equal(p, base[n])]
    assert unchanged == [], unchanged
