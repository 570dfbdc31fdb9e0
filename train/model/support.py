"""What the commands and settings need of a model family's record, and their refusal when the family of the model
directory does not provide it yet: a family may register before every part of it is wired (its record leaves
those parts None), and a run that needs one stops at start-up, before anything loads, with every problem at once,
each naming the setting and its fix; never a traceback half-way or a silently different run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from train.config import ProjectConfig
from train.model.interface import ModelError, ModelFamily

TRAIN, CACHE, INFER = "train", "cache", "infer"  # the commands: train/main.py, train.cache, train.infer


def _always(p: ProjectConfig, gpu: bool) -> bool:
    return True


@dataclass(frozen=True)
class Need:
    """Parts of the record (ModelFamily fields) that `commands` need when `applies`; `problem` is formatted with the
    family's title, folder, missing parts and pipeline class."""

    parts: tuple[str, ...]
    commands: tuple[str, ...]
    problem: str
    applies: Callable[[ProjectConfig, bool], bool] = _always  # (project settings, a GPU is there)


NEEDS = (
    Need(
        ("load_encoders", "sample_images", "image_size", "condition_size", "prompt_overflow", "prompt_tokenizer"),
        (TRAIN, CACHE),
        "{title} cannot be trained by this version yet: its family (train/model/{name}/) does not load its encoders "
        "or read a row's images ({missing}); train a model of another family",
    ),
    Need(
        ("cached_bucket_key", "conditioning_fingerprint", "join_conditioning"),
        (TRAIN, CACHE),
        'qwen_edit.data.cache: {title} has no latent cache yet ({missing}); set it to "off" (encode online)',
        lambda p, gpu: p.data.cache != "off",
    ),
    Need(
        ("load_vae", "pipeline_from_components", "sample", "sampling_pipeline"),
        (TRAIN,),
        'qwen_edit.validation.file: {title} renders no validation images yet ({missing}); set it to ""',
        lambda p, gpu: bool(p.validation.file),
    ),
    Need(
        ("cut",),
        (TRAIN,),
        "{title} does not support the model-parallel mode's decoder cuts yet: set qwen_edit.parallel.decoder_cuts "
        "to []",
        lambda p, gpu: p.parallel.mode == "model_parallel" and bool(p.parallel.decoder_cuts),
    ),
    Need(
        ("fp8_linears",),
        (TRAIN,),
        "qwen_edit.train.fp8_base: {title} names no linears for an fp8 base yet; set it to false",
        lambda p, gpu: p.train.fp8_base,
    ),
    Need(
        ("attention_module",),
        (TRAIN,),
        "qwen_edit.train.kept_attention_blocks: {title}'s attention cannot keep its output yet; set it to 0 or -1 "
        "(all that can: none)",
        lambda p, gpu: p.train.gradient_checkpointing and p.train.kept_attention_blocks > 0,
    ),
    Need(
        ("synthetic_batch", "text_tokens_bound", "image_size", "load_vae"),
        (TRAIN,),
        'qwen_edit.memory.plan: {title} has no memory plan yet ({missing}); set it to "off" and choose the memory '
        "settings yourself (docs/memory_plan.md)",
        lambda p, gpu: gpu and p.memory.plan == "auto",
    ),
    Need(
        ("load_pipeline", "sample", "sampling_pipeline", "load_encoders", "image_size", "prompt_overflow"),
        (INFER,),
        "train.infer does not render {title} yet ({missing}); render it with diffusers' {pipeline}",
    ),
)


def unsupported(fam: ModelFamily, project: ProjectConfig, command: str, gpu: bool = False) -> list[str]:
    """What `command` with these settings needs of `fam` that its record does not provide, one line each."""
    problems = []
    for need in NEEDS:
        missing = [part for part in need.parts if getattr(fam, part) is None]
        if missing and command in need.commands and need.applies(project, gpu):
            problems.append(
                need.problem.format(
                    title=fam.title, name=fam.name, missing=", ".join(missing), pipeline=fam.variants[0].pipeline_class
                )
            )
    return problems


def check_supported(fam: ModelFamily, project: ProjectConfig, command: str, gpu: bool = False) -> None:
    """ModelError listing everything `unsupported` finds, if anything."""
    problems = unsupported(fam, project, command, gpu)
    if problems:
        raise ModelError(
            f"{project.model.path} is {fam.title}, and this run needs what its family does not provide "
            "yet:\n  " + "\n  ".join(problems)
        )
