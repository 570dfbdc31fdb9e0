"""Metadata and edit-list reading (train/textfile.py and its users): editor line numbers, BOMs, encodings, CSV
rows with too many fields; train.infer output names that spell one file."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from test_data import good, png, write_jsonl

from train.config import textfile
from train.data.pairs import BadRowsError, preflight, read_rows
from train.model import renders


def test_line_numbers_are_an_editors(tmp_path):
    """A form feed, vertical tab or U+2028 inside a prompt starts no line (str.splitlines would); CRLF counts once."""
    rows = [good(tmp_path, i) for i in range(3)]
    rows[0]["prompt"] = "make it\x0cred\x0b\u2028now"
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:2]) + '\r\nnot json\r\n'
    (tmp_path / "metadata.jsonl").write_text(text, encoding="utf-8", newline="")
    parsed, problems = read_rows(tmp_path)
    assert [r.line for r in parsed] == [1, 2] and parsed[0].prompt == rows[0]["prompt"]
    assert problems == ["metadata.jsonl line 3: not valid JSON (Expecting value); write one JSON object per line"]


def test_jsonl_bom_is_skipped_like_csv(tmp_path):
    write_jsonl(tmp_path, [good(tmp_path, 0)])
    (tmp_path / "metadata.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "metadata.jsonl").read_bytes())
    parsed, problems = read_rows(tmp_path)
    assert len(parsed) == 1 and not problems


@pytest.mark.parametrize("name", ["metadata.jsonl", "metadata.csv"])
def test_non_utf8_metadata_is_a_named_error(tmp_path, name):
    """Latin-1 bytes on line 2 are named with the file, line and byte, not a UnicodeDecodeError traceback."""
    first = b'{"image": "a", "edit_image": "b", "prompt": "x"}\n'
    header = b"image,edit_image,prompt\n" if name.endswith(".csv") else first
    (tmp_path / name).write_bytes(header + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(BadRowsError, match=f"{name} line 2: not UTF-8 text \\(byte 0xe9 at offset"):
        preflight(tmp_path, "edit", "stop")


def test_csv_row_with_too_many_fields_is_reported(tmp_path):
    """An unquoted comma in a prompt makes one field more than the header: reported, not a cut prompt."""
    for i in range(2):
        good(tmp_path, i)
    (tmp_path / "metadata.csv").write_text("image,edit_image,prompt\nt0.png,r0_0.png,make it red\n"
                                           "t1.png,r1_0.png,make it red, then blue\n")
    parsed, problems = read_rows(tmp_path)
    assert [r.line for r in parsed] == [2]
    assert problems == ['metadata.csv line 3: 4 fields but the header has 3; put a prompt with commas in double '
                        'quotes ("...")']


def test_text_lines_keep_a_last_line_without_newline(tmp_path):
    (tmp_path / "f.txt").write_bytes(b"a\nb\r\n\nc")
    assert textfile.lines(tmp_path / "f.txt") == [(1, "a"), (2, "b"), (3, ""), (4, "c")]


def test_output_names_that_name_one_file_are_duplicates(tmp_path):
    """'./x', 'x.png' and 'x' are one file, as are 'a//b' and 'a/./b'; names the file system refuses are bad rows."""
    outputs = ["x", "./x", "x.png", "a//b", "a/./b", "a/b/", "bad\x00name", "y" * 300, "ok/name"]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps({"edit_image": "a.png", "prompt": "p", "output": o}) + "\n"
                                                  for o in outputs))
    requests, problems = renders.read_requests(tmp_path / "edits.jsonl")
    assert [(q.line, q.name) for q in requests] == [(1, "x"), (4, "a/b"), (9, "ok/name")]
    msgs = {line: msg for _, line, msg in problems}
    assert "'x' is already used by line 1" in msgs[2] and "'x' is already used by line 1" in msgs[3]
    assert "'a/b' is already used by line 4" in msgs[5]
    assert "is not a file name" in msgs[6] and "is not a file name" in msgs[7]
    assert "longer than 251 bytes" in msgs[8]


def test_inference_skips_bombs_and_images_that_resize_to_nothing(tmp_path, monkeypatch):
    """A decompression bomb and an 8192x1 strip (its resize rounds the height to 0) are bad rows, not crashes."""
    png(tmp_path / "fine.png")
    png(tmp_path / "strip.png", size=(8192, 1))
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps({"edit_image": name, "prompt": "p"}) + "\n"
                                                  for name in ("fine.png", "strip.png", "bomb.png")))
    png(tmp_path / "bomb.png", size=(256, 256))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 256 * 256 // 3)  # 256x256 is then over twice the limit
    requests, _ = renders.read_requests(tmp_path / "edits.jsonl")
    found = [renders.check_request(q, "edit") for q in requests]
    assert found[0] is None
    assert "strip.png: 8192x1 px resizes to a side below 32 px" in found[1]
    assert "bomb.png: too large to decode safely" in found[2]


def test_infer_names_an_input_that_is_not_utf8(tmp_path, tiny_edit):
    from train import infer

    (tmp_path / "edits.jsonl").write_bytes(b'{"edit_image": "a.png", "prompt": "caf\xe9"}\n')
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(tmp_path / "edits.jsonl"),
                             "--out", str(tmp_path / "out")])
    assert infer.check_args(args, world_size=1) == [
        f"--input: {tmp_path / 'edits.jsonl'} line 1: not UTF-8 text (byte 0xe9 at offset 38); save the file as UTF-8"]


def test_preflight_names_images_whose_resize_keeps_no_side(tmp_path):
    """An 8192x1 strip resizes to a height of 0 at any training area: the pre-flight names it (it used to crash the
    step that drew it)."""
    rows = [good(tmp_path, 0), good(tmp_path, 1)]
    png(tmp_path / "strip.png", size=(8192, 1))
    rows[1]["edit_image"] = "strip.png"
    write_jsonl(tmp_path, rows)
    with pytest.raises(BadRowsError, match="row 2 \\(strip.png\\): 8192x1 px resizes to \\d+x0 at data.area = 4096"):
        preflight(tmp_path, "edit", "stop", area=64 * 64, condition_area=32 * 32)
    assert [r.line for r in preflight(tmp_path, "edit", "skip", area=64 * 64, condition_area=32 * 32)] == [1]


@pytest.mark.parametrize("variant", ["edit", "edit_plus"])
def test_prompt_length_is_what_the_processor_encodes(tiny_edit, variant):
    """conditioning.prompt_length (tokenizer + the image processor's patch count) equals the processor's own
    expansion of the template with real images, minus the dropped prefix."""
    from transformers import Qwen2VLProcessor

    from train.model.qwen_image import conditioning

    processor = Qwen2VLProcessor.from_pretrained(tiny_edit / "model" / "processor", local_files_only=True)
    images = [Image.new("RGB", size) for size in ((320, 192), (224, 224))][: 1 if variant == "edit" else 2]
    prompt = "make the sky a deep red " * 20
    text = conditioning.prompt_texts([prompt], len(images), variant)[0]
    encoded = processor(text=[text], images=images, return_tensors="pt")["input_ids"].shape[1]
    assert conditioning.prompt_length(processor, prompt, variant, [im.size for im in images]) == encoded - 64


def test_preflight_names_a_prompt_longer_than_the_text_positions(tmp_path, tiny_edit):
    """A prompt past the rotary embedding's 4096 positions crashed the step that drew it; now the pre-flight names
    the row and by how much it is too long."""
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.from_pretrained(tiny_edit / "model" / "processor", local_files_only=True)
    rows = [good(tmp_path, 0), good(tmp_path, 1)]
    rows[1]["prompt"] = "make the sky a deep red and " * 1000
    write_jsonl(tmp_path, rows)
    with pytest.raises(BadRowsError, match="row 2 \\(t1.png\\): the prompt takes \\d+ text positions with its "
                                           "reference image\\(s\\), but next to images of this size the transformer "
                                           "has 4094; shorten the prompt by \\d+ tokens"):
        preflight(tmp_path, "edit", "stop", area=64 * 64, condition_area=32 * 32, tokens=processor)
    rows[1]["prompt"] = "make the sky a deep red and " * 100
    write_jsonl(tmp_path, rows)
    assert len(preflight(tmp_path, "edit", "stop", area=64 * 64, condition_area=32 * 32, tokens=processor)) == 2


def test_inference_skips_a_prompt_longer_than_the_text_positions(tmp_path, tiny_edit):
    """train.infer checks each row's prompt with the pipeline's processor: too long is a bad row, not a crashed
    batch; a normal prompt passes."""
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.from_pretrained(tiny_edit / "model" / "processor", local_files_only=True)
    png(tmp_path / "a.png")
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps({"edit_image": "a.png", "prompt": p}) + "\n"
                                                  for p in ("make it red", "make the sky a deep red and " * 1000)))
    requests, _ = renders.read_requests(tmp_path / "edits.jsonl")
    found = [renders.check_request(q, "edit", 128 * 128, 64 * 64, processor) for q in requests]
    assert found[0] is None
    assert "the prompt takes" in found[1] and "the transformer has 4092; shorten the prompt by" in found[1], found[1]
