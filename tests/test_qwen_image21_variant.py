"""train/model/qwen_image21/variant.py on the tiny 2.1 checkpoint's configs: detected, and each inconsistency is an
error naming the file, the key and the fix."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from train.model.interface import ModelError
from train.model.qwen_image21 import variant as V


@pytest.fixture
def configs(tiny_21, tmp_path):
    """The tiny 2.1 directory's configs (no weights), to edit."""
    for name in ("model_index.json", "transformer/config.json", "vae/config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_21 / name, tmp_path / name)
    return tmp_path


def edit(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_tiny_checkpoint_is_qwen_image_21(tiny_21):
    assert V.is_qwen_image21(tiny_21)
    assert V.detect_variant(tiny_21) == V.detect_variant(tiny_21, "qwen_image_21") == "qwen_image_21"


def test_an_mmdit_directory_is_not_21(configs):
    edit(configs / "model_index.json", _class_name="QwenImageEditPlusPipeline")
    edit(configs / "transformer" / "config.json", _class_name="QwenImageTransformer2DModel")
    assert not V.is_qwen_image21(configs)


@pytest.mark.parametrize(
    "file, changes, override, message",
    [
        ("model_index.json", {}, "edit_plus", "set the variant to 'qwen_image_21' or \"auto\""),
        ("transformer/config.json", {"_class_name": "QwenImageTransformer2DModel"}, "auto", "mixes two models"),
        ("model_index.json", {"_class_name": "MyPipeline"}, "auto", "set its _class_name to 'QwenImage21Pipeline'"),
        ("transformer/config.json", {"rope_scaling": 2.0}, "auto", "rope_scaling=2.0, which"),
        ("vae/config.json", {"z_dim": 64}, "auto", "z_dim 64 but the transformer takes in_channels 16"),
    ],
    ids=["other_override", "mmdit_transformer", "unknown_pipeline", "unknown_key", "vae_channels"],
)
def test_inconsistent_directories_are_refused(configs, file, changes, override, message):
    edit(configs / file, **changes)
    with pytest.raises(ModelError, match=re.escape(message)):
        V.detect_variant(configs, override)


def test_override_trains_an_unknown_pipeline_class_as_21(configs):
    edit(configs / "model_index.json", _class_name="MyPipeline")
    assert V.detect_variant(configs, "qwen_image_21") == "qwen_image_21"
