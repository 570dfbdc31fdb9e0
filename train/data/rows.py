"""The rows of a dataset folder: metadata.jsonl (or metadata.csv) read as an editor shows it, one `Row` per line.

A row has `image` (the target), `edit_image` (one path, or a list of 1-3 for 2509/2511; in CSV several paths are
separated by ';'), `prompt` and an optional `category`; a row without `edit_image` is a text-to-image sample. Rows
without a category get one from data.category_rules (assign_categories). The checks of what the rows name are
the pre-flight's (train/data/pairs.py).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from train.config import textfile

COLUMNS = ("image", "edit_image", "prompt")
REQUIRED = ("image", "prompt")  # edit_image is left out by text-to-image rows


class BadRowsError(ValueError):
    """Rows that cannot be trained on; the message lists each with its file and the fix."""


@dataclass
class Row:
    line: int  # 1-based line of the metadata file (for CSV the header is line 1; a record's last line)
    target: str
    references: list[str]
    prompt: str
    category: str | None = None  # the `category` column, or the first matching data.category_rules entry
    # (width, height) of the target then each reference, from the image headers (set by preflight)
    sizes: list[tuple[int, int]] | None = field(default=None, compare=False, repr=False)


def _metadata_file(data_dir: Path) -> Path:
    for name in ("metadata.jsonl", "metadata.csv"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"{data_dir} has no metadata.jsonl or metadata.csv; see docs/data.md")


def _raw_records(meta: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    if meta.suffix == ".csv":
        return _csv_records(meta)
    records, problems = [], []
    try:
        numbered = textfile.lines(meta)
    except textfile.TextFileError as e:
        raise BadRowsError(str(e)) from None
    for n, text in numbered:
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(f"{meta.name} line {n}: not valid JSON ({e.msg}); write one JSON object per line")
            continue
        if not isinstance(rec, dict):
            problems.append(f"{meta.name} line {n}: expected a JSON object with keys {', '.join(COLUMNS)}")
            continue
        records.append((n, rec))
    return records, problems


def _csv_records(meta: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    """Records of a metadata.csv; a row with more fields than the header (an unquoted comma in a prompt would
    cut it) is a problem, not a shortened prompt."""
    records, problems = [], []
    try:
        textfile.read_text(meta)  # names the line of a byte that is not UTF-8
    except textfile.TextFileError as e:
        raise BadRowsError(str(e)) from None
    with open(meta, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        for rec in reader:
            extra = rec.pop(None, None)  # DictReader's restkey: the fields beyond the header's
            if extra:
                problems.append(f"{meta.name} line {reader.line_num}: {len(reader.fieldnames) + len(extra)} fields "
                                f"but the header has {len(reader.fieldnames)}; put a prompt with commas in double "
                                'quotes ("...")')
                continue
            if rec.get("edit_image"):
                rec["edit_image"] = [p.strip() for p in rec["edit_image"].split(";") if p.strip()]
            records.append((reader.line_num, rec))
    return records, problems


def read_rows(data_dir: str | Path) -> tuple[list[Row], list[str]]:
    """Parse the metadata file; returns rows and the problems with rows that could not be parsed."""
    meta = _metadata_file(Path(data_dir))
    records, problems = _raw_records(meta)
    rows = []
    for n, rec in records:
        missing = [c for c in REQUIRED if rec.get(c) in (None, "", [])]
        if missing and missing != ["prompt"]:  # an empty prompt is reported by check_row with the row's file
            problems.append(f"{meta.name} line {n}: missing {', '.join(missing)}; every row needs image and prompt "
                            "(and edit_image for an edit)")
            continue
        category = rec.get("category")
        if category is not None and not isinstance(category, str):
            problems.append(f"{meta.name} line {n}: category {json.dumps(category)} is not text; write it as a "
                            "string (or leave it empty)")
            continue
        refs = rec.get("edit_image") or []
        refs = refs if isinstance(refs, list) else [refs]
        prompt = rec.get("prompt")
        rows.append(Row(n, str(rec["image"]), [str(r) for r in refs], prompt if isinstance(prompt, str) else "",
                        (category or "").strip() or None))
    return rows, problems


def assign_categories(rows: list[Row], rules: dict[str, str]) -> list[Row]:
    """Rows without a category get the first category of `rules` whose expression matches the prompt
    (re.search, case-sensitive unless the expression says (?i)); rows matching none keep None."""
    compiled = [(name, re.compile(expr)) for name, expr in rules.items()]
    if not compiled:
        return rows
    return [row if row.category else
            replace(row, category=next((name for name, rule in compiled if rule.search(row.prompt)), None))
            for row in rows]
