"""Readers of the side files a config names (the prompt mapping, the blocked terms, the validation jsonl) and of
config values with a syntax of their own (colours). Each reports a problem with the file, line and fix.
"""

from __future__ import annotations

import json
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
