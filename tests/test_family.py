"""The model-family seam (train/model/interface.py, train/model/family.py): the generic modules import no family
folder by name, the registry finds a family from a model directory, a variant or a transformer, and a family's
conditioning survives the per-sample parts that the cache stores and the model-parallel links carry."""

from __future__ import annotations

import json

import pytest
import torch
from test_layout import REPO, import_graph

from train.model import family
from train.model.interface import ModelError

# Modules outside the family folders that may name one: the registration, the tiny/demo commands (they build the
# Qwen-Image tiny checkpoint with its own options), and the memory plan, which moves to train/plan/ and is then
# pointed at the interface.
MAY_NAME_A_FAMILY = {"train.model.family", "train.make_tiny", "train.demo", "train.plan.arch"}


def family_packages() -> set[str]:
    """train.model.<folder> for every folder of train/model/ (a family lives in one)."""
    return {f"train.model.{p.name}" for p in (REPO / "train" / "model").iterdir() if (p / "__init__.py").is_file()}


def named_families(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """'module imports family module' for every generic module that imports a module of a family folder."""

    def inside(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    return [
        f"{src} imports {dst}"
        for src in sorted(graph)
        if not inside(src) and src not in MAY_NAME_A_FAMILY
        for dst in sorted(graph[src])
        if inside(dst)
    ]


def test_generic_modules_import_no_family_folder():
    packages = family_packages()
    assert "train.model.qwen_image" in packages
    graph = import_graph()
    assert named_families(graph, packages) == []
    planted = {k: set(v) for k, v in graph.items()}
    planted["train.trainer.loop"].add("train.model.qwen_image.conditioning")
    assert named_families(planted, packages) == ["train.trainer.loop imports train.model.qwen_image.conditioning"]


def test_every_family_folder_is_registered_and_variants_are_unique():
    """One folder per registered family (a folder nobody registered is dead code), each variant in one family."""
    assert {f"train.model.{f.name}" for f in family.FAMILIES} == family_packages()
    names = [v.name for f in family.FAMILIES for v in f.variants]
    assert len(names) == len(set(names)) and "edit_plus_2511" in names


def _model_dir(tmp_path, pipeline: str):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return tmp_path


def test_the_registry_finds_the_family(tmp_path):
    qwen = family.family_named("qwen_image")
    assert family.family_of(_model_dir(tmp_path, "QwenImageEditPlusPipeline")) is qwen
    assert family.variant_family("t2i") is qwen and family.family_for("edit", tmp_path / "gone") is qwen
    unknown = _model_dir(tmp_path, "MyPipeline")
    assert family.family_of(unknown, "edit_plus") is qwen  # an unknown pipeline trains as the variant asked for
    with pytest.raises(ModelError, match="'MyPipeline', not one of QwenImageEditPipeline, .*set qwen_edit.model"):
        family.family_of(unknown)
    with pytest.raises(ModelError, match="no model family 'flux'; the families are qwen_image"):
        family.family_named("flux")
    with pytest.raises(ModelError, match="no model family has the variant 'v9'; the variants are edit, "):
        family.variant_family("v9")
    with pytest.raises(ModelError, match="Linear is the transformer of no model family"):
        family.transformer_family(torch.nn.Linear(2, 2))


def test_a_batch_survives_its_per_sample_parts():
    """Conditioning.samples -> join_conditioning (the cache's and the model-parallel links' round trip) gives the
    batch back: prompts padded to the longest with the same mask, references and shapes as they were."""
    from train.model.qwen_image.batches import Conditioning

    qwen = family.family_named("qwen_image")
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(3, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    embeds[mask == 0] = 0  # the encoder pads with zeros
    cond = Conditioning(embeds, mask, torch.randn(3, 4, 6, generator=g), [(1, 2, 2)])
    parts = cond.samples()
    assert [m["prompt_tokens"] for m, _ in parts] == [5, 3, 4]
    back = qwen.join_conditioning([(json.loads(json.dumps(m)), t) for m, t in parts])  # metadata as JSON keeps it
    assert torch.equal(back.prompt_embeds, embeds) and torch.equal(back.prompt_mask, mask)
    assert torch.equal(back.reference_tokens, cond.reference_tokens) and back.reference_shapes == [(1, 2, 2)]
    unpadded = qwen.join_conditioning(parts[1:2])
    assert unpadded.prompt_mask is None and unpadded.prompt_embeds.shape == (1, 3, 8)
    assert (back.num_text_tokens, back.num_reference_tokens) == (5, 4)
