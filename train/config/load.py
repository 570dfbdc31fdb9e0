"""Loading a configuration: read the JSON file, build the typed sections with pydantic (read_project: each of
pydantic's errors becomes a problem naming the key and the field's help), apply the command-line overrides, run
every check and raise one ConfigError listing every problem; write the resolved config next to the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import pydantic

from train.config import checks, textfile
from train.config import deepspeed as ds_keys
from train.config.schema import PROJECT_KEY, Config, ConfigError, ProjectConfig, ValidationConfig

_PROJECT = pydantic.TypeAdapter(ProjectConfig)


def read_project(data, problems: list[str]) -> ProjectConfig:
    """The project section as a ProjectConfig, built and type-checked by pydantic; a problem for each bad key, whose
    default then stands in for it so that the checks after this one still run (all problems in one error)."""
    try:
        return _validate(data)
    except pydantic.ValidationError as e:
        errors = e.errors()
    bad: dict[tuple, dict] = {}  # key path -> its first error (a list with two wrong items is one problem)
    for error in errors:
        bad.setdefault(_key_path(error["loc"]), error)
    problems += [_problem(path, error, data) for path, error in bad.items()]
    return _validate(_without(data, list(bad)))


def _validate(data) -> ProjectConfig:
    # pydantic's JSON mode, where strict still takes an object for a section (its Python mode wants an instance)
    # and an integer for a float. The section came from json.loads, so dumping it again loses nothing.
    return _PROJECT.validate_json(json.dumps(data))


def _key_path(loc: tuple) -> tuple:
    """The key an error is about: a field, an unknown key or a section; an item inside a field's value is its field."""
    cls = ProjectConfig
    for i, name in enumerate(loc):
        info = cls.__pydantic_fields__.get(name)
        if info is None or not dataclasses.is_dataclass(info.annotation):
            return loc[: i + 1]
        cls = info.annotation
    return loc


def _owner(path: tuple) -> type:
    """The section whose field (or unknown key) `path` names."""
    cls = ProjectConfig
    for name in path[:-1]:
        cls = cls.__pydantic_fields__[name].annotation
    return cls


def _problem(path: tuple, error: dict, data) -> str:
    """One line for the user: the dotted key, what is wrong, the fix and, for a field, its help."""
    where = ".".join((PROJECT_KEY, *map(str, path)))
    if error["type"] in ("dataclass_type", "dataclass_exact_type"):
        return f"{where}: expected an object, got {type(error['input']).__name__}; write it as {{...}}"
    known = _owner(path).__pydantic_fields__
    if path[-1] not in known:
        near = difflib.get_close_matches(path[-1], known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return f"{where}: unknown key{hint}; known keys: {', '.join(known)}"
    info, value = known[path[-1]], data
    for name in path:
        value = value[name]
    if error["type"] == "finite_number":
        what = f"{value} is not a finite number; write a finite value"
    elif error["type"] == "literal_error" and isinstance(value, str):
        what = f"{value!r} is not one of {', '.join(typing.get_args(info.annotation))}"
    else:
        what = f"expected {_type_name(info.annotation)}, got {json.dumps(value)}; fix its type in the JSON"
    return f"{where}: {what}. Help: {' '.join(info.description.split())}"


def _type_name(hint) -> str:
    """'int', 'list[str]', 'dict[str, float]', 'list[str] or null': a field's type as a message names it (a choice
    is a str)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "str"
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(map(_type_name, args))}]"
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if arg is type(None) else _type_name(arg) for arg in args)
    return hint.__name__


def _without(data, paths: list[tuple]):
    """A copy of `data` without the keys at `paths` (() = all of it)."""
    if () in paths:
        return {}
    data = json.loads(json.dumps(data))
    for path in paths:
        node = data
        for name in path[:-1]:
            node = node[name]
        del node[path[-1]]
    return data


def _explicit(raw: dict) -> set[str]:
    """Dotted keys (section.name) that a config's qwen_edit section sets."""
    project = raw.get(PROJECT_KEY, {}) if isinstance(raw, dict) else {}
    return {f"{section}.{key}" for section, body in project.items() if isinstance(body, dict) for key in body}


def explicit_keys(path: str | os.PathLike | None) -> set[str]:
    """_explicit of the JSON file at `path` (a file inference_settings has read already); none without one."""
    return set() if path is None else _explicit(json.loads(textfile.read_text(Path(path))))


def inference_settings(path: str | os.PathLike | None) -> ProjectConfig:
    """The project section of a JSON config for train.infer (defaults without a file); only the inference
    section and the GPU monitor interval are checked. Raises ConfigError."""
    if path is None:
        return ProjectConfig()
    path = Path(path)
    try:
        raw = json.loads(textfile.read_text(path))
    except (OSError, json.JSONDecodeError, textfile.TextFileError) as e:
        raise ConfigError([f"--config: cannot read {path} as JSON ({e})"]) from e
    problems: list[str] = []
    project = read_project(raw.get(PROJECT_KEY, {}) if isinstance(raw, dict) else raw, problems)
    project.validation = ValidationConfig()  # a training config's validation file is no concern of train.infer
    checks.check_inference(project, problems)
    checks.check_offload(project, problems)  # its memory section (budget_gb, margin_gb)
    if problems:
        raise ConfigError(problems)
    return project


TRAIN_DESCRIPTION = ("Fine-tune Qwen-Image-Edit (v1, 2509, 2511) or Qwen-Image (2512) with DeepSpeed: LoRA or "
                     "full, ZeRO data parallel or the model-parallel split")


def parse_args(argv: list[str] | None = None, description: str = TRAIN_DESCRIPTION) -> argparse.Namespace:
    """The arguments of training (train/main.py) and of train.cache, which reads the same run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ds_config", required=True, help="JSON: DeepSpeed keys + the qwen_edit section")
    parser.add_argument("--model", help=f"overrides {PROJECT_KEY}.model.path")
    parser.add_argument("--data", help=f"overrides {PROJECT_KEY}.data.path")
    parser.add_argument("--output_dir", help=f"overrides {PROJECT_KEY}.output.dir")
    parser.add_argument("--max_steps", type=int, help=f"overrides {PROJECT_KEY}.train.max_steps")
    parser.add_argument("--seed", type=int, help=f"overrides {PROJECT_KEY}.train.seed")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                        help="resume from OUTPUT/latest, or from OUTPUT/TAG (e.g. global_step500)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start anew in an output directory that holds another run: its checkpoints, metrics "
                             "and exports are deleted once every check has passed")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.overwrite and args.resume is not None:
        parser.error("--overwrite deletes the run that --resume continues; pass one of them")
    return args


# check_parallel(project, problems, world_size, num_gpus, fp16=..., node_local_storage=...) appends the problems of
# the model-parallel placement; it lives with the placement (model_parallel.plan.check_parallel), which this library
# does not import.
ParallelCheck = Callable[..., None]


def load_config(args: argparse.Namespace, world_size: int, has_gpu: bool, num_gpus: int | None = None,
                check_parallel: ParallelCheck | None = None) -> Config:
    """Read, override, validate and resolve (the DeepSpeed section for `has_gpu`; data.encode_ahead for it and the
    parallel mode); raises ConfigError listing every problem. `num_gpus` (GPUs of this node, None = unknown) checks the
    model-parallel devices with `check_parallel` (the commands that run that mode pass
    model_parallel.plan.check_parallel; without it the placement is not checked)."""
    path = Path(args.ds_config)
    if not path.is_file():
        raise ConfigError([f"--ds_config: {str(path)!r} does not exist; pass a file such as ds_configs/zero2.json"])
    try:
        raw = json.loads(textfile.read_text(path))
    except textfile.TextFileError as e:
        raise ConfigError([f"--ds_config: {e}"]) from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}: {e.msg}"
        raise ConfigError([f"--ds_config: {path} is not valid JSON ({where})"]) from e
    if not isinstance(raw, dict):
        raise ConfigError([f"--ds_config: {path} must hold a JSON object at the top level"])
    problems: list[str] = []
    project = read_project(raw.get(PROJECT_KEY, {}), problems)
    overrides = {"model.path": args.model, "data.path": args.data, "output.dir": args.output_dir,
                 "train.max_steps": args.max_steps, "train.seed": args.seed}
    for dotted, value in overrides.items():
        if value is not None:
            section, name = dotted.split(".")
            setattr(getattr(project, section), name, value)
    checks.check_project(project, problems)
    if check_parallel is not None:
        checkpoint = raw.get("checkpoint") if isinstance(raw.get("checkpoint"), dict) else {}
        check_parallel(project, problems, world_size, num_gpus if has_gpu else 0,
                       fp16=bool(isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled")),
                       node_local_storage=bool(checkpoint.get("use_node_local_storage")
                                               or raw.get("use_node_local_storage")))
    ds_problems: list[str] = []
    ds_keys.check_deepspeed(raw, world_size, project.train.max_steps, ds_problems)
    ds_keys.check_deepspeed_values({k: v for k, v in raw.items() if k != PROJECT_KEY}, ds_problems)
    ds_keys.check_deepcompile(project, raw, has_gpu, ds_problems)
    problems += ds_problems
    checks.check_machine(project, has_gpu, problems)
    # DeepSpeed's own classes read the rest of its section too, so that their problems join the same error: the keys
    # reported above are left out (resolving them could fail, and DeepSpeed would only name them again)
    sound = {k: v for k, v in raw.items() if k not in ds_keys.reported_keys(ds_problems)}
    resolved = ds_keys.resolve_deepspeed(sound, project.train.max_steps, has_gpu, project.train.deepcompile)
    ds_keys.check_with_deepspeed(resolved, problems)
    if problems:
        raise ConfigError(problems)
    # encoding ahead runs where the encoders and the step can overlap (a GPU), in the zero2 mode: the model-parallel
    # encoder stage is ahead of its decoder already, and there each micro-batch encodes when asked for
    ahead = project.data.encode_ahead
    project.data.encode_ahead = (has_gpu if ahead == "auto" else ahead) and project.parallel.mode == "zero2"
    explicit = _explicit(raw) | {dotted for dotted, value in overrides.items() if value is not None}
    return Config(project=project, deepspeed=resolved, world_size=world_size, explicit=frozenset(explicit))


def to_dict(config: Config) -> dict:
    """The resolved config as one JSON-able dict in the input layout (DeepSpeed keys + project section)."""
    return {**config.deepspeed, PROJECT_KEY: dataclasses.asdict(config.project)}


def write_resolved(config: Config, directory: str | os.PathLike) -> Path:
    out = Path(directory) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_dict(config), indent=2) + "\n")
    tmp.replace(out)
    return out
