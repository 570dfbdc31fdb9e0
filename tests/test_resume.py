"""Resuming with a changed config (train/runtime/resume_changes.py): what cannot work is refused, the rest recorded."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import TINY_CONFIG

from train.runtime import engine, resume_changes
from train.trainer import build


@pytest.fixture
def saved() -> dict:
    return json.loads(TINY_CONFIG.read_text())


def changed(cfg: dict, **changes) -> dict:
    """A copy of `cfg` with dotted-key changes ('qwen_edit.lora.rank': 8)."""
    cfg = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return cfg


def test_settings_the_checkpoint_cannot_follow_are_refused_by_name(saved):
    """LoRA rank and targets, the optimizer type, ZeRO stage, precision and DeepCompile (which sets what trains) are
    named together with both values."""
    now = changed(saved, **{"qwen_edit.lora.rank": 8, "qwen_edit.lora.target_modules": ["attn.to_q"],
                            "optimizer.type": "SGD", "zero_optimization.stage": 1, "bf16.enabled": True,
                            "qwen_edit.train.deepcompile": True, "optimizer.params.lr": 0.5})
    with pytest.raises(resume_changes.ResumeError) as e:
        resume_changes.config_changes({"config": saved}, now, "global_step4")
    msg = str(e.value)
    for key in ("qwen_edit.lora.rank: 16 in the checkpoint, 8 now", "qwen_edit.lora.target_modules",
                'optimizer.type: "AdamW" in the checkpoint, "SGD" now', "zero_optimization.stage: 2",
                "bf16.enabled: null in the checkpoint, true now", "qwen_edit.train.deepcompile: ",
                "python -m train.export"):
        assert key in msg, msg
    assert "optimizer.params.lr" not in msg


def test_allowed_changes_are_returned_and_recorded(saved, tmp_path, capsys, monkeypatch):
    """A new learning rate or dataset resumes; the changes are printed and appended to OUTPUT/config_changes.jsonl;
    a longer max_steps (the usual resume) or a moved output directory is no change."""
    now = changed(saved, **{"optimizer.params.lr": 0.001, "qwen_edit.data.path": "/new/data",
                            "qwen_edit.train.max_steps": 400, "qwen_edit.output.dir": str(tmp_path)})
    changes = resume_changes.config_changes({"config": saved}, now, "global_step4")
    assert changes == {"optimizer.params.lr": [0.01, 0.001], "qwen_edit.data.path": [None, "/new/data"]}
    assert resume_changes.config_changes({}, now, "global_step4") == {}  # a checkpoint without a stored config

    class Cfg:  # the two fields start_writing reads
        deepspeed = {}
        project = type("P", (), {"output": type("O", (), {"dir": str(tmp_path)})})()

    monkeypatch.setattr(build.config, "write_resolved", lambda cfg, out: None)  # only the record is tested
    build.start_writing(Cfg(), engine.Dist(0, 1, 0, None), False, 4, changes)
    assert json.loads((tmp_path / "config_changes.jsonl").read_text()) == {"step": 4, "changes": changes}
    assert 'resumed with changed settings: optimizer.params.lr: 0.01 -> 0.001' in capsys.readouterr().out
