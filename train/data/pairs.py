"""Edit pairs from a folder: metadata.jsonl (or .csv) + images; pre-flight row checks; loader.

A row has `image` (the target), `edit_image` (one path, or a list of 1-3 for 2509/2511; in CSV several paths are
separated by ';') and `prompt`; a row without `edit_image` is a text-to-image sample (the t2i variant's only kind;
an edit model trains on it without a reference). Paths are relative to the data folder. Every row is checked before
training (each rank checks a strided share, the reports are gathered); bad rows stop the run with a report naming
each row and file, or are skipped and counted when data.bad_rows = "skip". Nothing is dropped silently.
Pairs whose reference cannot land pixel for pixel on the target's resized lattice are named too (they train:
a reframing edit is legitimate), all of them in misaligned_rows.txt next to the report (train/data/alignment.py).

Before the checks, prompts are processed (train/data/prompts.py: normalised, mapped, blocked rows dropped or kept)
and rows without a `category` value get one from data.category_rules. The loader's batch sampler
(train/data/sampling.py) groups samples into shape buckets and balances categories.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import datasets
import torch
from PIL import Image
from torch.utils.data import DataLoader

from train.data import alignment, prompts, sampling
from train.data.rows import BadRowsError, Row, assign_categories, read_rows
from train.model import family, images
from train.model.interface import ModelFamily
from train.runtime import engine
from train.runtime.console import print0


def image_sizes(data_dir: Path, names: list[str]) -> list[tuple[int, int]]:
    """(width, height) of each image as shown (after its EXIF orientation), read from its header (nothing is
    decoded)."""
    return [images.shown_size(data_dir / name) for name in names]


def check_row(row: Row, data_dir: Path, variant: str) -> list[str]:
    """Problems of one row, each naming the row, the file and the fix."""
    where = f"row {row.line}"
    problems = []
    if not row.prompt.strip():
        problems.append(f"{where} ({row.target}): empty or non-text prompt; write the edit instruction in 'prompt'")
    fam = family.variant_family(variant)
    limit = fam.variant(variant).max_references
    if row.references and not limit:
        problems.append(f"{where} ({row.target}): has edit_image but the {variant} variant (text-to-image) takes no "
                        "reference; remove 'edit_image' or train an edit model")
    elif len(row.references) > limit:
        problems.append(f"{where} ({row.target}): {len(row.references)} edit images but the {variant} variant takes "
                        f"at most {limit}; keep at most {limit} in 'edit_image' or remove the row")
    for name in [row.target, *row.references]:
        issue = images.file_problem(data_dir / name, fam.rgba)
        if issue:
            problems.append(f"{where} ({name}): {issue}")
    return problems


def gather_lists(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (a collective when a group is up)."""
    return [x for part in engine.all_gather_objects(items) for x in part]


def aspect_steps(bucket_aspect_steps: int, micro_batch_size: int, buckets: bool) -> int:
    """The aspect-ratio grid images are sized on (the family's image_size): data.bucket_aspect_steps where
    micro-batches stack several samples of one shape bucket, else 0, the pipelines' own sizes (a micro-batch of
    one needs no shared shape)."""
    return bucket_aspect_steps if buckets and micro_batch_size > 1 else 0


def size_problems(row: Row, sizes: list[tuple[int, int]], variant: str, area: int | None,
                  condition_area: int | None, steps: int = 0) -> list[str]:
    """Images whose resize for training (to `area`, aspect ratio snapped by `steps`; the VL copies of references
    that the variant makes, to `condition_area`) rounds a side to 0 px: the pipelines' rounding (Qwen-Image: to
    multiples of 32) leaves nothing of a very thin strip."""
    fam = family.variant_family(variant)
    problems = []
    for k, (name, (width, height)) in enumerate(zip([row.target, *row.references], sizes, strict=True)):
        resizes = []
        if area is not None:
            resizes.append((f"data.area = {area}", fam.image_size(area, width, height, steps)))
        condition = k and condition_area is not None and fam.condition_size(variant, condition_area, width, height,
                                                                             steps)
        if condition:
            resizes.append((f"data.condition_area = {condition_area}", condition))
        for where, (w, h) in resizes:
            if min(w, h) <= 0:
                problems.append(f"row {row.line} ({name}): {width}x{height} px resizes to {w}x{h} at {where}; "
                                "crop it to a less extreme aspect ratio or remove the row")
    return problems


def prompt_problems(row: Row, sizes: list[tuple[int, int]], variant: str, area: int, condition_area: int,
                    tokens, steps: int = 0) -> list[str]:
    """A prompt longer than the transformer's rotary embedding has positions for next to this row's images (its
    forward would fail at the step that draws the row); `tokens` is the family's prompt_tokenizer of the model."""
    if not row.references:
        return []  # text-to-image prompts are truncated to the pipeline's length, as the pipelines do
    over = family.variant_family(variant).prompt_overflow(tokens, row.prompt, variant, sizes, area, condition_area,
                                                          aspect_steps=steps)
    if over is None:
        return []
    length, room = over
    return [f"row {row.line} ({row.target}): the prompt takes {length} text positions with its reference image(s), "
            f"but next to images of this size the transformer has {room}; shorten the prompt by "
            f"{length - room} tokens or more, or remove the row"]


def _inspect(row: Row, data_dir: Path, variant: str, area: int | None = None, condition_area: int | None = None,
             tokens=None, steps: int = 0
             ) -> tuple[int, list[str], list[tuple[int, int]] | None]:
    problems = check_row(row, data_dir, variant)
    if problems:
        return row.line, problems, None
    sizes = image_sizes(data_dir, [row.target, *row.references])
    problems = size_problems(row, sizes, variant, area, condition_area, steps)
    if not problems and tokens is not None and area and condition_area:
        problems = prompt_problems(row, sizes, variant, area, condition_area, tokens, steps)
    check = family.variant_family(variant).image_problems
    if not problems and tokens is not None and area and check is not None:
        names = [row.target, *row.references]
        problems = [f"row {row.line} ({names[k]}): {why}" for k, why in check(tokens, sizes, area, steps)]
    return row.line, problems, None if problems else sizes


def preflight(data_dir: str | Path, variant: str, policy: str, rank: int = 0, world_size: int = 1,
              report_path: Path | None = None, processor: prompts.PromptProcessor | None = None,
              category_rules: dict[str, str] | None = None, area: int | None = None,
              condition_area: int | None = None, tokens=None, steps: int = 0, ignored: tuple = ()) -> list[Row]:
    """Read the rows (columns other than the known and the `ignored` ones, data.ignore_columns, stop it: BadRowsError),
    process the prompts (`processor`, whose `report` then holds the counts), assign categories from
    `category_rules`, then check every row (each rank a strided share; with `area`/`condition_area` also that
    the resized images, aspect ratios snapped by `steps` (`aspect_steps`), keep both sides, and with `tokens`,
    the family's prompt_tokenizer, that the prompt fits the transformer's text positions); stop or skip per
    `policy`. Same result on every rank: the good rows, with their image sizes.
    """
    data_dir = Path(data_dir)
    rows, problems = read_rows(data_dir, ignored)
    num_unparsed = len(problems)
    if processor is not None:
        num_read, rows = len(rows), processor.apply(rows)
        if num_read and not rows:
            raise BadRowsError(f"all {num_read} rows in {data_dir} have a blocked term (data.blocked_terms); "
                               "shorten the list, or set qwen_edit.data.blocked_policy to \"keep\"")
    rows = assign_categories(rows, category_rules or {})
    mine = [_inspect(row, data_dir, variant, area, condition_area, tokens, steps) for row in rows[rank::world_size]]
    checked = {line: (issues, sizes) for line, issues, sizes in gather_lists(mine)}
    problems += [p for line in sorted(checked) for p in checked[line][0]]
    good = []
    for row in rows:
        issues, sizes = checked.get(row.line, ([], None))  # without a process group other ranks' rows are unchecked
        if not issues:
            good.append(replace(row, sizes=sizes))
    if problems:
        report = "\n".join(problems)
        if report_path is not None and rank == 0:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(report + "\n")
        if policy == "stop" or not good:
            tail = "" if good else " (no usable rows left)"
            raise BadRowsError(
                f"{len(problems)} problem(s) in {data_dir}{tail}:\n{report}\n"
                "Fix the rows, or set qwen_edit.data.bad_rows to \"skip\" to train without them."
            )
        num_skipped = len(rows) - len(good) + num_unparsed
        where = f"listed in {report_path}" if report_path is not None else "not written (no report path)"
        print0(f"data: bad_rows = \"skip\": {num_skipped} of {len(rows) + num_unparsed} rows left out "
               f"({len(problems)} problem(s), {where}); {len(good)} rows train", rank=rank)
    alignment.report_alignment(alignment.misaligned(good, family.variant_family(variant), area, steps),
                               report_path, rank)
    return good


class EditDataset(torch.utils.data.Dataset):
    """Yields one edit pair resized as the variant's pipelines do (its family's sample_images), each image first
    cropped to its aspect ratio snapped by `steps` (`aspect_steps`); images are opened as a viewer shows them
    (train/model/images.py: EXIF orientation, alpha over `background`, 16-bit scaled)."""

    def __init__(self, data_dir: str | Path, rows: list[Row], variant: str, area: int, condition_area: int,
                 background: str = images.DEFAULT_BACKGROUND, steps: int = 0):
        self.data_dir, self.background, self.steps = Path(data_dir), background, steps
        # Arrow-backed, so workers share the table instead of pickling Python lists.
        self.table = datasets.Dataset.from_list([
            {"line": r.line, "image": r.target, "edit_image": r.references, "prompt": r.prompt,
             "category": r.category, "sizes": r.sizes} for r in rows
        ])
        self.variant, self.area, self.condition_area = variant, area, condition_area

    @property
    def family(self) -> ModelFamily:
        return family.variant_family(self.variant)  # looked up, not held: a DataLoader worker may unpickle `self`

    def __len__(self) -> int:
        return len(self.table)

    def _column(self, name: str) -> list:
        return self.table.data.column(name).to_pylist()

    def _latent_hw(self, width: int, height: int) -> tuple[int, int]:
        w, h = self.family.image_size(self.area, width, height, self.steps)
        return h // self.family.pixels_per_latent, w // self.family.pixels_per_latent

    def bucket_keys(self) -> list[tuple[tuple[int, int], ...]]:
        """Per sample: latent (h, w) of the target, then of each reference's VAE copy, as the pipelines size them
        (from the image sizes preflight read from the headers; rows built without them are read here)."""
        names = zip(self._column("image"), self._column("edit_image"), self._column("sizes"), strict=True)
        return [tuple(self._latent_hw(*size) for size in sizes or image_sizes(self.data_dir, [target, *refs]))
                for target, refs, sizes in names]

    def categories(self) -> list[str | None]:
        return self._column("category")

    def _open(self, name: str, line: int) -> Image.Image:
        try:
            return images.open_rgb(self.data_dir / name, self.background, keep_alpha=self.family.rgba)
        except OSError as e:  # checked before training, so the file changed since
            raise BadRowsError(f"row {line} ({name}): cannot be read any more ({e})") from e

    def __getitem__(self, i: int) -> dict:
        rec = self.table[i]
        target = self._open(rec["image"], rec["line"])
        refs = [self._open(name, rec["line"]) for name in rec["edit_image"]]
        sample = self.family.sample_images(target, refs, self.variant, self.area, self.condition_area, self.steps)
        return {**sample, "prompt": rec["prompt"], "line": rec["line"]}


def collate(samples: list[dict]) -> dict:
    """Stack a micro-batch; every sample must share the target and reference sizes."""
    def stack(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            lines = [s["line"] for s in samples]
            raise ValueError(
                f"micro-batch of rows {lines} mixes {what} sizes {sorted(shapes)}; use "
                "train_micro_batch_size_per_gpu = 1 or data.buckets = true"
            )
        return torch.stack(tensors)

    counts = {len(s["reference_pixels"]) for s in samples}
    if len(counts) > 1:
        raise ValueError(f"micro-batch of rows {[s['line'] for s in samples]} mixes reference counts {sorted(counts)}")
    num_refs = counts.pop()
    return {
        "target": stack([s["target"] for s in samples], "target"),
        "reference_pixels": [stack([s["reference_pixels"][k] for s in samples], f"reference {k + 1}")
                             for k in range(num_refs)],
        "vl_images": [s["vl_images"] for s in samples],
        "prompts": [s["prompt"] for s in samples],
        "lines": [s["line"] for s in samples],
    }


def _die_with_parent(worker_id: int) -> None:
    """DataLoader worker init: ask Linux to SIGKILL this worker when its rank dies (e.g. is killed), so no
    orphaned worker outlives a failed job holding memory; a no-op elsewhere. SIGTERM is left to the rank (it saves
    a checkpoint first, train/runtime/preempt.py): DeepSpeed's launcher signals the whole process tree, and a worker
    that died of it would fail the rank's next batch before the save."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.getppid() != parent:  # the rank died before the request took effect
        os._exit(1)


def build_loader(dataset: EditDataset, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 num_workers: int, pin_memory: bool, shuffle: bool, collate_fn=collate, buckets: bool = True,
                 category_weights: dict[str, float] | None = None, bucket_fill: bool = False) -> DataLoader:
    """Micro-batches of this rank's share; `collate_fn` stacks them (train.cache passes its own).

    The batch sampler (train/data/sampling.py) keeps each micro-batch inside one shape bucket (`buckets`, from
    dataset.bucket_keys()), completes bucket remainders with repeats when `bucket_fill`, and draws categories by
    `category_weights` (dataset.categories()) when given.
    """
    if len(dataset) < micro_batch_size * world_size:
        raise BadRowsError(
            f"{len(dataset)} usable rows cannot fill one micro-batch of {micro_batch_size} on each of {world_size} "
            "ranks; add rows or lower train_micro_batch_size_per_gpu"
        )
    keys = dataset.bucket_keys() if buckets else [None] * len(dataset)
    categories = dataset.categories() if category_weights else None
    try:
        batches = sampling.BucketBatchSampler(keys, micro_batch_size, rank, world_size, seed, shuffle, categories,
                                              category_weights, fill=bucket_fill)
    except sampling.SamplingError as e:
        raise BadRowsError(str(e)) from e
    return DataLoader(
        dataset, batch_sampler=batches, num_workers=num_workers, collate_fn=collate_fn,
        pin_memory=pin_memory and torch.cuda.is_available(), persistent_workers=num_workers > 0,
        worker_init_fn=_die_with_parent,
    )


def sampling_summary(sampler: sampling.BucketBatchSampler, rows: list[Row], limit: int = 10) -> str:
    """The sampler's log line, then the rows it can never draw (each by line and target), why, and the fixes."""
    reasons = [
        (sampler.too_small(), f"their shape bucket has fewer rows than a micro-batch of {sampler.micro_batch_size}",
         "set qwen_edit.data.bucket_fill = true (remainders completed with repeats), lower "
         "qwen_edit.data.bucket_aspect_steps (coarser aspect-ratio buckets: more rows share one), add rows of their "
         "shape, or lower train_micro_batch_size_per_gpu"),
        (sampler.unshared(), "their category's share of an epoch rounds to 0 micro-batches",
         "raise their category's weight in qwen_edit.data.category_weights"),
    ]
    lines = [sampler.summary()]
    for never, why, fix in reasons:
        if never:
            named = [f"row {rows[i].line} ({rows[i].target})" for i in never[:limit]]
            more = f", and {len(never) - limit} more" if len(never) > limit else ""
            lines.append(f"sampling: {len(never)} row(s) are never drawn: {why}: {', '.join(named)}{more}. "
                         f"To train them, {fix}")
    return "\n".join(lines)
