"""The validation grid: one row per edit under its prompt, its references then one cell per named column."""

from __future__ import annotations

import itertools

from PIL import Image, ImageDraw

from train.model import images

CAPTION = 14  # px of a prompt line above a row of a grid


def caption_lines(text: str, width: int) -> list[str]:
    """`text` broken at spaces into lines no wider than `width` px in Pillow's default font (a longer word stays
    whole), so that a long prompt is read in full rather than cut at the grid's edge."""
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def make_grid(references: list[list[Image.Image]], columns: dict[str, list[Image.Image | None]],
              prompts: list[str] | None = None) -> Image.Image:
    """One row per edit: its references, then one cell per named column (None = an empty cell); a header line
    naming the columns, and with `prompts` each row's prompt above it (wrapped to the grid's width)."""
    cells = [im for col in columns.values() for im in col if im is not None]
    cell_w, cell_h = max(im.width for im in cells), max(im.height for im in cells)
    num_refs, header = max(len(r) for r in references), 16
    names = ["reference"] if num_refs == 1 else [f"reference {i + 1}" for i in range(num_refs)]
    names += list(columns)
    width = cell_w * len(names)
    captions = [caption_lines(p, width - 4) for p in prompts] if prompts else [[] for _ in references]
    tops = list(itertools.accumulate((CAPTION * len(c) + cell_h for c in captions), initial=header))  # row tops
    grid = Image.new("RGB", (width, tops[-1]), "white")
    draw = ImageDraw.Draw(grid)
    for j, name in enumerate(names):
        draw.text((j * cell_w + 2, 2), name, fill="black")
    for i, refs in enumerate(references):
        for k, line in enumerate(captions[i]):
            draw.text((2, tops[i] + k * CAPTION + 1), line, fill=(60, 60, 60))
        top = tops[i] + CAPTION * len(captions[i])
        row = list(refs) + [None] * (num_refs - len(refs)) + [col[i] for col in columns.values()]
        for j, im in enumerate(row):
            if im is not None:
                fitted = images.to_rgb(im)  # an RGBA render (Qwen-Image-2.1) over white, as a viewer shows it
                fitted.thumbnail((cell_w, cell_h))
                grid.paste(fitted, (j * cell_w + (cell_w - fitted.width) // 2, top))
    return grid

