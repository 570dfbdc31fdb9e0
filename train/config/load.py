"""Loading a configuration: read the JSON file, apply the command-line overrides, build the typed sections, run
every check and raise one ConfigError listing every problem; write the resolved config next to the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from collections.abc import Callable
from pathlib import Path

from train.config import checks, textfile
from train.config import deepspeed as ds_keys
from train.config.schema import PROJECT_KEY, Config, ConfigError, ProjectConfig, ValidationConfig


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _build(cls, data, path: str, problems: list[str]):
    """Instantiate dataclass `cls` from `data`, appending a message per problem instead of raising."""
    if not isinstance(data, dict):
        problems.append(f"{path}: expected an object, got {type(data).__name__}; write it as {{...}}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            near = [n for n in fields if n[:4] == key[:4]]
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{path}.{key}: unknown key{hint}; known keys: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        hint, value = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{path}.{name}", problems)
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{path}.{name}: {value} is not a finite number; write a finite value")
        elif not _type_ok(value, hint):
            want = getattr(hint, "__name__", str(hint))
            problems.append(f"{path}.{name}: expected {want}, got {json.dumps(value)}; fix its type in the JSON")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"{path}.{name}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
        else:
            values[name] = value
    return cls(**values)


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
    project = _build(ProjectConfig, raw.get(PROJECT_KEY, {}) if isinstance(raw, dict) else raw, PROJECT_KEY, problems)
    project.validation = ValidationConfig()  # a training config's validation file is no concern of train.infer
    checks.check_inference(project, problems)
    checks.check_offload(project, problems)  # its memory section (budget_gb, margin_gb)
    if problems:
        raise ConfigError(problems)
    return project


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune Qwen-Image-Edit / -2509 with DeepSpeed")
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


# check_parallel(project, problems, world_size, num_gpus, fp16=...) appends the problems of the model-parallel
# placement; it lives with the placement (model_parallel.plan.check_parallel), which this library does not import.
ParallelCheck = Callable[..., None]


def load_config(args: argparse.Namespace, world_size: int, has_gpu: bool, num_gpus: int | None = None,
                check_parallel: ParallelCheck | None = None) -> Config:
    """Read, override, validate and resolve; raises ConfigError listing every problem. `num_gpus` (GPUs of this
    node, None = unknown) checks the model-parallel devices with `check_parallel` (the commands that run that mode
    pass model_parallel.plan.check_parallel; without it the placement is not checked)."""
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
    project = _build(ProjectConfig, raw.get(PROJECT_KEY, {}), PROJECT_KEY, problems)
    overrides = {"model.path": args.model, "data.path": args.data, "output.dir": args.output_dir,
                 "train.max_steps": args.max_steps, "train.seed": args.seed}
    for dotted, value in overrides.items():
        if value is not None:
            section, name = dotted.split(".")
            setattr(getattr(project, section), name, value)
    checks.check_project(project, problems)
    if check_parallel is not None:
        check_parallel(project, problems, world_size, num_gpus if has_gpu else 0,
                       fp16=bool(isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled")))
    ds_keys.check_deepspeed(raw, world_size, project.train.max_steps, problems)
    ds_keys.check_deepspeed_values({k: v for k, v in raw.items() if k != PROJECT_KEY}, problems)
    if problems:
        raise ConfigError(problems)
    resolved = ds_keys.resolve_deepspeed(raw, project.train.max_steps, has_gpu)
    ds_keys.check_with_deepspeed(resolved, problems)  # only a config that passed the checks above
    if problems:
        raise ConfigError(problems)
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
