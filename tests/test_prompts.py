"""Tests for train/data/prompts.py: normalisation, the mapping file, blocked terms, the report, and preflight's use."""

from __future__ import annotations

import json

import pytest
from test_data import good, write_jsonl

from train.data.pairs import BadRowsError, Row, preflight
from train.data.prompts import PromptProcessor, load_blocked_terms, load_mapping, normalize


def rows_of(*prompts: str) -> list[Row]:
    return [Row(i, f"t{i}.png", [f"r{i}.png"], p) for i, p in enumerate(prompts, start=1)]


def test_normalize_nfc_whitespace_and_strip():
    """Decomposed accents compose (NFC); tabs, newlines, NBSP and ideographic spaces collapse to one space."""
    assert normalize("  cafe\u0301\tau\n\n lait\u00a0\u3000noir ") == "caf\u00e9 au lait noir"
    assert normalize("already clean") == "already clean"


def test_mapping_whole_words_case_insensitive_longest_first():
    """Phrases match whole words in any case; the longest phrase wins; a replacement is not mapped again."""
    p = PromptProcessor(mapping={"red": "crimson", "red car": "scarlet automobile", "crimson": "X", "hat": "cap"})
    assert p.map("Make the RED car and the red hat, not the redder hatch") == (
        "Make the scarlet automobile and the crimson cap, not the redder hatch", 3)
    assert p.map("red\t car")[0] == "scarlet automobile"  # whitespace inside a phrase is any run of whitespace


def test_blocked_terms_whole_words_and_phrases():
    """A term blocks only as a whole word or phrase, in any case."""
    p = PromptProcessor(blocked_terms=["gore", "brand name", "c++"])
    assert p.blocked("add GORE here") == "GORE"
    assert p.blocked("gorgeous sky") is None and p.blocked("gore-tex jacket") == "gore"
    assert p.blocked("a Brand   Name logo") == "Brand   Name" and p.blocked("brand names") is None
    assert p.blocked("learn c++ now") == "c++"


@pytest.mark.parametrize("policy, kept", [("drop", [2, 3]), ("keep", [1, 2, 3])])
def test_apply_processes_filters_and_counts(policy, kept):
    """apply() returns processed rows (dropping blocked ones under "drop") and counts everything it did."""
    p = PromptProcessor(mapping={"kitty": "cat"}, blocked_terms=["secret"], blocked_policy=policy)
    out = p.apply(rows_of("a  Secret kitty", "kitty and kitty", "plain"))
    assert [r.line for r in out] == kept
    assert out[-2].prompt == "cat and cat" and out[-1].prompt == "plain"
    r = p.report
    assert (r.num_rows, r.num_normalized, r.num_mapped, r.num_replacements, r.blocked_lines) == (3, 1, 2, 3, [1])
    word = "dropped" if policy == "drop" else "kept"
    assert r.summary() == (f"prompts: 3 rows, 1 normalised, 2 mapped (3 replacements), 1 with a blocked term "
                           f"({word}): rows 1")


def test_normalisation_off_keeps_the_text():
    p = PromptProcessor(normalize_prompts=False, mapping={"a b": "c"})
    assert p.process(" x  a   b ") == " x  c "
    assert p.apply(rows_of(" x ")) == rows_of(" x ") and p.report.num_normalized == 0


def test_load_mapping_errors(tmp_path):
    """Invalid JSON, a non-object, non-string values, empty or duplicate phrases each name the fix."""
    cases = {"bad.json": ("{oops", "not valid JSON (line 1, column 2"),
             "list.json": ("[1]", "must hold one JSON object of strings"),
             "num.json": ('{"a": 1}', "must hold one JSON object of strings"),
             "empty.json": ('{" ": "x"}', "an empty phrase"),
             "dup.json": ('{"Red  car": "x", "red car": "y"}', "appears twice")}
    for name, (text, fragment) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            load_mapping(tmp_path / name)
    (tmp_path / "ok.json").write_text('{"Red  Car": "auto"}')
    assert load_mapping(tmp_path / "ok.json") == {"red car": "auto"}


def test_load_blocked_terms_skips_blank_and_comment_lines(tmp_path):
    (tmp_path / "b.txt").write_text("# comment\n\n  Bad   Word \nother\n")
    assert load_blocked_terms(tmp_path / "b.txt") == ["Bad Word", "other"]
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read .* as UTF-8 text"):
        load_blocked_terms(tmp_path / "bin.txt")


def test_preflight_trains_on_processed_prompts_and_skips_checking_dropped_rows(tmp_path):
    """preflight processes prompts before the checks: a dropped row's missing image is no problem, and the
    rows it returns carry the processed prompt."""
    rows = [{**good(tmp_path, 1), "prompt": "paint  the kitty"}, {**good(tmp_path, 2), "prompt": "a secret"},
            good(tmp_path, 3)]
    (tmp_path / "t2.png").unlink()
    write_jsonl(tmp_path, rows)
    p = PromptProcessor(mapping={"kitty": "cat"}, blocked_terms=["secret"])
    got = preflight(tmp_path, "edit", "stop", processor=p)
    assert [(r.line, r.prompt) for r in got] == [(1, "paint the cat"), (3, "edit number 3")]
    assert p.report.blocked_lines == [2]


def test_preflight_all_rows_blocked(tmp_path):
    write_jsonl(tmp_path, [{**good(tmp_path, 1), "prompt": "secret"}])
    with pytest.raises(BadRowsError, match=r"all 1 rows .* have a blocked term .*blocked_policy to \"keep\""):
        preflight(tmp_path, "edit", "stop", processor=PromptProcessor(blocked_terms=["secret"]))


def test_from_config_reads_the_files(tmp_path):
    from train.config import DataConfig

    (tmp_path / "m.json").write_text(json.dumps({"kitty": "cat"}))
    (tmp_path / "b.txt").write_text("secret\n")
    p = PromptProcessor.from_config(DataConfig(prompt_mapping=str(tmp_path / "m.json"),
                                               blocked_terms=str(tmp_path / "b.txt"), blocked_policy="keep"))
    assert p.process(" a  kitty ") == "a cat" and p.blocked("top secret") == "secret"
    assert p.blocked_policy == "keep"
