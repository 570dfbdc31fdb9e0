"""The model-family seam (train/model/interface.py, train/model/family.py): the generic modules import no family
folder by name, the registry finds a family from a model directory, a variant or a transformer, a family's
conditioning survives the per-sample parts that the cache stores and the model-parallel links carry, what a family
does not provide yet is refused at start-up (train/model/support.py), and the settings whose default is the
family's are filled in from its record."""

from __future__ import annotations

import json

import pytest
import torch
from test_layout import REPO, import_graph

from train.model import family
from train.model.interface import ModelError

# Modules outside the family folders that may name one: the registration, and the tiny/demo commands (they build the
# Qwen-Image tiny checkpoint with its own options).
MAY_NAME_A_FAMILY = {"train.model.family", "train.make_tiny", "train.demo"}


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
    with pytest.raises(ModelError, match="no model family 'flux'; the families are qwen_image, qwen_image21"):
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


def test_a_qwen_image21_directory_is_found_and_mixed_directories_are_named(tiny_21, tmp_path):
    """A 2.1 directory is 2.1's (not a refusal asking for a newer diffusers); a variant of the other family, or a
    2.1 transformer saved under a Qwen-Image pipeline, is refused naming what to set."""
    import shutil

    fam, variant = family.detect(tiny_21)
    assert (fam.name, variant) == ("qwen_image21", "qwen_image_21")
    with pytest.raises(ModelError, match="variant is 'edit' but .* is Qwen-Image-2.1 .*set the variant to 'qwen_imag"):
        family.detect(tiny_21, "edit")
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_21, mixed)
    (mixed / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    refusal = "is a QwenImage21Transformer2DModel but model_index.json names 'QwenImageEditPipeline'"
    with pytest.raises(ModelError, match=refusal) as e:
        family.detect(mixed)
    assert "install" not in str(e.value)


def _everything_on():
    """Settings that reach every optional part of a family's record."""
    from train.config import DataConfig, ParallelConfig, ProjectConfig, TrainConfig, ValidationConfig

    return ProjectConfig(
        data=DataConfig(cache="auto"),
        validation=ValidationConfig(file="edits.jsonl"),
        parallel=ParallelConfig(mode="model_parallel", decoder_cuts=[1]),
        train=TrainConfig(fp8_base=True, gradient_checkpointing=True, kept_attention_blocks=2),
    )


def test_what_a_family_lacks_is_refused_with_the_setting_and_the_fix():
    """Every setting that needs a part Qwen-Image-2.1 does not provide yet is named with its fix, all at once (a
    ModelError, before anything loads); Qwen-Image provides all of them. 2.1 trains and builds its cache."""
    import dataclasses

    from train.model import support

    qwen, qwen21 = family.family_named("qwen_image"), family.family_named("qwen_image21")
    project = _everything_on()
    for command in (support.TRAIN, support.CACHE, support.INFER):
        assert support.unsupported(qwen, project, command, gpu=True) == []
    problems = support.unsupported(qwen21, project, support.TRAIN, gpu=True)
    starts = [p.split(":")[0] for p in problems]
    assert starts == [
        "Qwen-Image-2.1 does not support the model-parallel mode's decoder cuts yet",
        "qwen_edit.train.kept_attention_blocks",
    ], problems
    assert problems[0].endswith("set qwen_edit.parallel.decoder_cuts to []")
    all_that_can = dataclasses.replace(project, train=dataclasses.replace(project.train, kept_attention_blocks=-1))
    assert not any("kept_attention" in p for p in support.unsupported(qwen21, all_that_can, support.TRAIN))
    assert support.unsupported(qwen21, project, support.CACHE) == []
    assert support.unsupported(qwen21, project, support.INFER) == []
    with pytest.raises(ModelError, match=r"is Qwen-Image-2.1, and this run needs .*\n  Qwen-Image-2.1 does not supp"):
        support.check_supported(qwen21, project, support.TRAIN)


def test_the_trainer_refuses_what_qwen_image21_lacks_before_it_starts(tiny_21_edits, tmp_path):
    """train/main.py on a 2.1 directory with a setting its family does not provide yet (kept attention outputs
    under checkpointing): exit 2 and the refusal naming the key, no traceback and no advice to upgrade diffusers."""
    from conftest import start_refused, write_config

    changes = {"qwen_edit.lora.target_modules": None, "qwen_edit.train.gradient_checkpointing": True,
               "qwen_edit.train.kept_attention_blocks": 1}
    config = write_config(tmp_path / "cfg.json", **changes)
    code, err = start_refused(tiny_21_edits, tmp_path / "out", config)
    assert code == 2, err
    assert "qwen_edit.train.kept_attention_blocks: Qwen-Image-2.1's attention cannot keep its output yet" in err
    assert "Traceback" not in err and "install" not in err


def test_the_lora_targets_default_to_the_family_s():
    """qwen_edit.lora.target_modules left out (null) is the family's default list, filled in once; a list set in
    the config stays."""
    import dataclasses

    from train.config import Config, LoraConfig, ProjectConfig
    from train.trainer.build import with_family_defaults

    cfg = Config(project=ProjectConfig(), deepspeed={})
    assert cfg.project.lora.target_modules is None
    for fam in family.FAMILIES:
        assert with_family_defaults(cfg, fam).project.lora.target_modules == list(fam.lora.targets)
    mine = dataclasses.replace(cfg, project=ProjectConfig(lora=LoraConfig(target_modules=["attn.to_q"])))
    assert with_family_defaults(mine, family.FAMILIES[1]).project.lora.target_modules == ["attn.to_q"]
    assert family.family_named("qwen_image21").lora.targets[-1] == "img_mlp.out"
