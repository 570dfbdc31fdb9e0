"""Export a DeepSpeed checkpoint without training or a process group (train/runtime/exports.py says how).

    python -m train.export --checkpoint OUT/global_stepN --out DIR [--format diffusers|comfyui] [--dtype float32]
        [--overwrite]

Outputs: a LoRA in the diffusers layout (DIR/pytorch_lora_weights.safetensors) or the ComfyUI layout
(DIR/lora_comfyui.safetensors), or for a full fine-tune a diffusers transformer directory (DIR/transformer/).
"""

from __future__ import annotations

import argparse
import sys

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from train.model import family
from train.runtime import exports


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export a qwen-edit-trainer DeepSpeed checkpoint (LoRA or full)")
    parser.add_argument("--checkpoint", required=True, help="OUT/global_stepN (holds mp_rank_00_model_states.pt)")
    parser.add_argument("--out", required=True, help="directory to write the export into")
    parser.add_argument("--format", choices=("diffusers", "comfyui"), default="diffusers",
                        help="LoRA key layout (full fine-tunes are always a diffusers transformer directory)")
    parser.add_argument("--dtype", choices=exports.DTYPES, default="float32", help="dtype of the written weights")
    parser.add_argument("--model", help="base model directory, when it moved since training (default: the "
                                        "checkpoint's qwen_edit.model.path)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an export that --out already holds (without it the command refuses)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 on success, 2 for a bad checkpoint or argument (message on stderr)."""
    args = parse_args(argv)
    try:
        path = exports.export(args.checkpoint, args.out, args.format, args.dtype, args.model, args.overwrite,
                              family_of=family.family_for)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
