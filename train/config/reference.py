"""The configuration reference, docs/configuration.md, generated from the schema's field docstrings (field_docs), so
that the page cannot drift from the code. Regenerate it after changing a field:

    python -m train.config.reference > docs/configuration.md

A test compares the committed page with reference_markdown().
"""

from __future__ import annotations

import dataclasses
import json

from train.config.schema import PROJECT_KEY, ProjectConfig, field_docs

REGENERATE = "python -m train.config.reference > docs/configuration.md"

INTRO = f"""\
# Configuration

One JSON file selects everything: DeepSpeed's own keys plus the project's section `{PROJECT_KEY}`. A knob lives in
one place. DeepSpeed's keys hold the precision (`bf16.enabled` / `fp16.enabled`), `train_micro_batch_size_per_gpu`,
`gradient_accumulation_steps`, `gradient_clipping`, `optimizer`, `scheduler` and `zero_optimization`. Leave
`train_batch_size` out so that one file fits any world size (if given, it must equal micro-batch x accumulation x
world size). For `WarmupDecayLR` and `WarmupCosineLR` the schedule's length is filled from `train.max_steps`.

Everything is checked before a model loads, and all problems come in one error that names each key and its fix:
the `{PROJECT_KEY}` section's, the trainer's checks of DeepSpeed's keys and DeepSpeed's own, together. The
`{PROJECT_KEY}` section is read strictly: no unknown key, no `"8"` for 8, no `1` for true, no NaN or Infinity.
DeepSpeed's section is read by DeepSpeed's own config classes too, every section of it, so a misspelled key is named
with the nearest one it knows. A file with `"gradient_clipping": "1.0"` and `overlap_com` gets one error listing
both, `gradient_clipping: must be a number >= 0 (0 = off), got "1.0"` and `zero_optimization.overlap_com: Extra
inputs are not permitted (DeepSpeed's check); rename it to 'overlap_comm' or remove it`.

The resolved config is written to `OUTPUT/config.json` once the run starts and stored in every checkpoint.

The command line overrides five keys: `--model`, `--data`, `--output_dir`, `--max_steps` and `--seed`. Relative
paths in the JSON are relative to the directory the command starts in, not to the JSON file's folder; the image
paths inside `metadata.jsonl` are relative to the data folder, those inside `validation.file` to that file's folder.

The tables below list every key of the `{PROJECT_KEY}` section with its default.
"""


def field_defaults(config: ProjectConfig | None = None) -> dict[str, object]:
    """{'model.path': '', ...}: each field's default, keyed as field_docs keys its docstring."""
    flat: dict[str, object] = {}
    for section, values in dataclasses.asdict(config or ProjectConfig()).items():
        flat.update({f"{section}.{name}": value for name, value in values.items()})
    return flat


def _cell(text: str) -> str:
    """A docstring as one table cell: its lines joined, and pipes escaped so they do not end the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def reference_markdown() -> str:
    """The whole page: the intro, then one table per section of the schema, in the schema's order."""
    docs, defaults = field_docs(), field_defaults()
    lines = [f"*Generated from the field docstrings of train/config/schema.py; regenerate with `{REGENERATE}`.*", ""]
    lines.append(INTRO.rstrip("\n"))
    section = None
    for key, doc in docs.items():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines += ["", f"## `{PROJECT_KEY}.{section}`", "", "| key | default | what it does |", "|---|---|---|"]
        lines.append(f"| `{key}` | `{json.dumps(defaults[key])}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
