"""Tests for train/data/pairs.py: every bad-row kind and its message, stop/skip policies, CSV, dataset, collate, loader.

Each test builds a tiny dataset in tmp_path (64x64 PNGs); the bad row is usually line 2, after a good line 1, so
that a message naming "row 2" / "line 2" proves the number is the row's own 1-based line.
"""

from __future__ import annotations

import functools
import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from train.data import alignment
from train.data.pairs import (
    BadRowsError,
    EditDataset,
    Row,
    build_loader,
    check_row,
    collate,
    preflight,
    read_rows,
)
from train.model import family
from train.model.qwen_image import conditioning

misfit = functools.partial(alignment.misfit, fam=family.family_named("qwen_image"))  # on Qwen-Image's sizes

AREA = 64 * 64
CONDITION_AREA = 32 * 32
FIELDS = "image, edit_image, prompt"


def png(path: Path, size: tuple[int, int] = (64, 64), seed: int = 0) -> None:
    """Write an RGB noise PNG of `size` (width, height)."""
    rng = random.Random(seed)
    Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))).save(path)


def good(tmp: Path, i: int, refs: int = 1) -> dict:
    """A valid row i (its target and references written as 64x64 PNGs)."""
    names = [f"t{i}.png"] + [f"r{i}_{k}.png" for k in range(refs)]
    for k, name in enumerate(names):
        png(tmp / name, seed=10 * i + k)
    return {"image": names[0], "edit_image": names[1] if refs == 1 else names[1:], "prompt": f"edit number {i}"}


def write_jsonl(tmp: Path, lines: list) -> Path:
    """metadata.jsonl from dicts (dumped) and raw strings (written as they are)."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    (tmp / "metadata.jsonl").write_text(text + "\n")
    return tmp


def stop_message(tmp: Path, variant: str = "edit", **kw) -> str:
    """The BadRowsError message of preflight with policy "stop"."""
    with pytest.raises(BadRowsError) as e:
        preflight(tmp, variant, "stop", **kw)
    return str(e.value)


def truncated_png(path: Path) -> None:
    buf = io.BytesIO()
    Image.frombytes("RGB", (64, 64), random.Random(1).randbytes(64 * 64 * 3)).save(buf, "PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


FILE_CASES = {
    "missing": (None, "nothere.png", ["file not found", "fix the path"]),
    "zero_byte": (lambda p: p.write_bytes(b""), "empty.png", ["file is empty (0 bytes)", "re-export the image"]),
    "random_bytes": (lambda p: p.write_bytes(random.Random(0).randbytes(500)), "noise.png",
                     ["cannot be decoded", "re-save it as PNG/JPEG"]),
    "truncated_png": (truncated_png, "cut.png", ["cannot be decoded", "truncated", "re-save it as PNG/JPEG"]),
}  # 16-bit and float images are converted (tests/test_images.py)


@pytest.mark.parametrize("slot", ["image", "edit_image"])
@pytest.mark.parametrize("case", FILE_CASES.values(), ids=FILE_CASES.keys())
def test_bad_file_names_row_file_and_fix(tmp_path, case, slot):
    """A missing, empty or corrupt target or reference is one problem naming row, file and fix."""
    make, name, fragments = case
    if make:
        make(tmp_path / name)
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1), {**good(tmp_path, 2), slot: name}]))
    assert msg.startswith(f"1 problem(s) in {tmp_path}:")
    assert f"row 2 ({name}): " in msg and all(f in msg for f in fragments), msg
    assert 'set qwen_edit.data.bad_rows to "skip"' in msg


def test_too_large_image_is_reported_not_raised(tmp_path, monkeypatch):
    """An image over Pillow's decompression-bomb limit is a reported problem, not a crash in preflight."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is over twice this: DecompressionBombError
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1)]))
    assert "row 1 (t1.png): too large" in msg and "downscale it" in msg


@pytest.mark.parametrize("prompt", ["", "  \t ", None, 123, ["a list"], "<absent>"])
def test_bad_prompt_names_row_target_and_fix(tmp_path, prompt):
    """An empty, blank, absent or non-string prompt is reported with the row's target and the fix."""
    row = good(tmp_path, 2)
    if prompt == "<absent>":
        del row["prompt"]
    else:
        row["prompt"] = prompt
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1), row]))
    assert "1 problem(s)" in msg
    assert "row 2 (t2.png): empty or non-text prompt; write the edit instruction in 'prompt'" in msg


@pytest.mark.parametrize("variant, refs, limit", [("edit", 2, 1), ("edit_plus", 4, 3)])
def test_too_many_references(tmp_path, variant, refs, limit):
    """More references than the variant takes names the row, the count, the limit and the fix."""
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1), good(tmp_path, 2, refs=refs)]), variant)
    assert "1 problem(s)" in msg
    assert f"row 2 (t2.png): {refs} edit images but the {variant} variant takes at most {limit}" in msg
    assert f"keep at most {limit} in 'edit_image'" in msg


@pytest.mark.parametrize("variant, refs", [("edit", 1), ("edit_plus", 1), ("edit_plus", 3), ("edit_plus_2511", 3),
                                           ("t2i", 0), ("edit", 0), ("edit_plus", 0)])
def test_allowed_reference_counts_pass(tmp_path, variant, refs):
    """Up to the variant's limit of references is fine; a clean dataset returns every row and writes no report."""
    report = tmp_path / "out" / "bad_rows.txt"
    rows = preflight(write_jsonl(tmp_path, [good(tmp_path, 1, refs)]), variant, "stop", report_path=report)
    assert [(r.line, len(r.references)) for r in rows] == [(1, refs)] and not report.exists()


@pytest.mark.parametrize("edit_image", [None, "", []], ids=["absent", "empty", "empty_list"])
def test_row_without_edit_image_is_text_to_image(tmp_path, edit_image):
    """No edit_image (absent, "" or []): a row with no reference; its sample has no reference pixels or VL images,
    and such samples collate into a micro-batch without reference slots."""
    rows = [{**good(tmp_path, i, refs=0), **({} if edit_image is None else {"edit_image": edit_image})}
            for i in (1, 2)]
    got = preflight(write_jsonl(tmp_path, rows), "edit", "stop")
    assert [r.references for r in got] == [[], []]
    ds = dataset(tmp_path, "edit", rows)
    batch = collate([ds[0], ds[1]])
    assert batch["reference_pixels"] == [] and batch["vl_images"] == [[], []]
    assert batch["target"].shape[0] == 2 and ds.bucket_keys()[0] == ((8, 8),)


def test_text_to_image_variant_refuses_references(tmp_path):
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1, refs=0), good(tmp_path, 2)]), "t2i")
    assert "row 2 (t2.png): has edit_image but the t2i variant (text-to-image) takes no reference" in msg


PARSE_CASES = {
    "malformed_json": ('{"image": "t.png", ', ["not valid JSON", "write one JSON object per line"]),
    "not_an_object": ("[1, 2, 3]", [f"expected a JSON object with keys {FIELDS}"]),
    "string_line": ('"just text"', [f"expected a JSON object with keys {FIELDS}"]),
    "missing_image": ({"edit_image": "r.png", "prompt": "p"}, ["missing image", "every row needs image and prompt"]),
    "missing_both": ({"edit_image": "r.png"}, ["missing image, prompt;"]),
}


@pytest.mark.parametrize("case", PARSE_CASES.values(), ids=PARSE_CASES.keys())
def test_unparsable_line_names_line_and_fix(tmp_path, case):
    """Malformed JSON, a non-object line or a missing column names the file, the line and the fix."""
    line, fragments = case
    msg = stop_message(write_jsonl(tmp_path, [good(tmp_path, 1), line]))
    assert "1 problem(s)" in msg and "metadata.jsonl line 2: " in msg and all(f in msg for f in fragments), msg


def test_blank_lines_are_skipped_but_counted(tmp_path):
    """Blank lines are ignored, and the numbers of later rows stay their file line numbers."""
    rows, problems = read_rows(write_jsonl(tmp_path, ["", good(tmp_path, 1), "   ", good(tmp_path, 2)]))
    assert [r.line for r in rows] == [2, 4] and problems == []


def write_mixed(tmp: Path) -> Path:
    """Rows: 1 good; 2 missing reference; 3 malformed JSON; 4 empty prompt and zero-byte target; 5 good."""
    bad4 = {**good(tmp, 4), "prompt": " "}
    (tmp / "t4.png").write_bytes(b"")
    return write_jsonl(tmp, [good(tmp, 1), {**good(tmp, 2), "edit_image": "gone.png"}, "{oops", bad4, good(tmp, 5)])


MIXED_PROBLEMS = ["metadata.jsonl line 3: not valid JSON", "row 2 (gone.png): file not found",
                  "row 4 (t4.png): empty or non-text prompt", "row 4 (t4.png): file is empty (0 bytes)"]


def test_stop_lists_every_problem_in_one_error_and_writes_report(tmp_path):
    """With "stop", all problems of all rows come in one BadRowsError, and the same list goes to the report."""
    report = tmp_path / "logs" / "bad_rows.txt"
    msg = stop_message(write_mixed(tmp_path), report_path=report)
    assert msg.startswith(f"4 problem(s) in {tmp_path}:") and all(p in msg for p in MIXED_PROBLEMS)
    lines = report.read_text().splitlines()
    assert len(lines) == 4 and all(any(p in line for line in lines) for p in MIXED_PROBLEMS)


def test_skip_keeps_exactly_the_good_rows_and_writes_report(tmp_path, capsys):
    """With "skip", the good rows come back in order, the report lists every skipped problem, and the console says
    how many rows were left out and where the report is."""
    report = tmp_path / "logs" / "bad_rows.txt"
    rows = preflight(write_mixed(tmp_path), "edit", "skip", report_path=report)
    assert (f'data: bad_rows = "skip": 3 of 5 rows left out (4 problem(s), listed in {report}); 2 rows train'
            in capsys.readouterr().out)
    assert [(r.line, r.target, r.references, r.prompt) for r in rows] == [
        (1, "t1.png", ["r1_0.png"], "edit number 1"), (5, "t5.png", ["r5_0.png"], "edit number 5")]
    text = report.read_text()
    assert len(text.splitlines()) == 4 and all(p in text for p in MIXED_PROBLEMS)


def test_training_prints_the_skipped_count_and_report_path(tiny_edit, tmp_path, capsys):
    """Where training skips rows (train.trainer.build.build_data, also behind train.cache and model_parallel):
    with data.bad_rows "skip" the console says how many rows were left out of how many and names
    OUTPUT/bad_rows.txt, which lists each one; the rest train."""
    import shutil

    from conftest import write_config

    from train import config
    from train.runtime import engine
    from train.trainer import build

    data = tmp_path / "data"
    shutil.copytree(tiny_edit / "data", data)
    meta = data / "metadata.jsonl"
    records = [json.loads(line) for line in meta.read_text().splitlines()][:9]
    for k in range(7):  # 7 of 9 rows bad, as in the issue: 4 missing targets, 3 empty prompts
        records[k].update({"image": f"missing{k}.png"} if k < 4 else {"prompt": " "})
    meta.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = write_config(tmp_path / "cfg.json", **{"qwen_edit.data.num_workers": 0,
                                                  "qwen_edit.data.bad_rows": "skip"})
    out = tmp_path / "out"
    args = config.parse_args(["--ds_config", str(path), "--model", str(tiny_edit / "model"), "--data", str(data),
                              "--output_dir", str(out)])
    cfg = config.load_config(args, 1, has_gpu=False)
    world = engine.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    rows, _ = build.build_data(cfg, world, "edit")
    console = capsys.readouterr().out
    report = out / "bad_rows.txt"
    assert (f'data: bad_rows = "skip": 7 of 9 rows left out (7 problem(s), listed in {report}); 2 rows train'
            in console), console
    assert [r.line for r in rows] == [8, 9] and len(report.read_text().splitlines()) == 7


def test_skip_with_no_usable_rows_raises(tmp_path):
    """With "skip", a dataset whose every row is bad still raises, saying no rows are left."""
    write_jsonl(tmp_path, [{**good(tmp_path, 1), "prompt": ""}, "not json"])
    with pytest.raises(BadRowsError, match=r"2 problem\(s\) in .* \(no usable rows left\)"):
        preflight(tmp_path, "edit", "skip")


def test_no_metadata_file(tmp_path):
    """A folder without metadata names the folder and the expected files."""
    with pytest.raises(FileNotFoundError, match="has no metadata.jsonl or metadata.csv"):
        read_rows(tmp_path)


def test_csv_semicolon_references(tmp_path):
    """metadata.csv splits edit_image on ';', keeps quoted commas, and numbers rows by file line (header = 1)."""
    for i in (1, 2):
        good(tmp_path, i, refs=2)
    (tmp_path / "metadata.csv").write_text(
        'image,edit_image,prompt\nt1.png,r1_0.png; r1_1.png ;,"red, then blue"\nt2.png,r2_0.png,second\n')
    rows, problems = read_rows(tmp_path)
    assert problems == [] and rows == [Row(2, "t1.png", ["r1_0.png", "r1_1.png"], "red, then blue"),
                                       Row(3, "t2.png", ["r2_0.png"], "second")]
    assert preflight(tmp_path, "edit_plus", "stop") == rows
    assert "row 2 (t1.png): 2 edit images but the edit variant" in stop_message(tmp_path, "edit")


def test_csv_missing_column_names_file_line(tmp_path):
    """A CSV row with an empty image cell names metadata.csv and its file line."""
    good(tmp_path, 1)
    (tmp_path / "metadata.csv").write_text("image,edit_image,prompt\nt1.png,r1_0.png,ok\n,r1_0.png,no target\n")
    assert "metadata.csv line 3: missing image" in stop_message(tmp_path)


def rename(row: dict, old: str, new: str) -> dict:
    return {new if k == old else k: v for k, v in row.items()}


@pytest.mark.parametrize("misspelt, known", [("edit_imgae", "edit_image"), ("promt", "prompt"), ("imgae", "image")])
def test_a_misspelt_jsonl_key_is_named_once_with_the_known_one(tmp_path, misspelt, known):
    """A key no row should have stops the pre-flight with one problem naming it, the rows that have it and the
    column it is closest to: not a problem per row ('missing image', 'empty prompt'), and not an edit model's rows
    read as rows without a reference."""
    rows = [rename(good(tmp_path, i), known, misspelt) for i in (1, 2, 3)]
    msg = stop_message(write_jsonl(tmp_path, rows))
    assert msg.startswith(f"1 problem(s) with the columns of {tmp_path / 'metadata.jsonl'}:\n"), msg
    assert (f"metadata.jsonl: unknown column {misspelt!r} in 3 row(s) (lines 1, 2, 3); did you mean {known!r}? "
            "the known columns are image, edit_image, prompt, category. Rename it, or list it in "
            "qwen_edit.data.ignore_columns to leave it unread") in msg


@pytest.mark.parametrize("header, problems", [
    ("image,edit_imge,prompt", ["unknown column 'edit_imge' in the header; did you mean 'edit_image'?"]),
    ("imgae,edit_image,prompt", ["unknown column 'imgae' in the header; did you mean 'image'?"]),
    ("target,edit_image,prompt", ["unknown column 'target' in the header; the known columns",
                                  "metadata.csv: the header has no column 'image'; every row needs image and prompt"]),
])
def test_a_misspelt_csv_header_is_named_once(tmp_path, header, problems):
    """metadata.csv's header is checked as JSONL keys are: one problem per column, whatever the number of rows."""
    for i in range(1, 14):
        good(tmp_path, i)
    (tmp_path / "metadata.csv").write_text(header + "\n" + "".join(f"t{i}.png,r{i}_0.png,edit {i}\n"
                                                                   for i in range(1, 14)))
    msg = stop_message(tmp_path)
    assert msg.startswith(f"{len(problems)} problem(s) with the columns of"), msg
    assert all(p in msg for p in problems) and "line 2" not in msg


def test_columns_of_ones_own_are_read_once_listed(tmp_path):
    """An extra column stops the run until data.ignore_columns lists it; then the rows train as they are."""
    write_jsonl(tmp_path, [{**good(tmp_path, 1), "source_id": "a7"}, good(tmp_path, 2)])
    assert "unknown column 'source_id' in 1 row(s) (line 1); the known columns" in stop_message(tmp_path)
    assert [r.line for r in preflight(tmp_path, "edit", "stop", ignored=("source_id",))] == [1, 2]


def test_an_edit_model_trains_rows_without_references_only_when_asked(tmp_path):
    """Rows without edit_image on an edit model stop the run (naming them) unless data.rows_without_reference is
    "text_to_image", which trains them so and says how many; text-to-image models take only such rows."""
    from train.data.rows import check_references

    rows = preflight(write_jsonl(tmp_path, [good(tmp_path, 1), good(tmp_path, 2, refs=0)]), "edit", "stop")
    with pytest.raises(BadRowsError, match=r"^1 of 2 rows have no edit_image \(line 2\), but the edit variant is an "
                                           r"edit model: .* set qwen_edit.data.rows_without_reference to "
                                           r'"text_to_image" to train them as text-to-image samples$'):
        check_references(rows, "edit", "stop")
    assert check_references(rows, "edit", "text_to_image").startswith(
        "data: 1 of 2 rows have no edit_image: trained as text-to-image samples")
    assert check_references(rows[1:], "t2i", "stop", text_to_image=True) is None
    assert check_references(rows, "qwen_image_21", "stop", text_to_image=True) is None
    assert check_references(rows[:1], "edit", "stop") is None


def test_the_models_that_generate_from_text_alone_take_rows_without_references():
    """Qwen-Image (t2i) and Qwen-Image-2.1 (one model for both tasks) are the variants whose rows may lack
    references; every edit model's record says it needs them."""
    from train.model import family

    takes = {v.name: v.text_to_image for f in family.FAMILIES for v in f.variants}
    assert takes == {"edit": False, "edit_plus": False, "edit_plus_2511": False, "t2i": True, "qwen_image_21": True}


def test_jsonl_preferred_over_csv(tmp_path):
    """With both files present, metadata.jsonl is read."""
    write_jsonl(tmp_path, [good(tmp_path, 1)])
    (tmp_path / "metadata.csv").write_text("image,edit_image,prompt\nx.png,y.png,z\n")
    assert [r.target for r in read_rows(tmp_path)[0]] == ["t1.png"]


def test_check_row_direct(tmp_path):
    """check_row returns a list: empty for a good row, one entry per problem otherwise."""
    good(tmp_path, 1)
    assert check_row(Row(1, "t1.png", ["r1_0.png"], "p"), tmp_path, "edit") == []
    problems = check_row(Row(7, "t1.png", ["a.png", "b.png"], ""), tmp_path, "edit")
    assert len(problems) == 4 and all(p.startswith("row 7 (") for p in problems)


def test_ranks_without_process_group_check_only_their_share(tmp_path):
    """Without a process group each rank checks and reports only rows[rank::world_size]: the gather needs one."""
    assert not dist.is_initialized()
    lines = [good(tmp_path, 1), {**good(tmp_path, 2), "prompt": ""}, {**good(tmp_path, 3), "image": "x.png"},
             good(tmp_path, 4)]
    write_jsonl(tmp_path, lines)  # rank 0 checks lines 1 and 3, rank 1 lines 2 and 4
    msg0 = stop_message(tmp_path, rank=0, world_size=2)
    msg1 = stop_message(tmp_path, rank=1, world_size=2)
    assert "1 problem(s)" in msg0 and "row 3 (x.png): file not found" in msg0 and "row 2" not in msg0
    assert "1 problem(s)" in msg1 and "row 2 (t2.png): empty" in msg1 and "row 3" not in msg1
    assert [r.line for r in preflight(tmp_path, "edit", "skip", rank=0, world_size=2)] == [1, 2, 4]
    report = tmp_path / "report.txt"
    assert [r.line for r in preflight(tmp_path, "edit", "skip", 1, 2, report)] == [1, 3, 4]
    assert not report.exists()  # only rank 0 writes the report


def dataset(tmp: Path, variant: str, rows: list[dict]) -> EditDataset:
    return EditDataset(write_jsonl(tmp, rows), preflight(tmp, variant, "stop"), variant, AREA, CONDITION_AREA)


def expected_hw(size: tuple[int, int], area: int) -> tuple[int, int]:
    width, height = conditioning.dimensions(area, Image.new("RGB", size))
    assert width % 32 == 0 and height % 32 == 0
    return height, width


def test_edit_dataset_v1_shapes(tmp_path):
    """'edit': target and the one reference are (3, H, W) in [-1, 1]; the VL model gets the same resized image."""
    row = good(tmp_path, 1)
    png(tmp_path / "r1_0.png", size=(128, 64))
    sample = dataset(tmp_path, "edit", [row])[0]
    assert sample["target"].shape == (3, 64, 64) and sample["target"].dtype == torch.float32
    assert -1 <= sample["target"].min() < 0 < sample["target"].max() <= 1
    (ref,) = sample["reference_pixels"]
    h, w = expected_hw((128, 64), AREA)
    assert ref.shape == (3, h, w) and -1 <= ref.min() and ref.max() <= 1 and h != w
    assert [im.size for im in sample["vl_images"]] == [(w, h)]
    assert sample["prompt"] == "edit number 1" and sample["line"] == 1


def test_edit_plus_dataset_shapes(tmp_path):
    """'edit_plus': each reference's VAE copy is sized to `area`, its VL copy to `condition_area`."""
    row = good(tmp_path, 1, refs=2)
    png(tmp_path / "r1_1.png", size=(64, 128))
    sample = dataset(tmp_path, "edit_plus", [row])[0]
    assert sample["target"].shape == (3, 64, 64)
    assert [tuple(t.shape) for t in sample["reference_pixels"]] == [(3, 64, 64), (3, *expected_hw((64, 128), AREA))]
    vl_hw = [expected_hw(size, CONDITION_AREA) for size in [(64, 64), (64, 128)]]
    assert [im.size[::-1] for im in sample["vl_images"]] == vl_hw
    assert all(t.min() >= -1 and t.max() <= 1 for t in sample["reference_pixels"])


def test_dataset_file_changed_after_preflight(tmp_path):
    """A file deleted after the checks raises BadRowsError naming the row and file, not a bare OSError."""
    ds = dataset(tmp_path, "edit", [good(tmp_path, 1)])
    (tmp_path / "r1_0.png").unlink()
    with pytest.raises(BadRowsError, match=r"row 1 \(r1_0.png\): cannot be read any more"):
        ds[0]


def test_collate_stacks_same_size(tmp_path):
    """Same-size samples stack into (B, 3, H, W) per slot, with prompts and lines in order."""
    ds = dataset(tmp_path, "edit_plus", [good(tmp_path, 1, refs=2), good(tmp_path, 2, refs=2)])
    batch = collate([ds[0], ds[1]])
    assert batch["target"].shape == (2, 3, 64, 64)
    assert [tuple(t.shape) for t in batch["reference_pixels"]] == [(2, 3, 64, 64)] * 2
    assert batch["prompts"] == ["edit number 1", "edit number 2"] and batch["lines"] == [1, 2]
    assert len(batch["vl_images"]) == 2 and len(batch["vl_images"][0]) == 2


@pytest.mark.parametrize("resized, what", [("t2.png", "target"), ("r2_0.png", "reference 1")])
def test_collate_mixed_sizes_names_both_rows(tmp_path, resized, what):
    """Different target or reference sizes in one micro-batch raise a ValueError naming both rows and the fix."""
    rows = [good(tmp_path, 1), good(tmp_path, 2)]
    png(tmp_path / resized, size=(128, 64))
    ds = dataset(tmp_path, "edit", rows)
    with pytest.raises(ValueError, match=rf"rows \[1, 2\] mixes {what} sizes .*train_micro_batch_size_per_gpu = 1"):
        collate([ds[0], ds[1]])


def test_collate_mixed_reference_counts(tmp_path):
    """Samples with different numbers of references cannot share a micro-batch."""
    ds = dataset(tmp_path, "edit_plus", [good(tmp_path, 1, refs=1), good(tmp_path, 2, refs=2)])
    with pytest.raises(ValueError, match=r"rows \[1, 2\] mixes reference counts \[1, 2\]"):
        collate([ds[0], ds[1]])


@pytest.mark.parametrize("micro, world", [(1, 2), (2, 1)])
def test_build_loader_too_few_rows(tmp_path, micro, world):
    """Fewer rows than one micro-batch per rank raise BadRowsError with the counts and the fix."""
    ds = dataset(tmp_path, "edit", [good(tmp_path, 1)])
    with pytest.raises(BadRowsError, match=rf"1 usable rows cannot fill one micro-batch of {micro} on each of {world} "
                                           r"ranks; add rows or lower train_micro_batch_size_per_gpu"):
        build_loader(ds, micro, 0, world, seed=0, num_workers=0, pin_memory=False, shuffle=False)


def test_build_loader_yields_batches(tmp_path):
    """Enough rows give full micro-batches through collate: unshuffled, rows 1-4 cut into [1, 2], [3, 4] (row 5 is
    the remainder) and dealt round-robin, so rank 1 gets the second micro-batch."""
    ds = dataset(tmp_path, "edit", [good(tmp_path, i) for i in range(1, 6)])
    loader = build_loader(ds, 2, rank=1, world_size=2, seed=0, num_workers=0, pin_memory=False, shuffle=False)
    batches = list(loader)
    assert len(batches) == 1 and batches[0]["target"].shape == (2, 3, 64, 64) and batches[0]["lines"] == [3, 4]


@pytest.mark.parametrize("variant", ["edit", "edit_plus"])
def test_same_size_target_and_reference_share_one_lattice(tmp_path, variant):
    """A target and a reference of one size are resized onto the same pixel grid: the same picture as both gives
    equal tensors (any shift or zoom between them would be learnt as part of the edit)."""
    png(tmp_path / "same.png", size=(100, 75), seed=3)
    sample = dataset(tmp_path, variant, [{"image": "same.png", "edit_image": "same.png", "prompt": "keep"}])[0]
    assert sample["target"].shape == sample["reference_pixels"][0].shape
    assert torch.equal(sample["target"], sample["reference_pixels"][0])


def test_preflight_names_pairs_whose_aspect_ratios_cannot_align(tmp_path, capsys):
    """Rows whose target and reference aspect ratios differ by more than 1% are named on the console (the pair
    trains, since a reframing edit such as F2P's is legitimate); aligned pairs are not mentioned."""
    rows = [good(tmp_path, 1), good(tmp_path, 2), good(tmp_path, 3, refs=2)]
    png(tmp_path / "r2_0.png", size=(64, 60))
    png(tmp_path / "r3_1.png", size=(100, 64))
    kept = preflight(write_jsonl(tmp_path, rows), "edit_plus", "stop")
    out = capsys.readouterr().out
    assert len(kept) == 3
    assert "data: 2 reference(s) cannot align pixel for pixel with their target (aspect ratios more than 1%" in out
    assert "row 2 (t2.png 64x64): reference 1 r2_0.png 64x60: aspect ratio +6.7% off the target's" in out
    assert "row 3 (t3.png 64x64): reference 2 r3_1.png 100x64: aspect ratio +56.2% off" in out and "row 1 " not in out


def test_misfit_compares_the_resized_lattices():
    """Same size, or the same ratio at another resolution, aligns; ratios 0.5% apart that round to different sizes
    at data.area (200x128 -> 64x64, 201x128 -> 96x64 at 64^2) do not, nor do ratios more than 1% apart."""
    area = 64 * 64
    assert misfit((200, 128), (200, 128), area) is None and misfit((200, 128), (400, 256), area) is None
    assert misfit((200, 128), (201, 128), None) is None  # without data.area only the ratios are compared
    assert misfit((200, 128), (201, 128), area) == ("resizes to 96x64, the target to 64x64 (their aspect ratios "
                                                    "round to different sizes)")
    assert misfit((64, 64), (64, 60), area) == "aspect ratio +6.7% off the target's"


def test_misaligned_pairs_listed_in_full_next_to_the_report(tmp_path, capsys):
    """With data.area the pre-flight also flags pairs resized onto different lattices; the console names the first
    ones, misaligned_rows.txt (next to bad_rows.txt) all of them, and a later run whose pairs align removes it."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    rows = [good(data, i) for i in range(1, 14)]
    for i in range(1, 13):  # plain images: only their sizes matter
        Image.new("RGB", (200, 128)).save(data / f"t{i}.png")
        Image.new("RGB", (201, 128)).save(data / f"r{i}_0.png")
    preflight(write_jsonl(data, rows), "edit", "stop", report_path=out / "bad_rows.txt", area=64 * 64)
    console = capsys.readouterr().out
    listed = (out / "misaligned_rows.txt").read_text().splitlines()
    assert len(listed) == 12 and listed[11] == ("row 12 (t12.png 200x128): reference 1 r12_0.png 201x128: resizes "
                                                "to 96x64, the target to 64x64 (their aspect ratios round to "
                                                "different sizes)")
    assert "data: 12 reference(s) cannot align" in console and f"all listed in {out / 'misaligned_rows.txt'}" in console
    assert "row 10 (t10.png" in console and "row 11 (t11.png" not in console and "... and 2 more" in console
    assert not (out / "bad_rows.txt").exists() and "row 13 " not in console
    preflight(write_jsonl(data, rows[12:]), "edit", "stop", report_path=out / "bad_rows.txt", area=64 * 64)
    assert not (out / "misaligned_rows.txt").exists() and "cannot align" not in capsys.readouterr().out


def test_rotated_phone_reference_aligns_with_its_upright_target(tmp_path, capsys):
    """A phone JPEG stored 48x32 with EXIF orientation 6 is shown 32x48: as the reference of an upright 32x48 PNG it
    is a same-size pair (not flagged, same tensor shape), though the stored sizes differ."""
    stored = Image.new("RGB", (48, 32), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "phone.jpg", exif=exif.tobytes())
    png(tmp_path / "upright.png", size=(32, 48))
    rows = [{"image": "upright.png", "edit_image": "phone.jpg", "prompt": "tidy"}]
    kept = preflight(write_jsonl(tmp_path, rows), "edit", "stop", area=32 * 48)
    assert kept[0].sizes == [(32, 48), (32, 48)] and "cannot align" not in capsys.readouterr().out
    sample = EditDataset(tmp_path, kept, "edit", 32 * 48, 32 * 48)[0]
    (_, height, width) = sample["target"].shape
    assert sample["reference_pixels"][0].shape == sample["target"].shape and height > width
