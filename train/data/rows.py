"""The rows of a dataset folder: metadata.jsonl (or metadata.csv) read as an editor shows it, one `Row` per line.

A row has `image` (the target), `edit_image` (one path, or a list of 1-3 for 2509/2511; in CSV several paths are
separated by ';'), `prompt` and an optional `category`; a row without `edit_image` is a text-to-image sample. Rows
without a category get one from data.category_rules (assign_categories). The checks of what the rows name are
the pre-flight's (train/data/pairs.py).
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from train.config import textfile

COLUMNS = ("image", "edit_image", "prompt")
KNOWN_COLUMNS = (*COLUMNS, "category")
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


def _raw_records(meta: Path) -> tuple[list[tuple[int, dict]], list[str], list[str] | None]:
    """(records by line, problems of lines that are no record, the CSV header or None)."""
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
    return records, problems, None


def _csv_records(meta: Path) -> tuple[list[tuple[int, dict]], list[str], list[str] | None]:
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
        header = list(reader.fieldnames or [])
    return records, problems, header


def _lines(numbers: list[int], limit: int = 5) -> str:
    """'line 3', 'lines 1, 2, 5' or 'lines 1, 2, 3, 4, 5 and 8 more'."""
    shown = ", ".join(map(str, numbers[:limit])) + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")
    return f"line{'s' if len(numbers) > 1 else ''} {shown}"


def column_problems(meta: Path, records: list[tuple[int, dict]], ignored: tuple[str, ...] = (),
                    header: list[str] | None = None) -> list[str]:
    """The columns (CSV header, JSONL keys) that are not KNOWN_COLUMNS or `ignored` (data.ignore_columns), each named
    once with the known column it is closest to, and the required columns that no row has: a misspelt column would
    otherwise read as missing on every row, or its rows train as something else (a reference column spelt wrong:
    text-to-image samples)."""
    where: dict[str, list[int]] = {}
    for n, rec in records:
        for key in rec:
            where.setdefault(key, []).append(n)
    for key in header or []:
        where.setdefault(key, [1])  # a CSV header names its columns once, on line 1
    problems, suggested = [], set()
    for key, lines in where.items():
        if key in KNOWN_COLUMNS or key in ignored:
            continue
        near = difflib.get_close_matches(key, KNOWN_COLUMNS, n=1, cutoff=0.6)
        suggested.update(near)
        hint = f"did you mean {near[0]!r}? " if near else ""
        found = "in the header" if header is not None else f"in {len(lines)} row(s) ({_lines(lines)})"
        problems.append(f"{meta.name}: unknown column {key!r} {found}; {hint}the known columns are "
                        f"{', '.join(KNOWN_COLUMNS)}. Rename it, or list it in qwen_edit.data.ignore_columns to "
                        "leave it unread")
    absent = [key for key in REQUIRED if key not in where and key not in suggested]  # a suggestion names it already
    if records or header:
        where_absent = "the header has no" if header is not None else "no row has the"
        problems += [f"{meta.name}: {where_absent} column {key!r}; every row needs image and prompt"
                     for key in absent]
    return problems


def read_rows(data_dir: str | Path, ignored: tuple[str, ...] = ()) -> tuple[list[Row], list[str]]:
    """Parse the metadata file; returns rows and the problems with rows that could not be parsed. Columns it does
    not know (column_problems; `ignored`: data.ignore_columns) stop it at once: BadRowsError naming each."""
    meta = _metadata_file(Path(data_dir))
    records, problems, header = _raw_records(meta)
    columns = column_problems(meta, records, tuple(ignored), header)
    if columns:
        raise BadRowsError(f"{len(columns)} problem(s) with the columns of {meta}:\n" + "\n".join(columns))
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


def check_references(rows: list[Row], variant: str, choice: str, text_to_image: bool = False) -> str | None:
    """Rows without edit_image on an edit model: BadRowsError naming them unless `choice`
    (data.rows_without_reference) is "text_to_image", and then the line that counts them; None when every row has
    a reference, or the model generates from text alone too (`text_to_image`: Qwen-Image, Qwen-Image-2.1)."""
    without = [row.line for row in rows if not row.references]
    if not without or text_to_image:
        return None
    if choice == "stop":
        raise BadRowsError(f"{len(without)} of {len(rows)} rows have no edit_image ({_lines(without)}), but the "
                           f"{variant} variant is an edit model: give them their reference images in edit_image, "
                           "or set qwen_edit.data.rows_without_reference to \"text_to_image\" to train them as "
                           "text-to-image samples")
    return (f"data: {len(without)} of {len(rows)} rows have no edit_image: trained as text-to-image samples "
            "(data.rows_without_reference; no reference, the text-to-image pipeline's prompt template)")


def fingerprint(rows: list[Row]) -> dict:
    """What a checkpoint records of the rows it trained on, for a resume to compare: their number and a digest of
    each row's line, files, prompt, category and image sizes (after prompt processing, as the loader deals them)."""
    listed = [[r.line, r.target, r.references, r.prompt, r.category, r.sizes] for r in rows]
    return {"rows": len(rows), "digest": hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]}


def assign_categories(rows: list[Row], rules: dict[str, str]) -> list[Row]:
    """Rows without a category get the first category of `rules` whose expression matches the prompt
    (re.search, case-sensitive unless the expression says (?i)); rows matching none keep None."""
    compiled = [(name, re.compile(expr)) for name, expr in rules.items()]
    if not compiled:
        return rows
    return [row if row.category else
            replace(row, category=next((name for name, rule in compiled if rule.search(row.prompt)), None))
            for row in rows]
