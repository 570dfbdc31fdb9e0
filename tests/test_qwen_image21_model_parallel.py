"""Qwen-Image-2.1 in the model-parallel mode (encoder process + decoder process over gloo, as
ds_configs/model_parallel.json places them on two GPUs): it trains like one process, its validation images are
rendered on the decoder from the conditioning the encoder recorded and equal the pipeline's own, and a decoder cut
is refused at start-up with the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_trainer, write_config
from diffusers import QwenImage21Pipeline
from PIL import Image
from test_model_parallel import assert_same_training, check, mp_config
from test_validation import TINY_INFERENCE

from train import config
from train.model import family, support
from train.runtime import engine

STEPS = 4
FAMILY_TARGETS = {"qwen_edit.lora.target_modules": None, "qwen_edit.output.log_every_steps": 1}


@pytest.mark.slow
def test_two_stages_train_like_one_process_and_render_the_pipelines_images(tiny_21_recolour, tmp_path):
    """The encoder + decoder run's losses, gradient norms and LoRA export are the one-process run's; with
    validation.file the decoder's 'before' image (the base model, conditioning replayed) is the pipeline's render."""
    reference = tmp_path / "reference"
    cfg = write_config(tmp_path / "reference.json", **FAMILY_TARGETS)
    check(run_trainer(tiny_21_recolour, reference, config=cfg, extra=("--max_steps", str(STEPS))))
    edits = tmp_path / "edits.jsonl"
    picture = str(tiny_21_recolour / "data" / "0000_ref.png")
    edits.write_text(json.dumps({"edit_image": picture, "prompt": "blue"}) + "\n")
    validated = {"qwen_edit.validation": {"file": str(edits), "every_steps": 2}, "qwen_edit.inference": TINY_INFERENCE}
    out = tmp_path / "two_stages"
    cfg = mp_config(tmp_path / "mp.json", **FAMILY_TARGETS, **validated)
    check(run_trainer(tiny_21_recolour, out, config=cfg, num_procs=2, extra=("--max_steps", str(STEPS))))
    assert_same_training(out, reference)
    assert sorted(p.name for p in (out / "validation").glob("step_*.png")) == ["step_000002.png", "step_000004.png"]
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_recolour / "model", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    seed = json.loads((out / "config.json").read_text())["qwen_edit"]["train"]["seed"]
    threads = torch.get_num_threads()
    # the decoder process's threads (engine.prepare_environment: the cores shared by the 2 processes): CPU kernels
    # may round differently with another count, and this process's count is whatever earlier tests left it
    torch.set_num_threads(max(1, engine.usable_cores() // 2))
    try:
        wanted = pipe(
            prompt="blue",
            image=[Image.open(tiny_21_recolour / "data" / "0000_ref.png").convert("RGBA")],
            num_inference_steps=TINY_INFERENCE["num_inference_steps"],
            output_resolution=128,
            generator=torch.Generator().manual_seed(seed),
        ).images[0]
    finally:
        torch.set_num_threads(threads)
    before = Image.open(out / "validation" / "before" / "000000.png")
    assert before.mode == "RGBA" and np.array_equal(np.asarray(before), np.asarray(wanted))


def test_a_decoder_cut_is_refused_with_the_fix(tiny_21_recolour, tmp_path):
    """parallel.decoder_cuts with a 2.1 model: the support check names the setting and its fix before anything
    loads (the 2.1 transformer has no cut yet)."""
    cfg = mp_config(tmp_path / "cut.json", stages=3, cuts=[1], **FAMILY_TARGETS)
    args = config.parse_args(
        [
            "--ds_config",
            str(cfg),
            "--model",
            str(tiny_21_recolour / "model"),
            "--data",
            str(tiny_21_recolour / "data"),
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    project = config.load_config(args, world_size=3, has_gpu=False).project
    fam, _ = family.detect(project.model.path, project.model.variant)
    assert support.unsupported(fam, project, support.TRAIN) == [
        "Qwen-Image-2.1 does not support the model-parallel mode's decoder cuts yet: set "
        "qwen_edit.parallel.decoder_cuts to []"
    ]
