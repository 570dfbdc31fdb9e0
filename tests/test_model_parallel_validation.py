"""Validation images in the model-parallel mode (model_parallel/validation.py): the conditioning recorded where
the encoders are and replayed where the transformer is renders the images the encoders would; a 2-process run
writes the grids and trains bitwise as without them; a decoder cut with validation is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import write_config
from test_validation import TINY_INFERENCE, check_validated_run, edits_file, validated_runs

from model_parallel import plan
from train import config
from train.config import Config, ProjectConfig
from train.model import loading
from train.model.qwen_image import components
from train.runtime.engine import Dist
from train.runtime.record import NullMetrics
from train.trainer import replay, validation


@pytest.mark.parametrize("variant, num_refs", [("edit", 1), ("edit_plus", 2), ("t2i", 0), ("edit", 0)],
                         ids=["edit", "edit_plus", "t2i", "edit_without_reference"])
def test_replayed_conditioning_renders_what_the_encoders_render(variant, num_refs, request, tmp_path):
    """One process: encode_requests with the encoders, through the transport message, then a Validator with only
    a VAE replays it: every image equals the one the Validator renders with the encoders (guidance on: the
    negative prompt is recorded too; 2509: two references per edit; text-to-image rows, of Qwen-Image or of an
    edit model: QwenImagePipeline, prompts only)."""
    from model_parallel import validation as mp_validation

    tiny = request.getfixturevalue({"edit": "tiny_edit", "edit_plus": "tiny_plus", "t2i": "tiny_t2i"}[variant])
    cfg = Config(ProjectConfig(), deepspeed={})
    p = cfg.project
    p.model.path, p.output.dir = str(tiny / "model"), str(tmp_path / "out")
    p.validation.file = str(edits_file(tiny, tmp_path / "val.jsonl", 2, references=num_refs > 0))
    p.inference = config.InferenceConfig(**{**TINY_INFERENCE, "true_cfg_scale": 2.0})
    d = Dist(0, 1, 0, torch.device("cpu"))
    torch.manual_seed(0)
    transformer = loading.load_transformer(p.model, torch.float32)
    encoders = components.load_encoders(p.model.path, torch.float32, d.device)

    recorded = replay.encode_requests(cfg, encoders, 0, 1)
    assert [name for name, _ in recorded[0]] == ["encode_prompt", "encode_prompt"] + ["_encode_vae_image"] * num_refs
    received = mp_validation.message_conditioning(*mp_validation.conditioning_message(recorded))
    direct = validation.Validator(cfg, d, transformer, encoders, NullMetrics()).render()
    vae_only = components.Encoders(None, None, components.load_vae(cfg.project.model.path, torch.float32, d.device))
    replayed = validation.Validator(cfg, d, transformer, vae_only, NullMetrics(), received).render()
    assert len(direct) == len(replayed) == 2
    for a, b in zip(direct, replayed, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_validation_with_a_decoder_cut_is_refused(tiny_edit, tmp_path):
    """validation.file with parallel.decoder_cuts: a ConfigError naming qwen_edit.validation.file and the fix."""
    cfg = write_config(tmp_path / "cut.json", **{
        "qwen_edit.parallel": {"mode": "model_parallel", "stages": ["cpu"] * 3, "decoder_cuts": [1]},
        "qwen_edit.validation.file": str(edits_file(tiny_edit, tmp_path / "val.jsonl"))})
    args = config.parse_args(["--ds_config", str(cfg), "--model", str(tiny_edit / "model"), "--data",
                              str(tiny_edit / "data"), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(config.ConfigError, match=r"qwen_edit\.validation\.file: .*decoder_cuts \[1\] cuts it; set "
                                                 r"validation\.file to \"\".* or decoder_cuts to \[\]"):
        config.load_config(args, world_size=3, has_gpu=False, check_parallel=plan.check_parallel)


@pytest.mark.slow
def test_model_parallel_validation_grids_and_unchanged_training(tiny_edit, tmp_path):
    """Encoder + decoder process: the grids are rendered on the decoder stage from the encoder's conditioning;
    the same checks as the ZeRO-2 run's (test_validation.check_validated_run)."""
    check_validated_run(validated_runs(tiny_edit, tmp_path, edits_file(tiny_edit, tmp_path / "validation.jsonl"),
                                       **{"qwen_edit.parallel": {"mode": "model_parallel", "stages": ["cpu", "cpu"]}}))
