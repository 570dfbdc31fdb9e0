"""Readers of the side files a config names (the prompt mapping, the blocked terms, the validation jsonl), the
model directory's pre-flight, and config values with a syntax of their own (colours). Each reports a problem with
the file, line and fix.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

from PIL import ImageColor

from train.config import textfile


def validation_file_problems(path: Path, limit: int = 5) -> list[str]:
    """Problems of a validation jsonl: it must exist, every row parse, and every image it names exist."""
    if not path.is_file():
        return [f"{str(path)!r} does not exist; point it at a jsonl of {{\"edit_image\": ..., \"prompt\": ...}} rows"]
    problems, rows = [], 0
    try:
        numbered = textfile.lines(path)
    except textfile.TextFileError as e:
        return [str(e)]
    for n, text in numbered:
        if not text.strip():
            continue
        rows += 1
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(f"{path} line {n}: not valid JSON ({e.msg})")
            continue
        refs = row.get("edit_image", []) if isinstance(row, dict) else None  # none: a text-to-image row
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
            problems.append(f"{path} line {n}: needs 'prompt' and, for an edit, 'edit_image' (a path or a list of "
                            "paths)")
        elif not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            problems.append(f"{path} line {n}: empty or missing 'prompt'")
        else:
            problems.extend(f"{path} line {n}: image {r!r} not found (paths are relative to the file's folder)"
                            for r in refs if not (path.parent / r).is_file())
    if not rows:
        problems.append(f"{path} has no rows")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


RANDOM_INIT_ENV = "QWEN_EDIT_RANDOM_INIT"


def random_init() -> bool:
    """QWEN_EDIT_RANDOM_INIT=1: build every model from its config.json at random init, directly on the device
    (measurements on full-size shapes without the weights: `python -m train.make_tiny --full_size_configs`);
    the model family's components build them, and the model directory then needs no weights (model_dir_problems)."""
    return os.environ.get(RANDOM_INIT_ENV) == "1"


# The models of a Qwen-Image pipeline that have weights, and the file that each one's library reads: that name, or
# its index (NAME.index.json) with the shards the index names. (The trainer streams the transformer's safetensors.)
MODEL_WEIGHTS = {"transformer": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
                 "text_encoder": "model.safetensors"}


def transformer_class(transformer_dir: str | Path) -> type:
    """The diffusers model class that `transformer_dir/config.json` names (`_class_name`, which save_pretrained
    writes), so that the loader and the exports serve every model family; ValueError naming the fix."""
    import diffusers

    path = Path(transformer_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; point the model path at a diffusers-format directory")
    name = json.loads(path.read_text()).get("_class_name", "")
    cls = getattr(diffusers, name, None) if name else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ValueError(f"{path} names the model class {name!r}, which the installed diffusers "
                         f"{diffusers.__version__} does not have; write its diffusers model class there (as "
                         "save_pretrained does) or upgrade diffusers")
    return cls


def model_dir_problems(path: str, key: str) -> list[str]:
    """Problems of the model directory that `key` (a config key or flag) names, found before anything loads: it
    must hold model_index.json, and every model that lists (MODEL_WEIGHTS) its weights, unless
    QWEN_EDIT_RANDOM_INIT=1 builds them from their configs."""
    model_dir = Path(path)
    index = model_dir / "model_index.json"
    if not index.is_file():
        return [f"{key}: {path!r} has no model_index.json; point --model at the directory that holds "
                "model_index.json, transformer/, vae/, text_encoder/ ..."]
    try:
        listed = json.loads(textfile.read_text(index))
    except (json.JSONDecodeError, textfile.TextFileError) as e:
        return [f"{key}: {index} is not valid JSON ({e}); copy the checkpoint's model_index.json again"]
    if random_init() or not isinstance(listed, dict):
        return []
    problems, missing = [], {}
    for sub, name in MODEL_WEIGHTS.items():
        folder, shard_index = model_dir / sub, model_dir / sub / f"{name}.index.json"
        if sub not in listed:
            continue
        if (folder / name).is_file():
            problems += [f"{key}: {problem}" for problem in weights_file_problems([folder / name])]
        elif shard_index.is_file():
            problems += [f"{key}: {problem}" for problem in _shard_problems(shard_index)]
        else:
            missing.setdefault(name, []).append(f"{sub}/")
    if missing:
        expected = ", ".join(f"{' and '.join(subs)} need{'s' if len(subs) == 1 else ''} {name} or the shards "
                             f"that {name}.index.json lists" for name, subs in missing.items())
        problems.insert(0, f"{key}: {path!r} has no weights in {', '.join(s for v in missing.values() for s in v)}: "
                           f"{expected}; point --model at a complete diffusers-format directory "
                           f"({RANDOM_INIT_ENV}=1 builds random weights from the configs instead: for memory and "
                           "speed measurements only)")
    return problems


def _shard_problems(index: Path) -> list[str]:
    """A weight index that cannot be read, or names shards that are not beside it."""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{index} cannot be read as a weight index ({type(e).__name__}: {e}); copy it again"]
    absent = [shard for shard in shards if not (index.parent / shard).is_file()]
    if absent:
        return [f"{index} names shard(s) {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''} that are not in "
                f"{index.parent}; copy them there (a partial download?)"]
    return weights_file_problems([index.parent / shard for shard in shards])


def weights_file_problems(paths: list[Path], fix: str = "copy the file again") -> list[str]:
    """The .safetensors files among `paths` that are damaged or truncated, found from their headers alone (a few KB
    read per file): a header that cannot be read, or tensors that reach past the end of the file (an interrupted
    copy or download). Each names the file and `fix`."""
    problems = []
    for path in paths:
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                if size < 8 or length > size - 8:
                    raise ValueError(f"its header would need {length} bytes of a {size}-byte file")
                header = json.loads(f.read(length))
            end = 8 + length + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                                   default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            problems.append(f"{path} is damaged: its safetensors header cannot be read ({e}); {fix}")
            continue
        if end > size:
            problems.append(f"{path} is truncated: {size} bytes where its tensors need {end} (an interrupted copy or "
                            f"download?); {fix}")
    return problems


def normalize(text: str) -> str:
    """NFC, whitespace runs collapsed to one space, stripped."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def phrase_key(phrase: str) -> str:
    """The form in which phrases are compared: normalised, case-folded."""
    return normalize(phrase).casefold()


def load_mapping(path: str | Path) -> dict[str, str]:
    """Read a mapping file; ValueError naming the problem and the fix."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path} ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise ValueError(f"{path} must hold one JSON object of strings, {{\"phrase\": \"replacement\", ...}}")
    mapping: dict[str, str] = {}
    for phrase, replacement in raw.items():
        key = phrase_key(phrase)
        if not key:
            raise ValueError(f"{path}: an empty phrase {phrase!r}; remove it")
        if key in mapping:
            raise ValueError(f"{path}: phrase {phrase!r} appears twice (case and whitespace are ignored); keep one")
        mapping[key] = replacement
    return mapping


def load_blocked_terms(path: str | Path) -> list[str]:
    """Read a blocked-terms file (one term per line; blank and '#' lines skipped); ValueError if unreadable."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path} as UTF-8 text ({e})") from e
    terms = [normalize(line) for line in lines]
    return [t for t in terms if t and not t.startswith("#")]


DEFAULT_BACKGROUND = "white"  # data.alpha_background's default


def background_rgb(color: str) -> tuple[int, int, int]:
    """The (r, g, b) of a colour name or #rrggbb; ValueError naming the key and the fix."""
    try:
        return ImageColor.getrgb(color)[:3]
    except ValueError as e:
        raise ValueError(f"qwen_edit.data.alpha_background: {color!r} is not a colour; use a name such as "
                         "\"white\" or \"black\", or \"#rrggbb\"") from e
