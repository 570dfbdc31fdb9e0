"""The model families the trainer knows (train/model/interface.py says what one provides), and how a model
directory, a family name or a variant finds its family.

Adding a family: its folder under train/model/ and one line in FAMILIES.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.model.interface import ModelError, ModelFamily

__all__ = [
    "FAMILIES",
    "ModelError",
    "detect",
    "family_for",
    "family_named",
    "family_of",
    "transformer_family",
    "variant_family",
]
from train.model.qwen_image.family import FAMILY as QWEN_IMAGE
from train.model.qwen_image21.family import FAMILY as QWEN_IMAGE21

FAMILIES: tuple[ModelFamily, ...] = (QWEN_IMAGE, QWEN_IMAGE21)


def family_named(name: str) -> ModelFamily:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ModelError(f"no model family {name!r}; the families are {', '.join(f.name for f in FAMILIES)}")


def variant_family(variant: str) -> ModelFamily:
    """The family of qwen_edit.model.variant `variant`."""
    for fam in FAMILIES:
        if any(v.name == variant for v in fam.variants):
            return fam
    raise ModelError(
        f"no model family has the variant {variant!r}; the variants are "
        f"{', '.join(v.name for f in FAMILIES for v in f.variants)}"
    )


def transformer_family(transformer: torch.nn.Module | type) -> ModelFamily:
    """The family of a transformer (a LoRA-wrapped one too) or of its class, by its diffusers class."""
    cls = transformer if isinstance(transformer, type) else type(transformer)
    names = {c.__name__ for c in cls.__mro__}
    for fam in FAMILIES:
        if fam.transformer_class in names:
            return fam
    raise ModelError(
        f"{cls.__name__} is the transformer of no model family; the families' are "
        f"{', '.join(f.transformer_class for f in FAMILIES)}"
    )


def family_for(variant: str, model_dir: str | Path) -> ModelFamily:
    """The family of a trained model: its recorded `variant`, or ("auto") the pipeline that saved `model_dir`."""
    return family_of(model_dir) if variant == "auto" else variant_family(variant)


def pipeline_name(model_dir: str | Path) -> str:
    """model_index.json's `_class_name`: the diffusers pipeline the directory was saved from."""
    path = Path(model_dir) / "model_index.json"
    if not path.is_file():
        raise ModelError(f"{path} does not exist; point the model path at a diffusers-format directory")
    return json.loads(path.read_text()).get("_class_name", "")


def transformer_name(model_dir: str | Path) -> str:
    """transformer/config.json's `_class_name` ("" without one)."""
    path = Path(model_dir) / "transformer" / "config.json"
    return json.loads(path.read_text()).get("_class_name", "") if path.is_file() else ""


def family_of(model_dir: str | Path, variant: str = "auto") -> ModelFamily:
    """The family whose transformer `model_dir` holds, else the one whose pipelines saved it; for a directory no
    family knows, the family of the configured `variant` (which must then not be "auto"). The family's
    detect_variant then checks that the files agree (a transformer of one family under another's pipeline is
    refused there, naming both)."""
    transformer = transformer_name(model_dir)
    for fam in FAMILIES:
        if fam.transformer_class == transformer:
            return fam
    name = pipeline_name(model_dir)
    for fam in FAMILIES:
        if any(v.pipeline_class == name for v in fam.variants):
            return fam
    if variant != "auto":
        return variant_family(variant)
    known = list(dict.fromkeys(v.pipeline_class for f in FAMILIES for v in f.variants))
    raise ModelError(
        f"{model_dir}/model_index.json names pipeline {name!r}, not one of {', '.join(known)}; set "
        f"qwen_edit.model.variant to one of {', '.join(v.name for f in FAMILIES for v in f.variants)}"
    )


def detect(model_dir: str | Path, variant: str = "auto") -> tuple[ModelFamily, str]:
    """(family, variant) of `model_dir`; an explicit `variant` must agree with the files (ModelError otherwise)."""
    fam = family_of(model_dir, variant)
    return fam, fam.detect_variant(model_dir, variant)
