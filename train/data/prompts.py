"""Prompt processing before training: normalisation, a synonym mapping, and a blocked-terms filter.

Applied to every row right after the metadata is read (data.preflight), in this order:
1. normalise (data.normalize_prompts): Unicode NFC, every run of whitespace (tabs, newlines, NBSP ...) becomes
   one space, no leading/trailing space;
2. map (data.prompt_mapping, JSON {"phrase": "replacement"}): whole words or phrases, case-insensitive, the
   longest phrase first, in one pass (a replacement is not mapped again);
3. block (data.blocked_terms, a text file of one term per line; blank lines and lines starting with '#' are
   skipped): a row whose processed prompt contains a term (whole word or phrase, case-insensitive) is dropped
   or kept per data.blocked_policy, and counted either way.
The prompt the trainer encodes is the processed one. Phrases and terms are normalised like prompts, and a space
inside one matches any run of whitespace, so the rules hold whether or not normalisation is on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from train.config.files import load_blocked_terms, load_mapping, normalize, phrase_key

if TYPE_CHECKING:
    from train.config import DataConfig
    from train.data.rows import Row

_SHOWN_LINES = 10  # row lines named in the report per kind


def _phrase_pattern(phrases: list[str]) -> re.Pattern | None:
    """Whole-word, case-insensitive alternation of `phrases`, longest first (so "red car" wins over "red")."""
    if not phrases:
        return None
    ordered = sorted(phrases, key=len, reverse=True)
    body = "|".join(r"\s+".join(re.escape(word) for word in p.split()) for p in ordered)
    return re.compile(rf"(?<!\w)(?:{body})(?!\w)", re.IGNORECASE)


@dataclass
class PromptReport:
    """What processing did to the rows' prompts; `summary()` is printed before training."""

    num_rows: int = 0
    num_normalized: int = 0  # prompts that normalisation changed
    num_mapped: int = 0  # prompts that the mapping changed
    num_replacements: int = 0  # phrases replaced in all
    blocked_lines: list[int] = field(default_factory=list)  # rows whose prompt has a blocked term
    policy: str = "drop"

    def summary(self) -> str:
        blocked = len(self.blocked_lines)
        text = (f"prompts: {self.num_rows} rows, {self.num_normalized} normalised, {self.num_mapped} mapped "
                f"({self.num_replacements} replacements), {blocked} with a blocked term ")
        text += f"({'dropped' if self.policy == 'drop' else 'kept'})"
        if blocked:
            shown = ", ".join(map(str, self.blocked_lines[:_SHOWN_LINES]))
            text += f": rows {shown}" + (" ..." if blocked > _SHOWN_LINES else "")
        return text


class PromptProcessor:
    """Normalise, map and filter prompts; `apply(rows)` returns the rows to train on and fills `self.report`."""

    def __init__(self, normalize_prompts: bool = True, mapping: dict[str, str] | None = None,
                 blocked_terms: list[str] | None = None, blocked_policy: str = "drop"):
        if blocked_policy not in ("drop", "keep"):
            raise ValueError(f"blocked_policy must be 'drop' or 'keep', got {blocked_policy!r}")
        self.normalize_prompts, self.blocked_policy = normalize_prompts, blocked_policy
        self.mapping = {phrase_key(k): v for k, v in (mapping or {}).items()}
        self._mapping_re = _phrase_pattern(list(self.mapping))
        self._blocked_re = _phrase_pattern([normalize(t) for t in blocked_terms or [] if normalize(t)])
        self.report = PromptReport(policy=blocked_policy)

    @classmethod
    def from_config(cls, data: DataConfig) -> PromptProcessor:
        """From qwen_edit.data (the files were checked by config validation)."""
        mapping = load_mapping(data.prompt_mapping) if data.prompt_mapping else None
        terms = load_blocked_terms(data.blocked_terms) if data.blocked_terms else None
        return cls(data.normalize_prompts, mapping, terms, data.blocked_policy)

    def map(self, text: str) -> tuple[str, int]:
        """(text with mapped phrases replaced, number of replacements)."""
        if self._mapping_re is None:
            return text, 0
        return self._mapping_re.subn(lambda m: self.mapping[phrase_key(m.group(0))], text)

    def blocked(self, text: str) -> str | None:
        """The first blocked term in `text`, or None."""
        match = self._blocked_re.search(text) if self._blocked_re is not None else None
        return match.group(0) if match else None

    def process(self, text: str) -> str:
        """The prompt as the trainer encodes it (normalised, then mapped)."""
        if self.normalize_prompts:
            text = normalize(text)
        return self.map(text)[0]

    def apply(self, rows: list[Row]) -> list[Row]:
        """Processed copies of `rows`, without the blocked ones under policy "drop"; counts go to self.report."""
        report = PromptReport(num_rows=len(rows), policy=self.blocked_policy)
        out = []
        for row in rows:
            text = normalize(row.prompt) if self.normalize_prompts else row.prompt
            report.num_normalized += text != row.prompt
            mapped, count = self.map(text)
            report.num_mapped += mapped != text
            report.num_replacements += count
            if self.blocked(mapped) is not None:
                report.blocked_lines.append(row.line)
                if self.blocked_policy == "drop":
                    continue
            out.append(replace(row, prompt=mapped))
        self.report = report
        return out
