"""Edits to render, as the jsonl rows of train.infer and of validation.file: parsed, checked and their references
opened (the same for every model family), and the images written."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from PIL import Image

from train.config import textfile
from train.model import family, images


@dataclass
class EditRequest:
    """One edit to render. `index` is the row's 0-based position among the file's non-blank lines."""

    index: int
    line: int  # 1-based line in the jsonl (for reports)
    references: list[Path]
    prompt: str
    seed: int
    name: str  # output file name without .png (may hold '/': a subfolder of the output directory)


def read_requests(path: str | Path, base_seed: int = 0) -> tuple[list[EditRequest], list[tuple[int, int, str]]]:
    """Parse a jsonl of edits: {"edit_image": path or [paths], "prompt": str, "seed"?: int, "output"?: str}.

    Paths are relative to the file's folder. A row without a seed gets base_seed + its index, a row without an
    output name is called by its index (000007.png). Returns the requests and (index, line, problem) for rows that
    cannot be parsed; image files are checked later by `check_request` (by the process that renders the row).
    """
    path = Path(path)
    requests, problems, names = [], [], {}
    lines = [(n, text) for n, text in textfile.lines(path) if text.strip()]
    for index, (line, text) in enumerate(lines):
        try:
            request = _parse_row(json.loads(text), index, line, path.parent, base_seed)
        except json.JSONDecodeError as e:
            problems.append((index, line, f"not valid JSON ({e.msg}); write one JSON object per line"))
            continue
        except ValueError as e:
            problems.append((index, line, str(e)))
            continue
        if request.name in names:
            problems.append((index, line, f"output name {request.name!r} is already used by line "
                                          f"{names[request.name]}; give the row its own 'output'"))
            continue
        names[request.name] = line
        requests.append(request)
    return requests, problems


def _parse_row(row, index: int, line: int, folder: Path, base_seed: int) -> EditRequest:
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object with keys edit_image, prompt (optional: seed, output)")
    refs = row.get("edit_image", [])  # none: a text-to-image row
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise ValueError("'edit_image' must be a path or a list of paths (relative to the jsonl's folder); leave it "
                         "out for text-to-image")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("empty or missing 'prompt'; write the edit instruction")
    seed = row.get("seed", base_seed + index)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"'seed' must be a non-negative integer, got {json.dumps(seed)}")
    name = row.get("output", f"{index:06d}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("'output' must be a non-empty file name")
    return EditRequest(index, line, [folder / r for r in refs], prompt, seed, output_name(name))


MAX_NAME_BYTES = 255 - len(".png")  # a file name component on Linux file systems is at most 255 bytes


def output_name(name: str) -> str:
    """The row's output name in one spelling per file ('./x', 'a//b', 'x.png' and 'x' name x / a/b), so rows that
    would write one file are found as duplicates; ValueError for a name the file system would refuse."""
    name = name[:-4] if name.lower().endswith(".png") else name
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"'output' {name!r} must be a relative name inside the output directory")
    if "\0" in name or name.endswith("/") or not path.parts or path.parts[-1] in (".", ""):
        raise ValueError(f"'output' {name!r} is not a file name; write e.g. \"edits/cat\"")
    long = [part for part in path.parts if len(part.encode()) > MAX_NAME_BYTES]
    if long:
        raise ValueError(f"'output' {name!r}: the part {long[0][:40]!r}... is longer than {MAX_NAME_BYTES} bytes, "
                         "the file system's limit; shorten it")
    return str(path)


def check_request(request: EditRequest, variant: str, area: int = 1024 * 1024, condition_area: int = 384 * 384,
                  processor=None) -> str | None:
    """Why the request cannot be rendered (a missing, undecodable or decompression-bomb image, one whose resize to
    `area` rounds a side to nothing, too many references, with the pipeline's `processor` a prompt longer than the
    transformer's text positions), or None."""
    fam = family.variant_family(variant)
    limit = fam.variant(variant).max_references
    if request.references and not limit:
        return f"has edit_image but the {variant} variant (text-to-image) takes none; remove 'edit_image'"
    if len(request.references) > limit:
        return f"{len(request.references)} edit images but the {variant} variant takes at most {limit}"
    sizes = []
    for ref in request.references:
        if not ref.is_file():
            return f"{ref}: file not found"
        try:
            size = images.decoded_size(ref)  # as open_references will read it: oriented, composited, 8-bit
        except images.ImageProblem as e:
            return f"{ref}: {e}"
        if min(fam.image_size(area, size[0], size[1], 0)) < 32:
            return (f"{ref}: {size[0]}x{size[1]} px resizes to a side below 32 px at the pipeline's area; crop it "
                    "to a less extreme aspect ratio")
        sizes.append(size)
    over = sizes and processor is not None and fam.prompt_overflow(
        processor, request.prompt, variant, sizes, area, condition_area, with_target=False)
    if over:
        return (f"the prompt takes {over[0]} text positions with its reference image(s), but next to images of this "
                f"size the transformer has {over[1]}; shorten the prompt by {over[0] - over[1]} tokens or more")
    return None


def open_references(request: EditRequest, background: str = images.DEFAULT_BACKGROUND,
                    alpha: bool = False) -> list[Image.Image]:
    """The request's references as a viewer shows them (train/model/images.py: EXIF orientation, alpha over
    `background`, 16-bit scaled), as the training data is opened; with `alpha` (a family whose pipelines read
    transparency: ModelFamily.rgba) as RGBA, their alpha kept."""
    return [images.open_image(ref, background, alpha) for ref in request.references]


def save_png_atomic(image: Image.Image, path: Path) -> None:
    """Write path via a temporary file and a rename, so a killed run never leaves a truncated PNG behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
